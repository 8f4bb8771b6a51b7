"""The GPU check: this project's CUDA paths proven on one GPU in under 8 minutes, with one report.

    python3 tests/gpu_check.py --out DIR                # on a machine with a CUDA GPU (make gpu-check)
    python tests/gpu_check.py --out DIR --tiny          # the CPU dry run of the same items (tests/test_gpu_check.py)
    python3 tests/gpu_check.py --out DIR --only ladder   # again, only the items whose names start so

Items, in order of importance (benchmarks/README.md, "The GPU check", says what each measures): the environment;
a small synthetic data set made here; the tests marked ``cuda``; Steps 1-2 for real (the whole 720x1440 SwinIR
field at batch 1 in bf16 + AC, bf16 and fp32, then vit_mp with and without AC: measured peak next to the
estimate, seconds per step); bench_model.py's MFU against the measured bf16 matmul peak; train_with_profiling.py
(trace with kernels, memory timeline, snapshot); the single-device ladder, one rung per run.

Each item is a subprocess with a timeout inside one overall budget (--budget-s); an item that no longer fits is
reported "not run: time budget". DIR/gpu_check.json and DIR/gpu_check.md are rewritten after every item, so a
check cut short still leaves its report. This process uses the standard library only (a torch that does not
import, or a CUDA that hangs, is a failed item, not a lost report); the items need the project's requirements
and pytest, no network. ``--tiny`` hides any GPU and shrinks every size: the same code paths in seconds.
Exit code: 0 when nothing failed, 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
REPORT = "gpu_check"  # DIR/gpu_check.json and DIR/gpu_check.md
TOLERANCE = 0.15  # the memory estimate's goal on a GPU: within 15 % of the measured peak

# The test files that hold tests marked cuda (tests/test_gpu_check.py checks that none is missing): listed, not
# discovered, so that a test module needing a package the GPU machine lacks cannot stop the collection.
CUDA_TEST_FILES = ["tests/test_model.py", "tests/test_amp_ac.py", "tests/test_device_pipeline.py",
                   "tests/test_profiling.py", "tests/test_ddp.py", "tests/test_fsdp.py"]

# The ladder's rungs this check climbs, one run each ("device pipeline" carries the baseline's, the loader
# workers' and its own keys, so that every later rung adds one key to a fed GPU), and why the dry run skips one.
LADDER = {"device pipeline": "", "tf32": "", "bf16": "bf16 on a CPU may be emulated (slower than fp32)",
          "fused adamw": "the dry run climbs one rung", "compile": "inductor compiles for minutes on a CPU",
          "cuda graphs": ""}

# Sizes: the GPU's (chosen from FLOP counts to end within the budget on an H100, about 6-7 minutes), and the dry
# run's: the GPU's arguments followed by the ones that shrink them (a later value wins), so that the dry run
# parses every GPU argument with its script's own parser and an argument a script no longer takes fails on a CPU.
TINY_SWINIR = ["--model_args", "{depths: [2], num_heads: [2], embed_dim: 16, window_size: 8}"]
GPU_SIZES = dict(
    data=["--samples-per-year", "16", "--height", "181", "--width", "360"],
    full_size=["--steps", "2"], vit=["--steps", "2"],
    bench=["--config", "baseline", "--size", "64", "--batch_size", "16", "--dtype", "bf16", "--steps", "5",
           "--warmup", "2", "--model_args", "{drop_path_rate: 0}", "--roofline"],
    train=["--config", "baseline", "--model_args.drop_path_rate", "0"],  # no stochastic depth: 2 graphs, not 36
    profile=["--batch_size", "4", "--num_workers", "2"],
    ladder=["--steps", "6", "--breakdown-steps", "6", "--workers", "4"])
SHRINK = dict(
    data=["--samples-per-year", "4", "--height", "33", "--width", "64"],
    full_size=["--steps", "1", "--lr_size", "16x32", "--", *TINY_SWINIR],
    vit=["--steps", "1", "--config", "vit_quickstart", "--batch", "2", "--", "--img_size", "[16, 32]",
         "--model_args", "{patch_size: 4, embed_dim: 16, depths: [1], num_heads: [2]}"],
    bench=["--config", "quickstart", "--size", "16", "--batch_size", "1", "--dtype", "fp32", "--steps", "3",
           "--warmup", "0", "--peak_seconds", "0.02", "--peak_sizes", "256"],
    train=["--config", "quickstart", *TINY_SWINIR, "--img_size", "16"],
    # tests/test_profiling.py checks the CPU memory timeline; here its export would be a third of the dry run
    profile=["--batch_size", "2", "--num_workers", "0", "--memory_timeline", "false"],
    ladder=["--steps", "2", "--breakdown-steps", "1", "--workers", "1"])
SIZES = {"gpu": GPU_SIZES, "tiny": {name: [*GPU_SIZES[name], *SHRINK[name]] for name in GPU_SIZES}}


@dataclass
class Row:
    name: str
    status: str  # pass, fail or skip
    reason: str = ""
    seconds: Optional[float] = None
    figures: dict = field(default_factory=dict)
    command: str = ""
    output_tail: str = ""


@dataclass
class Ran:
    code: Optional[int]  # None: killed at its timeout
    output: str
    seconds: float


@dataclass
class Item:
    name: str
    argv: list[str]  # after the interpreter; run from the repository root
    timeout: float
    judge: Callable[[Ran, "Check"], list[Row]]
    min_s: float = 15.0  # not started with less time left
    lacks: str = ""  # what this machine lacks for it (a ladder rung's need): skipped with that reason
    tiny_skip: str = ""  # why the dry run leaves it out


class Check:
    """The items, the budget and the report."""

    def __init__(self, args):
        self.args, self.mode = args, "tiny" if args.tiny else "gpu"
        self.sizes = SIZES[self.mode]
        self.out, self.work = Path(args.out), Path(args.work or tempfile.mkdtemp(prefix="gpu_check_"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.data = self.work / "era5"
        self.started, self.clock = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
        self.deadline = self.clock + args.budget_s
        self.env: dict = {}
        self.commit = git_commit()
        self.rows: list[Row] = []
        self.children: set[subprocess.Popen] = set()
        self.state = "running"

    @property
    def cuda(self) -> bool:
        return bool(self.env.get("cuda_available"))

    # ---------------------------------------------------------------------------------------- running
    def run(self, item: Item) -> Ran:
        """``item`` in a process group of its own, killed whole at its timeout (compile workers, loader workers)."""
        print(f"gpu_check: {item.name} ...", file=sys.stderr, flush=True)
        left = self.deadline - time.monotonic()
        log = self.work / f"{item.name.replace(' ', '_')}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
        if self.mode == "tiny":
            env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the same on any machine
        if self.args.jobs > 1:
            # Items side by side, each with a thread per core, oversubscribe the CPU: OpenMP's spinning threads
            # then slowed bench_model.py's reference matmuls up to 20x and no other step (its MFU read 2.08).
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.args.jobs))
        start = time.monotonic()
        with open(log, "w") as out:
            child = subprocess.Popen([sys.executable, *item.argv], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
            self.children.add(child)
            try:
                code = child.wait(timeout=min(item.timeout, left))
            except subprocess.TimeoutExpired:
                code = None
            finally:
                self.stop(child)
                self.children.discard(child)
        return Ran(code, log.read_text(errors="replace"), time.monotonic() - start)

    @staticmethod
    def stop(child: subprocess.Popen) -> None:
        """The item's whole process group: also what it left behind (a loader worker, a rank holding GPU memory)."""
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is empty: everything ended
            pass
        child.wait(timeout=60)

    def stop_children(self) -> None:
        for child in list(self.children):
            self.stop(child)

    def skip_reason(self, item: Item) -> str:
        first = item.name in ("environment", "data")  # what every other item needs: always run
        if self.args.only and not first and not any(item.name.startswith(prefix) for prefix in self.args.only):
            return "not selected (--only)"
        if not first:
            if not self.env:
                return "not run: the environment probe failed (see its row)"
            if not self.cuda and self.mode == "gpu":
                return "not run: no CUDA device (torch.cuda.is_available() is False); --tiny is the CPU dry run"
        if item.lacks:
            return item.lacks
        if self.mode == "tiny" and item.tiny_skip:
            return f"not in the tiny dry run: {item.tiny_skip}"
        left = self.deadline - time.monotonic()
        if left < item.min_s:
            return f"not run: time budget ({left:.0f} s left of {self.args.budget_s:.0f}, needs {item.min_s:.0f})"
        return ""

    def execute(self, items: list[Item]) -> int:
        """Run the items in order, judge each as it ends; with --jobs N (the dry run: its figures are not timings)
        N at once, judged in order as they end."""
        with ThreadPoolExecutor(self.args.jobs) as pool:
            pending = []
            for item in items:
                reason = self.skip_reason(item)
                if reason or self.args.jobs == 1:
                    pending.append((item, reason, None if reason else self.run(item)))
                    self.judge_pending(pending)
                else:
                    pending.append((item, "", pool.submit(self.run, item)))
            self.judge_pending(pending, wait=True)
        self.state = "done"
        self.write()
        return 1 if any(r.status == "fail" for r in self.rows) else 0

    def judge_pending(self, pending: list, wait: bool = False) -> None:
        """Rows for the items at the head of ``pending`` that have ended (all, once ``wait``), in their order."""
        while pending:
            item, reason, ran = pending[0]
            if isinstance(ran, Future):
                if not (wait or ran.done()):
                    return
                ran = ran.result()
            pending.pop(0)
            command = shlex.join(["python", *item.argv])
            if reason:
                self.rows.append(Row(item.name, "skip", reason, command=command))
            else:
                rows = judged(item, ran, self)
                rows[0].seconds, rows[0].command = round(ran.seconds, 1), command
                self.rows += rows
            self.write()

    # ---------------------------------------------------------------------------------------- the report
    def report(self) -> dict:
        counts = {s: sum(r.status == s for r in self.rows) for s in ("pass", "fail", "skip")}
        return {"check": "tests/gpu_check.py", "format": 1, "state": self.state, "mode": self.mode,
                "started": self.started.isoformat(timespec="seconds"),
                "seconds": round(time.monotonic() - self.clock, 1), "budget_s": self.args.budget_s,
                "environment": self.env, "commit": self.commit, "counts": counts,
                "rows": [asdict(r) for r in self.rows]}

    def write(self) -> None:
        report = self.report()
        self.out.mkdir(parents=True, exist_ok=True)
        for suffix, text in ((".json", json.dumps(report, indent=1)), (".md", markdown(report))):
            temporary = self.out / f".{REPORT}{suffix}.tmp"
            temporary.write_text(text + "\n")
            temporary.replace(self.out / f"{REPORT}{suffix}")  # a reader never sees half a report


