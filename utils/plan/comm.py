"""Communication time of the collectives a layout runs, and how much of it the compute hides (plan.py's model).

The ring model is nccl-tests' (algbw = bytes / time; busbw = algbw x 2(n-1)/n for an all-reduce, x (n-1)/n for an
all-gather or a reduce-scatter), checked against measured DDP steps within 2-12 % by benchmarks/scaling.py, which
imports these functions. Hand-written: PyTorch has no model of collective times.
"""

from __future__ import annotations


def ring_allreduce_seconds(nbytes: float, ranks: int, busbw: float, latency: float = 0.0) -> float:
    """Time of a ring all-reduce of ``nbytes`` over ``ranks`` at bus bandwidth ``busbw`` (bytes/s).

    nccl-tests: algbw = nbytes / t and busbw = algbw x 2(n-1)/n (what each link carries), hence
    t = nbytes x 2(n-1)/n / busbw. ``latency``: seconds per ring step, of which a ring all-reduce takes
    2(n-1) (reduce-scatter, then all-gather); 0 leaves latency out. One rank has nothing to exchange.
    """
    if ranks < 2 or nbytes <= 0:
        return 0.0
    return 2 * (ranks - 1) * latency + nbytes * 2 * (ranks - 1) / ranks / busbw


def ddp_buckets(grad_bytes: list[int], cap_bytes: float) -> list[int]:
    """Bucket sizes as DDP's Reducer fills them: gradients in the order they become ready (the model's
    parameters reversed), a bucket closed as soon as it holds ``cap_bytes`` or more."""
    buckets, current = [], 0
    for size in grad_bytes:
        current += size
        if current >= cap_bytes:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def predict_step(compute_s: float, backward_s: float, buckets: list[int], ranks: int, busbw: float,
                 latency: float = 0.0) -> dict:
    """Predicted step time of DDP over ``ranks``: compute plus the all-reduce time that backward cannot hide.

    Assumption: bucket k's all-reduce starts when its gradients are ready and runs alongside the rest of
    backward; the last bucket is ready only when backward ends, so at least its all-reduce is exposed,
    and all of the communication beyond ``backward_s`` is too.
    """
    times = [ring_allreduce_seconds(b, ranks, busbw, latency) for b in buckets]
    comm = sum(times)
    exposed = min(comm, max(times[-1] if times else 0.0, comm - backward_s))
    return {"comm_s": comm, "exposed_s": exposed, "step_s": compute_s + exposed, "no_overlap_s": compute_s + comm}


def efficiency(samples_per_sec: float, ranks: int, one_rank_samples_per_sec: float) -> float:
    """Throughput against ideal: N ranks should do N times the work of one (weak and strong scaling alike)."""
    return samples_per_sec / (ranks * one_rank_samples_per_sec)


def node_busbw(nodes: int, gpus_per_node: int, intra: float, inter: float) -> float:
    """Bus bandwidth of a ring over ``nodes`` x ``gpus_per_node`` GPUs: NVLink inside one node, else the
    slowest link (the network between nodes)."""
    return intra if nodes == 1 else min(intra, inter)


def ring_allgather_seconds(nbytes: float, ranks: int, busbw: float, latency: float = 0.0) -> float:
    """Time of a ring all-gather (or reduce-scatter) whose full (gathered) size is ``nbytes``: n - 1 ring steps,
    each rank sending (n-1)/n of the full size."""
    if ranks < 2 or nbytes <= 0:
        return 0.0
    return (ranks - 1) * latency + nbytes * (ranks - 1) / ranks / busbw


def traffic_seconds(traffic: list, ranks: dict[str, int], busbw: float, latency: float, terms: dict) -> float:
    """Seconds of what a model's tensor and context parallelism send per step (a memory description's
    ``utils.memory.shapes.Traffic``: bytes over a group), on links of ``busbw``; ``ranks``: each group's size;
    ``terms``: each by name, added to. An exchange is point-to-point: each message pays the latency once."""
    own: dict[str, float] = {}
    for t in traffic:
        if t.kind == "exchange":
            seconds = t.count * latency + t.nbytes / busbw
        else:
            ring = ring_allreduce_seconds if t.kind == "all-reduce" else ring_allgather_seconds
            seconds = t.count * ring(t.nbytes, ranks[t.group], busbw, latency)
        own[t.term] = own.get(t.term, 0.0) + seconds
    terms.update(own)
    return sum(own.values())
