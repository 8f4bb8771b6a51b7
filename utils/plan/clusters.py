"""The machines a plan is for: config/clusters/clusters.yaml (or a user's --cluster_file), and this machine, measured.

A :class:`Cluster` is what the planner needs of a machine: GPUs per node and their memory, the dense peak FLOP/s
per precision (the datasheet table of utils/observe/flops.py unless the entry gives them), the bandwidths inside a
node and between nodes, a latency, and the efficiency (achieved fraction of the peak) per model and precision.
``this-machine`` is measured once (a matmul probe with one thread per process, as torchrun runs it; a 2-process
gloo all-reduce timed as comm_check.py times it; the RAM) and cached in runs/this_machine.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import psutil
import torch
import yaml

from models.spec import built_in_names
from utils.config import ConfigError
from utils.observe.flops import gpu_spec_peak_flops, measure_matmul_flops

REPO = Path(__file__).resolve().parent.parent.parent
CLUSTER_FILE = REPO / "config" / "clusters" / "clusters.yaml"
THIS_MACHINE = "this-machine"
CACHE = REPO / "runs" / "this_machine.json"
FIELDS = ("gpu", "gpus_per_node", "memory_gb", "nvlink_gbps", "network_gbps", "latency_us", "efficiency")
PRECISIONS = ("bf16", "fp32")  # the planner's compute dtypes: bf16 (autocast or parameters), fp32 (TF32 on GPUs)


@dataclass(frozen=True)
class Cluster:
    """One machine type (see the module docstring); bandwidths in bytes/s, peaks in FLOP/s, memory in bytes."""

    name: str
    device: str  # "cuda" or "cpu": what the scripts run on
    gpu: str
    gpus_per_node: int
    memory_bytes: float
    peak_flops: dict  # precision -> FLOP/s per GPU (or CPU process)
    intra_bw: float  # per GPU and direction, inside a node
    inter_bw: float  # per node and direction
    latency_s: float
    efficiency: dict  # model -> precision -> fraction of the peak
    source: str = "config/clusters/clusters.yaml"
    submit: str = "sbatch --nodes {nodes}"  # how a job starts there (then submit_multinode.sh SCRIPT ...)
    sbatch_options: str = ""  # further sbatch options every job there needs (--mem ...), after submit
    hbm_bandwidth: float = 0.0  # per GPU, B/s: the per-class compute model (utils/plan/compute.py); 0: efficiency

    def submit_line(self, nodes: int) -> str:
        """The command that starts a job of ``nodes`` nodes there, up to the job script."""
        return " ".join(part for part in (self.submit.format(nodes=nodes), self.sbatch_options) if part)

    def efficiency_of(self, model: str, precision: str) -> float:
        """The entry's fraction for ``model``; a model it does not name (yours) takes its ``default``, a guess
        that :meth:`assumed` says is one."""
        try:
            return float(self.efficiency.get(model, self.efficiency.get(DEFAULT_EFFICIENCY, {}))[precision])
        except KeyError:
            raise ConfigError(f"cluster {self.name}: no efficiency for model {model}, precision {precision}: add "
                              f"efficiency: {{{model}: {{{precision}: 0.3}}}} to its entry") from None

    def assumed(self, model: str) -> str:
        """The note for a model whose efficiency on this cluster is the default's, not measured ("" if measured)."""
        if model in self.efficiency or DEFAULT_EFFICIENCY not in self.efficiency:
            return ""
        guess = ", ".join(f"{p} {v:g}" for p, v in self.efficiency[DEFAULT_EFFICIENCY].items())
        return (f"note: {self.name} has no measured efficiency for model {model}: samples/s assume the default's "
                f"({guess}); measure a step and add efficiency: {{{model}: {{...}}}} to its entry (--cluster_file)")


DEFAULT_EFFICIENCY = "default"
"""The efficiency entry of a model that has none of its own."""


def read_cluster_file(path: Path) -> dict[str, dict]:
    """The entries of a clusters YAML file (names starting with '_' are YAML anchors for the others)."""
    if not path.is_file():
        raise ConfigError(f"cluster file {path} does not exist: pass a YAML file of cluster entries (see "
                          f"{_shown(CLUSTER_FILE)})")
    try:
        entries = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        raise ConfigError(f"{path} must map cluster names to mappings of fields ({', '.join(FIELDS)})")
    return {name: entry for name, entry in entries.items() if not str(name).startswith("_")}