def git_commit() -> Optional[str]:
    """The checkout's commit (with "+changes" when the tree differs from it), or None where there is no git."""
    try:
        run = [subprocess.run(["git", *command], cwd=REPO, capture_output=True, text=True, timeout=10)
               for command in (["rev-parse", "--short", "HEAD"], ["status", "--porcelain", "--untracked-files=no"])]
    except (OSError, subprocess.TimeoutExpired):
        return None
    if run[0].returncode:
        return None
    return run[0].stdout.strip() + ("+changes" if run[1].stdout.strip() else "")


def judged(item: Item, ran: Ran, check: Check) -> list[Row]:
    """The item's rows: a timeout or a crash is one failed row with the output's tail, else the item's judge."""
    tail = "\n".join(ran.output.strip().splitlines()[-25:])
    if ran.code is None:
        rows = [Row(item.name, "fail", f"timed out after {ran.seconds:.0f} s", output_tail=tail)]
        try:  # what a killed run left behind (the profiling item's files) may still be figures
            rows[0].figures = item.judge(ran, check)[0].figures
        except Exception:  # noqa: BLE001 -- nothing left to read: the timeout is the finding
            pass
        return rows
    try:
        rows = item.judge(ran, check)
    except Exception as error:  # noqa: BLE001 -- a judge that cannot read the output fails its item, not the check
        rows = [Row(item.name, "fail", f"output not understood: {type(error).__name__}: {error}")]
    if ran.code != 0 and rows[0].status != "fail":
        rows[0].status, rows[0].reason = "fail", f"exit code {ran.code}"
    if rows[0].status == "fail":
        rows[0].output_tail = tail
    return rows


