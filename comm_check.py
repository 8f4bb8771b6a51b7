"""Multi-node sanity check: all-reduce and all-gather over every rank, checked and timed.

Run it before a long multi-node job: it proves that every rank reaches every other one, that the
collectives return the right numbers, and how fast the network is, in the table format of
NVIDIA's nccl-tests (time, algorithm bandwidth, bus bandwidth, wrong elements). nccl on GPUs,
gloo on CPU; ranks and devices come from utils/parallel/distributed.py, so any launcher works::

    torchrun --nproc-per-node 2 comm_check.py --max-bytes 4MiB            # one machine, CPU
    sbatch submit_multinode.sh comm_check.py                             # N nodes x 4 GPUs

Sizes double from --min-bytes to --max-bytes; sizes whose buffers would not fit in half the free
memory of a rank are skipped (and said so). As in nccl-tests, an all-gather's size is its output
(each rank contributes size / world_size), algbw = size / time, and busbw rescales algbw to what
each link carries: all-reduce x 2(n-1)/n, all-gather x (n-1)/n. Time is the slowest rank's mean
over the timed iterations. Any wrong element makes the run fail (exit code 1).

On GPUs the largest size's busbw is set beside the *expected* one: the datasheet bandwidths of the links
(config/clusters/clusters.yaml, the entry that --cluster or SITE names; see :func:`expected_busbw`), with a
warning below half of it.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import psutil
import torch
import torch.distributed as dist

from utils.cli import OneLineParser
from utils.config import ConfigError
from utils.parallel.distributed import DistEnv, cleanup_distributed, init_distributed, read_dist_env
from utils.plan.clusters import THIS_MACHINE, Cluster, load_cluster
from utils.plan.comm import node_busbw
from utils.training import run_cli

DTYPE = torch.float32
ELEMENT_BYTES = torch.finfo(DTYPE).bits // 8
# Element i of rank r's buffer holds 8 * base(r) + i % 7: every value is an exact float32 integer,
# and positions differ, so a shifted or misplaced chunk shows up as wrong elements.
PATTERN_PERIOD = 7
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
SITE_CLUSTERS = {"kestrel": "kestrel-h100", "perlmutter": "perlmutter-a100-40"}
"""submit_multinode.sh's SITE -> the clusters.yaml entry of that site's GPU nodes (generic: none)."""
LARGE_BYTES = 64 * 2**20
"""Smallest size compared with the expected busbw: below it, per-step latency hides the bandwidth."""
LOW_SHARE = 0.5
"""Measured busbw below this share of the expected one earns a warning."""


def parse_bytes(text: str) -> int:
    """'4MiB', '4M', '4MB' and '4194304' all mean 4 * 2**20 bytes (binary units, as nccl-tests)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 1024, 1KiB, 4MiB or 1GiB")
    value = int(float(match.group(1)) * _UNITS[match.group(2)])
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte")
    return value


def format_bytes(size: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = _UNITS[unit[0]]
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--min-bytes", type=parse_bytes, default=parse_bytes("1KiB"),
                        help="smallest message size")
    parser.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("1GiB"),
                        help="largest message size (also bounded by free memory)")
    parser.add_argument("--factor", type=int, default=2, help="ratio between consecutive sizes")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per size (at most)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations before timing (at most)")
    parser.add_argument("--seconds-per-size", type=float, default=2.0,
                        help="time budget per size and collective: large sizes on slow links run "
                             "fewer iterations (at least one)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may wait for a missing rank before failing")
    parser.add_argument("--cluster", default=None,
                        help="entry of config/clusters/clusters.yaml whose link bandwidths give the expected busbw "
                             "(e.g. kestrel-h100, perlmutter-a100-40); default from SITE: "
                             + ", ".join(f"{k} -> {v}" for k, v in SITE_CLUSTERS.items()) + ", else none")
    parser.add_argument("--cluster-file", "--cluster_file", dest="cluster_file", type=Path, default=None,
                        help="a YAML file of cluster entries of your own, in the form of config/clusters/clusters.yaml")
    args = parser.parse_args(argv)
    if args.min_bytes > args.max_bytes:
        parser.error(f"--min-bytes ({format_bytes(args.min_bytes)}) is larger than --max-bytes "
                     f"({format_bytes(args.max_bytes)})")
    if args.factor < 2:
        parser.error("--factor must be at least 2")
    if args.iters < 1:
        parser.error("--iters must be at least 1")
    if args.warmup < 0 or args.seconds_per_size <= 0 or args.timeout <= 0:
        parser.error("--warmup must be >= 0, --seconds-per-size and --timeout > 0")
    args.cluster_given = args.cluster is not None  # a CPU run compares only when asked to
    name = args.cluster if args.cluster_given else cluster_for_site(os.environ.get("SITE"))
    args.expected_from = None
    if name == THIS_MACHINE:  # measuring it runs comm_check.py itself: not from inside one
        parser.error(f"--cluster {THIS_MACHINE} is measured by this script: name a GPU cluster's entry")
    if name is not None:
        try:
            args.expected_from = load_cluster(name, args.cluster_file)
        except ConfigError as error:
            parser.error(str(error))
    return args