def load_cluster(name: str, path: Optional[Path] = None) -> Cluster:
    """The named cluster of ``path`` (default: config/clusters/clusters.yaml, plus ``this-machine``), checked."""
    entries = read_cluster_file(CLUSTER_FILE)
    if path is not None:
        entries.update(read_cluster_file(Path(path)))
    if name not in entries:
        raise ConfigError(f"unknown cluster {name!r}; valid: {', '.join(entries)} (or add yours with --cluster_file)")
    entry = entries[name]
    if entry.get("measured"):
        return this_machine()
    missing = [f for f in FIELDS if f not in entry]
    if missing:
        raise ConfigError(f"cluster {name!r} lacks {', '.join(missing)}: every entry needs {', '.join(FIELDS)}")
    peaks = {}
    for precision, key, table in (("bf16", "peak_bf16_tflops", "bf16"), ("fp32", "peak_tf32_tflops", "tf32")):
        peak = entry[key] * 1e12 if key in entry else gpu_spec_peak_flops(str(entry["gpu"]), table)
        if peak is None:
            raise ConfigError(f"cluster {name!r}: no datasheet peak for gpu {entry['gpu']!r}: add {key} to its entry")
        peaks[precision] = float(peak)
    try:
        return Cluster(name, str(entry.get("device", "cuda")), str(entry["gpu"]), int(entry["gpus_per_node"]),
                       float(entry["memory_gb"]) * 1e9, peaks, float(entry["nvlink_gbps"]) * 1e9,
                       float(entry["network_gbps"]) * 1e9, float(entry["latency_us"]) * 1e-6,
                       dict(entry["efficiency"]), _shown(Path(path) if path else CLUSTER_FILE),
                       str(entry.get("submit", Cluster.submit)),
                       str(entry.get("sbatch_options", Cluster.sbatch_options)),
                       float(entry.get("hbm_gbps", 0.0)) * 1e9)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"cluster {name!r}: a field is not a number ({e}): see the fields in {_shown(CLUSTER_FILE)}") \
            from None


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the repository when inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------------------ this machine

CPU_EFFICIENCY = 0.15  # when a step is too long to measure: bench_mp.py's vit_quickstart, 2 processes (0.1-0.2)


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else the architecture; with the core count."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.uname().machine}, {os.cpu_count()} cores"


def _measure_gloo_busbw() -> tuple[float, float]:
    """(bus bandwidth bytes/s, seconds per ring step) of 2 CPU processes, from comm_check.py's own table."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "comm_check.py"), "--min-bytes", "4KiB", "--max-bytes", "16MiB", "--factor", "4096",
           "--iters", "10", "--seconds-per-size", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    rows = [line.split() for line in proc.stdout.splitlines() if line.strip().startswith("all_reduce")]
    if proc.returncode or len(rows) < 2:
        raise ConfigError(f"measuring this machine's all-reduce failed (comm_check.py exited {proc.returncode}): run "
                          "`torchrun --nproc-per-node 2 comm_check.py` to see why")
    small, large = rows[0], rows[-1]  # columns: name, size, count, type, time(us), algbw, busbw, wrong
    # A 4 KiB all-reduce of 2 ranks is 2 ring steps of almost nothing: its time is latency.
    return float(large[6]) * 1e9, float(small[4]) * 1e-6 / 2


def this_machine(refresh: bool = False) -> Cluster:
    """This computer as a cluster of one node, one process per core: measured once, then read from CACHE."""
    if CACHE.is_file() and not refresh:
        data = json.loads(CACHE.read_text())
    else:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # what each process of torchrun gets (OMP_NUM_THREADS=1)
        try:
            peak = measure_matmul_flops("cpu", budget_s=2.0)
            peak_bf16 = measure_matmul_flops("cpu", torch.bfloat16, budget_s=2.0)
        finally:
            torch.set_num_threads(threads)
        busbw, latency = _measure_gloo_busbw()
        processes = os.cpu_count() or 1
        data = {"name": THIS_MACHINE, "device": "cpu", "gpu": cpu_name(), "gpus_per_node": processes,
                "memory_bytes": psutil.virtual_memory().total / processes,
                "peak_flops": {"fp32": peak, "bf16": peak_bf16}, "intra_bw": busbw, "inter_bw": busbw,
                "latency_s": latency,
                "efficiency": {m: dict.fromkeys(PRECISIONS, CPU_EFFICIENCY) for m in built_in_names()},
                "source": f"measured on {cpu_name()}, cached in {_shown(CACHE)}"}
        _write_cache(data)
    return Cluster(**{k: v for k, v in data.items() if k != "measured_efficiency"})


def _write_cache(data: dict) -> None:
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    tmp = CACHE.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(CACHE)  # never half-written


def measured_efficiency(key: str) -> Optional[float]:
    """A training step's efficiency measured on this machine before (see utils/plan/planner.py), or None."""
    if not CACHE.is_file():
        return None
    return json.loads(CACHE.read_text()).get("measured_efficiency", {}).get(key)


def remember_efficiency(key: str, value: float) -> None:
    data = json.loads(CACHE.read_text())
    data.setdefault("measured_efficiency", {})[key] = value
    _write_cache(data)


def describe(cluster: Cluster) -> dict:
    return asdict(cluster)