def last_json(output: str, key: Optional[str] = None) -> dict:
    """The last line of ``output`` that is a JSON object (with ``key``, if given)."""
    for line in reversed(output.splitlines()):
        if line.startswith("{"):
            value = json.loads(line)
            if key is None or key in value:
                return value
    raise ValueError("no JSON line in the output")


def short(value):
    return round(value, 4 if abs(value) < 1 else 2) if isinstance(value, float) else value


# -------------------------------------------------------------------------------------------- the items
def probe() -> int:
    """(In a child) the environment as JSON: versions, the device, and which ladder rungs this machine lacks."""
    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks import ladder
    from tools import torch_build

    cuda = torch.cuda.is_available()
    driver = torch_build.query_driver()
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "cuda_available": cuda, "host": platform.node(), "cpus": os.cpu_count(), "driver": driver.version,
            "ladder_lacks": {r.name: ladder.SKIP_REASONS[r.needs] for r in ladder.rungs(1)
                             if ladder.missing(cuda).get(r.needs)},
            # A GPU nvidia-smi lists that this torch cannot use (its CUDA too new for the driver): the row's reason.
            "gpu_unseen": torch_build.unseen_gpu(driver, cuda, torch.__version__, torch.version.cuda,
                                                 os.environ.get("CUDA_VISIBLE_DEVICES"))}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, memory_gb=props.total_memory / 1e9,
                    capability=list(torch.cuda.get_device_capability(0)), multiprocessors=props.multi_processor_count,
                    bf16=torch.cuda.is_bf16_supported(), cudnn=torch.backends.cudnn.version())
    else:
        from benchmarks.bench_model import cpu_description

        info["device"] = cpu_description()
    print(json.dumps(info))
    return 0