@dataclass(frozen=True)
class Collective:
    name: str
    bus_factor: Callable[[int], float]
    """Bus bandwidth / algorithm bandwidth for n ranks (nccl-tests' PERFORMANCE.md)."""
    buffers_per_size: float
    """Bytes this collective allocates per byte of message size, for the memory bound."""


ALL_REDUCE = Collective("all_reduce", lambda n: 2 * (n - 1) / n, 1.0)
ALL_GATHER = Collective("all_gather", lambda n: (n - 1) / n, 1.5)  # output + input (<= half of it)


# --- expected bus bandwidth ----------------------------------------------------------------------------

def cluster_for_site(site: Optional[str]) -> Optional[str]:
    """The clusters.yaml entry for a SITE of the job scripts (kestrel, perlmutter); None for generic or unset."""
    return SITE_CLUSTERS.get((site or "").strip().lower())


def expected_busbw(cluster: Cluster, nodes: int) -> float:
    """Large-message bus bandwidth (bytes/s) the links allow a ring over ``nodes`` nodes of ``cluster``.

        1 node:     busbw = nvlink_gbps
        2+ nodes:   busbw = min(nvlink_gbps, network_gbps)     (network_gbps: the whole node's, per direction)

    The ring planner's bound (utils/plan/comm.py, node_busbw, with the node's network as plan.py gives DDP's
    single ring), so plan and check agree. Why the whole node's network and not its share per GPU
    (network_gbps / gpus_per_node): NCCL orders each ring node by node, so a ring leaves a node once,
    through that node's NICs (one ring or channel per NIC), while every link of a ring carries the same
    bytes, the 2(n-1)/n x size per rank that busbw counts. The slowest link bounds them all: NVLink inside a
    node, the node's network between nodes. The NREL tutorial measured about 55 GB/s busbw on 2 Kestrel nodes
    with NCCL_NET_GDR_LEVEL=LOC and about 80 GB/s without it (nccl-tests), against 50 here and 12.5 for
    the per-GPU share: a figure above this bound is possible (NCCL's tree algorithm on few nodes), one far
    below it is not the links' limit. Datasheet figures, not measurements.
    """
    return node_busbw(nodes, cluster.gpus_per_node, cluster.intra_bw, cluster.inter_bw)


def compare_busbw(name: str, size: int, measured: float, cluster: Cluster, nodes: int,
                  comparable: bool = True) -> list[str]:
    """The lines that set ``measured`` busbw (GB/s) at ``size`` bytes beside :func:`expected_busbw`: a summary,
    then a warning when below LOW_SHARE of it. ``comparable`` False (gloo on CPUs): the summary says so and
    no warning follows, since CPU processes do not use the cluster's links."""
    expected = expected_busbw(cluster, nodes) / 1e9
    label = "" if comparable else " (a GPU cluster's figure: this run is on CPUs, not comparable)"
    plural = "s" if nodes > 1 else ""
    lines = [f"# {name}: busbw at {format_bytes(size)}: {measured:.3f} GB/s measured, {expected:g} GB/s expected "
             f"for {nodes} node{plural} of {cluster.name} ({cluster.source}: the links' datasheet bandwidth){label}"]
    if not comparable:
        return lines
    if size < LARGE_BYTES:
        lines.append(f"# {name}: {format_bytes(size)} is latency-bound: compare at --max-bytes 1GiB")
    elif measured < LOW_SHARE * expected:
        lines.append(f"# WARNING {name}: below half the expected bus bandwidth: check the NCCL network plugin "
                     f"(docs/setup.md, 'The network plugin for NCCL')")
    return lines


# --- data: fill with the pattern, count wrong elements ---------------------------------------------