def judge_probe(ran: Ran, check: Check) -> list[Row]:
    check.env = last_json(ran.output, "torch")
    status = "fail" if check.mode == "gpu" and not check.cuda else "pass"
    keys = ("device", "torch", "cuda", "driver", "memory_gb")
    reason = check.env.get("gpu_unseen") or "torch sees no CUDA device"
    return [Row("environment", status, "" if status == "pass" else reason,
                figures={k: short(check.env[k]) for k in keys if check.env.get(k) is not None})]


def judge_exit(ran: Ran, check: Check) -> list[Row]:
    return [Row("data", "pass" if ran.code == 0 else "fail", figures={"arguments": " ".join(check.sizes["data"])})]


def judge_tests(ran: Ran, check: Check) -> list[Row]:
    """One row for the run, one per test (its outcome and, for a skip or a failure, why). On a GPU a skipped test
    fails, with the reason it gave: a torch that cannot use the GPU must not pass as checked."""
    rows = [Row("cuda tests", "pass" if ran.code == 0 else "fail",
                "" if ran.code == 0 else "a test failed" if ran.code == 1 else f"pytest exit code {ran.code}")]
    counts = {"pass": 0, "fail": 0, "skip": 0}
    for case in ElementTree.parse(check.work / "junit.xml").iter("testcase"):
        name = f"cuda test: {case.get('classname', '').split('.')[-1]}.py::{case.get('name')}"
        problem = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        status = "pass" if problem is None else "skip" if problem.tag == "skipped" else "fail"
        reason = "" if problem is None else (problem.get("message") or "").splitlines()[0][:300] if (
            problem.get("message")) else problem.tag
        counts[status] += 1
        if status == "skip" and check.mode == "gpu":
            status, reason = "fail", f"skipped on a GPU: {reason}"
        rows.append(Row(name, status, reason, seconds=round(float(case.get("time", 0)), 1)))
    rows[0].figures = counts
    if not counts["pass"] + counts["fail"] + counts["skip"]:
        rows[0].status, rows[0].reason = "fail", "no test collected"
    elif check.mode == "gpu" and counts["skip"]:
        rows[0].status, rows[0].reason = "fail", f"{counts['skip']} of the cuda tests skipped on a GPU"
    return rows


def judge_memory(prefix: str):
    """Rows of full_size_memory.py --measure: per setting, the estimate against the measured peak."""
    def judge(ran: Ran, check: Check) -> list[Row]:
        rows = []
        for line in ran.output.splitlines():
            if not line.startswith('{"setting"'):
                continue
            case = json.loads(line)
            name = f"{prefix}: {case['setting']} {'x'.join(map(str, case['input']))} batch {case['batch']}"
            figures = {k: short(case[k]) for k in ("estimate_gb", "measured_peak_gb", "estimate_error",
                                                    "measured_activations_gb", "estimate_activations_gb",
                                                    "seconds_per_step", "oom") if k in case}
            fits = case["estimate_gb"] <= check.env.get("memory_gb", float("inf"))
            if case.get("oom"):
                status, reason = ("fail", f"out of memory though the estimate ({case['estimate_gb']:.1f} GB) fits") \
                    if fits else ("pass", "out of memory, as the estimate says")
            elif check.mode == "tiny":
                status, reason = "pass", "the ±15 % goal is judged on a GPU"
            else:
                bad = abs(case["estimate_error"]) > TOLERANCE
                status = "fail" if bad else "pass"
                reason = f"estimate off by {case['estimate_error']:+.0%} (goal ±{TOLERANCE:.0%})" if bad else ""
            rows.append(Row(name, status, reason, figures=figures))
        failed = sum(r.status == "fail" for r in rows)
        summary = Row(prefix, "fail" if failed or not rows else "pass",
                      f"{failed} of {len(rows)} settings failed" if failed else "" if rows else "no setting measured",
                      figures={"settings": len(rows)})
        return [summary, *rows]
    return judge


def judge_bench(ran: Ran, check: Check) -> list[Row]:
    """bench_model.py's step against the measured matmul peak; then one row per kernel class of its roofline."""
    result = last_json(ran.output, "fraction_of_peak")
    figures = {"dtype": result["dtype"], "batch": result["batch_size"], "size": result["size"],
               "sec_per_step": short(result["sec_per_step"]), "samples_per_sec": short(result["samples_per_sec"]),
               "achieved_tflops": short(result["flops_per_step"] / result["sec_per_step"] / 1e12),
               "matmul_peak_tflops": short(result["matmul_peak_flops"] / 1e12),
               "mfu_vs_measured_peak": short(result["fraction_of_peak"])}
    roof = result.get("roofline")
    if not roof:
        return [Row("bench_model", "fail", "no roofline in the output", figures=figures)]
    figures.update({f"{key}_ms": short(roof[f"{key}_seconds"] * 1e3) for key in ("kernel", "idle", "bound", "flop_bound")},
                   copy_gb_per_s=short(roof["bandwidth"] / 1e9))
    rows = [Row(f"roofline: {name}", "pass", figures={
        "gflop": short(row["flops"] / 1e9), "gb": short(row["bytes"] / 1e9), "ms": short(row["seconds"] * 1e3),
        "tflops": short(row["tflops"]), "gb_per_s": short(row["gb_per_s"]), "bound_ms": short(row["bound_seconds"] * 1e3),
        "of_roof": short(row["of_roof"]), "bound_by": row["bound_by"]})
        for name, row in sorted(roof["classes"].items(), key=lambda kv: -kv[1]["seconds"]) if row["seconds"]]
    return [Row("bench_model", "pass", figures=figures), *rows]


def trace_figures(path: Path) -> dict:
    """The trace's size, its GPU kernels and the five that took longest (name, ms in the traced steps)."""
    events = json.loads(gzip.decompress(path.read_bytes())).get("traceEvents", [])
    kernels: dict[str, float] = {}
    for event in events:
        if event.get("cat") == "kernel":
            kernels[event["name"]] = kernels.get(event["name"], 0.0) + event.get("dur", 0) / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:5]
    return {"trace_mb": short(path.stat().st_size / 1e6), "events": len(events), "kernel_names": len(kernels),
            "kernel_ms": short(sum(kernels.values())), "top_kernels": [[n[:80], short(ms)] for n, ms in top]}


def judge_profile(ran: Ran, check: Check) -> list[Row]:
    folder = check.work / "profile" / "profile"
    files = {name: folder / f"rank0_{name}" for name in
             ("trace.json.gz", "memory_timeline.html", "memory_timeline.png", "memory_snapshot.pickle")}
    figures = {f"{name}_mb": short(path.stat().st_size / 1e6) for name, path in files.items() if path.exists()}
    if files["trace.json.gz"].exists():
        figures.update(trace_figures(files["trace.json.gz"]))
    if files["memory_timeline.png"].exists():  # the one picture worth carrying back: memory by category on the GPU
        shutil.copyfile(files["memory_timeline.png"], check.out / f"{REPORT}_memory_timeline.png")
    wanted = ["trace.json.gz", *(["memory_timeline.html"] if check.mode == "gpu" else []),
              *(["memory_snapshot.pickle"] if check.cuda else [])]
    missing = [name for name in wanted if not files[name].exists()]
    if check.cuda and not figures.get("kernel_names"):
        missing.append("CUDA kernels in the trace")
    return [Row("profiling", "fail" if missing else "pass", f"missing: {', '.join(missing)}" if missing else "",
                figures=figures)]