def fill_pattern(buffer: torch.Tensor, base: int) -> None:
    for offset in range(PATTERN_PERIOD):
        buffer[offset::PATTERN_PERIOD].fill_(8 * base + offset)


def count_wrong(buffer: torch.Tensor, expected_base: torch.Tensor, repeats: int = 1) -> int:
    """Elements of ``buffer`` (rows = ranks' chunks) that differ from ``expected_base[row] + repeats * offset``."""
    rows = buffer.view(expected_base.numel(), -1)
    wrong = torch.zeros((), dtype=torch.int64, device=buffer.device)
    for offset in range(PATTERN_PERIOD):
        expected = (8 * expected_base + repeats * offset).to(buffer.dtype).unsqueeze(1)
        wrong += (rows[:, offset::PATTERN_PERIOD] != expected).sum()
    return int(wrong)


def all_reduce_base(rank: int) -> int:
    # Bounded so that the sum over ranks stays an exact float32 integer for tens of thousands of ranks.
    return rank % 64 + 1


# --- agreement across ranks --------------------------------------------------------------------------

def agree(value: float, op: dist.ReduceOp, device: torch.device) -> float:
    """The same number on every rank (max time, min memory), so all ranks run the same loop."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_bytes_per_rank(env: DistEnv, device: torch.device) -> int:
    """Half of what this rank may use: the free memory of its GPU, or its share of the host's."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available // max(1, env.local_world_size)
    return int(free // 2)


def message_sizes(args: argparse.Namespace, world_size: int) -> list[int]:
    """min, min*f, ... <= max, rounded down to whole float32 elements per rank (at least one)."""
    sizes, size = [], args.min_bytes
    granule = ELEMENT_BYTES * world_size
    while size <= args.max_bytes:
        sizes.append(max(granule, size // granule * granule))
        size *= args.factor
    return sorted(set(sizes))


# --- one row of the table ------------------------------------------------------------------------------

def run_collective(op: Collective, size: int, env: DistEnv, device: torch.device,
                   args: argparse.Namespace) -> tuple[float, int]:
    """Check once, then time; returns (slowest rank's mean seconds, wrong elements over all ranks)."""
    n = env.world_size
    if op is ALL_REDUCE:
        buffer = torch.empty(size // ELEMENT_BYTES, dtype=DTYPE, device=device)
        fill_pattern(buffer, all_reduce_base(env.rank))

        def call():
            dist.all_reduce(buffer)

        def wrong() -> int:
            total = sum(all_reduce_base(r) for r in range(n))
            return count_wrong(buffer, torch.tensor([total], device=device), repeats=n)
    else:
        output = torch.empty(size // ELEMENT_BYTES, dtype=DTYPE, device=device)
        buffer = torch.empty(output.numel() // n, dtype=DTYPE, device=device)
        fill_pattern(buffer, env.rank + 1)

        def call():  # the name every supported torch has (torch 2.15's all_gather_single is not in 2.11)
            dist.all_gather_into_tensor(output, buffer)

        def wrong() -> int:
            return count_wrong(output, torch.arange(1, n + 1, device=device))

    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    first_call = agree(time.perf_counter() - start, dist.ReduceOp.MAX, device)
    wrong_elements = int(agree(wrong(), dist.ReduceOp.SUM, device))

    # Zeros from here on: repeated all-reduces of the pattern would grow without bound.
    buffer.zero_()
    iters = max(1, min(args.iters, int(args.seconds_per_size / max(first_call, 1e-9))))
    for _ in range(min(args.warmup, iters)):
        call()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    synchronize(device)
    mean = agree((time.perf_counter() - start) / iters, dist.ReduceOp.MAX, device)
    return mean, wrong_elements


# --- report -----------------------------------------------------------------------------------------

def describe_nodes(env: DistEnv) -> tuple[int, list[str]]:
    """Number of nodes and one line per node. Nodes are told apart by node rank, not host name:
    SLURM can run several emulated nodes on one host (the local test cluster does)."""
    me = (env.node_rank, os.environ.get("SLURMD_NODENAME", ""), socket.gethostname(), env.rank)
    everyone: list = [None] * env.world_size
    dist.all_gather_object(everyone, me)
    nodes: dict[int, list] = {}
    for node_rank, slurm_name, host, rank in everyone:
        nodes.setdefault(node_rank, [slurm_name, host, []])[2].append(rank)
    lines = []
    for node_rank, (slurm_name, host, ranks) in sorted(nodes.items()):
        name = f"{slurm_name} (host {host})" if slurm_name and slurm_name != host else host
        lines.append(f"#   node {node_rank}: {name}, ranks {','.join(map(str, sorted(ranks)))}")
    return len(nodes), lines


HEADER = (f"# {'collective':>10} {'size(B)':>12} {'count':>11} {'type':>7} {'time(us)':>11} "
          f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7}")


def table_row(op: Collective, size: int, seconds: float, wrong: int, n: int) -> str:
    algbw = size / seconds / 1e9
    return (f"  {op.name:>10} {size:>12} {size // ELEMENT_BYTES:>11} {'float':>7} {seconds * 1e6:>11.1f} "
            f"{algbw:>11.3f} {algbw * op.bus_factor(n):>11.3f} {wrong:>7}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if read_dist_env().world_size < 2:
        raise ConfigError("comm_check.py needs at least 2 processes: launch it with torchrun "
                          "--nproc-per-node 2 comm_check.py, or sbatch submit_multinode.sh comm_check.py")
    try:
        env, device = init_distributed(timeout_s=args.timeout)
    except (ValueError, RuntimeError) as error:  # bad launch environment: run_cli says what (exit 2), not where
        raise ConfigError(str(error)) from error
    try:
        return check(args, env, device)
    except RuntimeError as error:  # a peer died or timed out: the first line says which collective
        print(f"error on rank {env.rank}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    finally:
        cleanup_distributed()


def check(args: argparse.Namespace, env: DistEnv, device: torch.device) -> int:
    def say(line: str = "") -> None:
        if env.is_main:
            print(line, flush=True)

    num_nodes, node_lines = describe_nodes(env)
    budget = int(agree(free_bytes_per_rank(env, device), dist.ReduceOp.MIN, device))
    sizes = message_sizes(args, env.world_size)
    say(f"# comm_check: {dist.get_backend()} on {device.type}, float32, torch {torch.__version__}")
    say(f"world_size={env.world_size} nodes={num_nodes}")
    for line in node_lines:
        say(line)
    say(HEADER)

    total_wrong, busbw, largest = 0, {ALL_REDUCE.name: [], ALL_GATHER.name: []}, {}
    for op in (ALL_REDUCE, ALL_GATHER):
        fitting = [s for s in sizes if s * op.buffers_per_size <= budget]
        for size in fitting:
            seconds, wrong = run_collective(op, size, env, device, args)
            total_wrong += wrong
            busbw[op.name].append(size / seconds / 1e9 * op.bus_factor(env.world_size))
            largest[op.name] = size
            say(table_row(op, size, seconds, wrong, env.world_size))
        if len(fitting) < len(sizes):
            say(f"# {op.name}: sizes above {format_bytes(fitting[-1]) if fitting else 'every size'} "
                f"skipped: buffers would exceed half the free memory ({format_bytes(budget)} per rank)")
    for name, values in busbw.items():
        if values:
            say(f"# {name}: average bus bandwidth {sum(values) / len(values):.3f} GB/s, "
                f"largest size {values[-1]:.3f} GB/s")
    for line in expectation_lines(args, busbw, largest, num_nodes, device):
        say(line)
    if total_wrong:
        if env.is_main:
            print(f"# FAILED: {total_wrong} wrong elements: a collective returned wrong data; check the "
                  f"network settings (NCCL_* variables) and rerun with NCCL_DEBUG=INFO", file=sys.stderr,
                  flush=True)
        return 1
    say("# all results correct")
    return 0


def expectation_lines(args: argparse.Namespace, busbw: dict, largest: dict, nodes: int,
                      device: torch.device) -> list[str]:
    """Expected against measured busbw at the largest size: on GPUs with a cluster, or on CPUs when --cluster
    asked for it; on GPUs without one, how to get it (CPUs: nothing, the links are not theirs)."""
    on_gpu = device.type == "cuda"
    cluster = args.expected_from
    if cluster is None:
        return [] if not on_gpu else [
            "# expected busbw: none for this site: pass --cluster NAME (an entry of config/clusters/clusters.yaml) "
            "or set SITE=kestrel|perlmutter to compare with the links' datasheet bandwidth"]
    if not on_gpu and not args.cluster_given:
        return []
    return [line for name, values in busbw.items() if values
            for line in compare_busbw(name, largest[name], values[-1], cluster, nodes, comparable=on_gpu)]


if __name__ == "__main__":
    run_cli(main)  # bad input in one line (exit 2); a rank skips the interpreter's shutdown, as the training scripts do