def ladder_rung(name: str, argv: list[str]) -> int:
    """(In a child) one rung of benchmarks/ladder.py's ladder: train_with_profiling.py with the keys of every rung up
    to ``name`` (the ones this machine lacks left out, as ladder.py does), in this process; its figures as JSON."""
    import runpy
    from unittest import mock

    import torch

    sys.path.insert(0, str(REPO))
    from benchmarks import ladder

    parser = argparse.ArgumentParser(allow_abbrev=False)
    for option in ("--steps", "--breakdown-steps", "--workers"):
        parser.add_argument(option, type=int, required=True)
    parser.add_argument("--run_dir", required=True)
    parser.add_argument("--config", required=True)
    known, extra = parser.parse_known_args(argv)  # the rest: every rung's training arguments
    lacks, keys = ladder.missing(torch.cuda.is_available()), {}
    for rung in ladder.rungs(known.workers):
        if not lacks.get(rung.needs):
            keys.update(rung.keys)
        if rung.name == name:
            break
    args = ladder.rung_args(known.config, keys, known.steps, known.breakdown_steps, known.run_dir, extra)
    with mock.patch.object(sys, "argv", ["train_with_profiling.py", *args]):
        try:
            runpy.run_path(str(REPO / "train_with_profiling.py"), run_name="__main__")
        except SystemExit as stop:
            if stop.code not in (0, None):
                raise
    records = ladder.read_records(args)
    rates = next(r for r in records if r["kind"] == "throughput")
    train = [r for r in records if r["kind"] == "train"][-1]
    # The last log window's MFU counts the time that window waited (for compiling, on the compile rungs: 0.09 %
    # on an H200 at 2.8 samples/s): the steady MFU is that MFU at the rung's measured rate (MFU ∝ samples/s).
    mfu = train.get("mfu") and train["mfu"] * rates["full_samples_per_sec"] / train["samples_per_sec"]
    print(json.dumps({"rung": name, "keys": keys, "samples_per_sec": rates["full_samples_per_sec"],
                      "synthetic_samples_per_sec": rates["synthetic_samples_per_sec"],
                      "io_samples_per_sec": rates["io_samples_per_sec"], "peak_mem_gb": train["peak_mem_gb"],
                      "mfu": mfu}))
    return 0


def judge_rung(ran: Ran, check: Check) -> list[Row]:
    result = last_json(ran.output, "rung")
    figures = {k: short(result[k]) for k in ("samples_per_sec", "synthetic_samples_per_sec", "io_samples_per_sec",
                                             "peak_mem_gb", "mfu") if result.get(k) is not None}
    previous = next((r for r in reversed(check.rows) if r.name.startswith("ladder: ") and r.status == "pass"), None)
    if previous is not None:
        figures["x_prev"] = short(result["samples_per_sec"] / previous.figures["samples_per_sec"])
    return [Row(f"ladder: {result['rung']}", "pass", figures=figures)]


def items(check: Check) -> list[Item]:
    sizes, data, work = check.sizes, str(check.data), check.work
    train = [*sizes["train"], "--data_dir", data, "--valid_split", "valid", "--val_samples", "2", "--progress", "never"]
    lacks = check.env.get("ladder_lacks", {})
    return [
        Item("environment", [str(Path(__file__)), "--probe"], 120, judge_probe, min_s=0),
        Item("data", ["datasets/make_synthetic_era5.py", "--out", data, *sizes["data"], "--seed", "0", "--train-years",
                      "2008", "2010", "--valid-years", "2015", "--quiet"], 120, judge_exit, min_s=5),
        Item("cuda tests", ["-m", "pytest", "-v", "-m", "cuda", "-p", "no:cacheprovider", "-rs",
                            f"--junitxml={work / 'junit.xml'}", *CUDA_TEST_FILES], 180, judge_tests, min_s=30),
        Item("full field", ["benchmarks/full_size_memory.py", "--measure", *sizes["full_size"]], 170,
             judge_memory("full field"), min_s=30),
        Item("vit_mp", ["benchmarks/full_size_memory.py", "--measure", "--model", "vit", *sizes["vit"]], 100,
             judge_memory("vit_mp"), min_s=30),
        Item("bench_model", ["benchmarks/bench_model.py", *sizes["bench"]], 90, judge_bench, min_s=20),
        Item("profiling", ["train_with_profiling.py", *train, *sizes["profile"], "--max_steps", "5", "--log_every",
                           "1", "--profile_wait", "1", "--profile_warmup", "1", "--profile_active", "1",
                           "--memory_snapshot", "true", "--breakdown_steps", "2", "--run_dir", str(work / "profile")],
             150, judge_profile, min_s=30),
        *(Item(f"ladder: {rung}", [str(Path(__file__)), "--ladder-rung", rung, *sizes["ladder"], "--run_dir",
                                   str(work / f"ladder_{rung.replace(' ', '_')}"), *train],
               150 if rung in ("compile", "cuda graphs") else 75, judge_rung,
               min_s=60 if rung in ("compile", "cuda graphs") else 20, lacks=lacks.get(rung, ""), tiny_skip=tiny)
          for rung, tiny in LADDER.items()),
    ]


# -------------------------------------------------------------------------------------------- markdown
def markdown(report: dict) -> str:
    env, counts = report["environment"], report["counts"]
    versions = f"torch {env.get('torch', '?')}" + (f", CUDA {env['cuda']}" if env.get("cuda") else "")
    lines = [f"# GPU check: {env.get('device', 'device unknown')}, {versions}, {report['started']}", "",
             f"{report['mode']} mode, {report['state']}: {counts['pass']} pass, {counts['fail']} fail, "
             f"{counts['skip']} skip in {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget"
             + (f"; driver {env['driver']}" if env.get("driver") else "") + f"; host {env.get('host', '?')}"
             + (f"; commit {report['commit']}" if report["commit"] else ""), "",
             "| item | status | s | figures | reason |", "| --- | --- | --- | --- | --- |"]
    for row in report["rows"]:
        figures = "; ".join(f"{k} {v}" for k, v in row["figures"].items()).replace("|", "/")
        seconds = "" if row["seconds"] is None else f"{row['seconds']:.0f}"
        lines.append(f"| {row['name']} | {row['status']} | {seconds} | {figures} | {row['reason'].replace('|', '/')} |")
    failed = [row for row in report["rows"] if row["output_tail"]]
    for row in failed:
        lines += ["", f"## {row['name']}: the end of its output", "", "```", row["output_tail"], "```"]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", help="folder for gpu_check.json and gpu_check.md (created)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds for all items together (an item that no longer fits is not run)")
    parser.add_argument("--tiny", action="store_true", help="the CPU dry run: no GPU, tiny sizes")
    parser.add_argument("--only", nargs="+", metavar="PREFIX", help="run only the items whose names start so")
    parser.add_argument("--jobs", type=int, default=1,
                        help="items run at once after the first two (the dry run; timings want 1, the default)")
    parser.add_argument("--work", help="scratch folder for data and runs (default: a new temporary one, removed)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)  # the environment item's child
    parser.add_argument("--ladder-rung", help=argparse.SUPPRESS)  # a ladder item's child
    args, rest = parser.parse_known_args(argv)
    if args.ladder_rung:
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    elif not args.probe and not args.out:
        parser.error("--out DIR is required (the report's folder)")
    elif args.budget_s <= 0 or args.jobs < 1:
        parser.error(f"--budget-s must be > 0 and --jobs >= 1, got {args.budget_s} and {args.jobs}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        return probe()
    if args.ladder_rung:
        return ladder_rung(args.ladder_rung, args.rest)
    check = Check(args)

    def stopped(signum, _frame):  # the device tool's limit or ^C: the report says how far it got
        check.stop_children()
        check.state = f"stopped by signal {signum}"
        check.write()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    try:
        check.write()
        code = check.execute(items(check)[:2])  # the probe decides the rest (which rungs need CUDA)
        check.state = "running"
        code = check.execute(items(check)[2:]) or code
    except Exception as error:  # a bug here: the report still says how far the check got, and why it stopped
        check.stop_children()
        check.state = f"crashed: {type(error).__name__}: {error}"
        check.write()
        raise
    finally:
        if not args.work:
            shutil.rmtree(check.work, ignore_errors=True)
    counts = check.report()["counts"]
    print(f"gpu_check: {counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skip; "
          f"report in {check.out / REPORT}.md and .json")
    return code


if __name__ == "__main__":
    sys.exit(main())
