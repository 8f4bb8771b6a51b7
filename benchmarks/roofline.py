"""A roofline of one training step by kernel class: what bounds the step (launches, memory, matmul), and how far.

bench_model.py --roofline calls these. For every aten op a step runs, three numbers from three sources:

- FLOPs: torch.utils.flop_counter.FlopCounterMode (matmuls, convolutions, attention; the rest count none);
- bytes: the sizes of the op's input and output tensors, counted by a TorchDispatchMode below (views move nothing,
  an in-place op reads and writes its tensor). This is the traffic of an ideal kernel that touches each operand
  once: a lower bound of what the device's memory moves, which caches and re-reads can only raise;
- time: the device time of the kernels each op launched itself (torch.profiler's self device time; on a CPU the
  op's own CPU time), so that nested ops are counted once.

Ops are grouped into kernel classes (matmul, attention, convolution, normalisation, elementwise, copies,
optimizer). Per class: the achieved FLOP/s against the matmul peak measured in the same run, the achieved
bandwidth against a device-to-device copy measured in the same run, and the class's bound,
max(FLOPs / peak, bytes / bandwidth), the time a kernel at the roof would take. The step's bound is the sum of the
class bounds; what the step takes beyond its kernels is time the device waited (launches, the host, syncs).

PyTorch gives the FLOPs and the times; the classes and the byte count per op are utils/observe/kernels.py's (shared
with the planner's compute model, utils/plan/compute.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch

from utils.observe.kernels import CLASSES, TrafficMode, kernel_class


def bytes_by_op(step: Callable[[], None]) -> dict[str, int]:
    """Operand bytes per op ("aten.mm") of one call of ``step``."""
    with TrafficMode() as mode:
        step()
    return dict(mode.bytes)


def profiled_ops(step: Callable[[], None], device: torch.device, steps: int = 3) -> list:
    """torch.profiler's per-op averages over ``steps`` calls of ``step`` (with the device's kernels on CUDA)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return prof.key_averages()


def self_seconds_by_op(step: Callable[[], None], device: torch.device, steps: int = 3) -> dict[str, float]:
    """Seconds per step of the kernels each op launched itself (CPU: the op's own CPU time), by op ("aten.mm")."""
    seconds: dict[str, float] = defaultdict(float)
    for event in profiled_ops(step, device, steps):
        micros = event.self_device_time_total if device.type == "cuda" else event.self_cpu_time_total
        if micros and event.key.startswith("aten::"):
            seconds[event.key.replace("::", ".", 1)] += micros / 1e6 / steps
    return dict(seconds)


def copy_bandwidth(device: torch.device, nbytes: int, min_seconds: float = 0.2) -> float:
    """Bytes/s of a device-to-device copy, counting what is read and what is written (the roofline's memory roof)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    target.copy_(source)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds:
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        reps += 1
    return 2 * nbytes * reps / (time.perf_counter() - start)


def roofline(flops: dict[str, float], traffic: dict[str, int], seconds: dict[str, float], peak_flops: float,
             bandwidth: float, sec_per_step: float) -> dict:
    """Per class and in total: FLOPs, bytes, kernel seconds, achieved rates, the bound and what sets it."""
    classes = {name: {"flops": 0.0, "bytes": 0, "seconds": 0.0} for name in CLASSES}
    for table, key in ((flops, "flops"), (traffic, "bytes"), (seconds, "seconds")):
        for op, value in table.items():
            classes[kernel_class(op)][key] += value
    for row in classes.values():
        compute, memory = row["flops"] / peak_flops, row["bytes"] / bandwidth
        row.update(bound_seconds=max(compute, memory), bound_by="compute" if compute > memory else "memory",
                   tflops=row["flops"] / row["seconds"] / 1e12 if row["seconds"] else 0.0,
                   gb_per_s=row["bytes"] / row["seconds"] / 1e9 if row["seconds"] else 0.0,
                   of_roof=max(compute, memory) / row["seconds"] if row["seconds"] else 0.0)
    kernel = sum(row["seconds"] for row in classes.values())
    bound = sum(row["bound_seconds"] for row in classes.values())
    return {"classes": classes, "sec_per_step": sec_per_step, "kernel_seconds": kernel,
            "idle_seconds": max(0.0, sec_per_step - kernel), "bound_seconds": bound,
            "flop_bound_seconds": sum(flops.values()) / peak_flops, "peak_flops": peak_flops, "bandwidth": bandwidth}


def print_roofline(result: dict) -> None:
    print(f"roofline (matmul peak {result['peak_flops'] / 1e12:.1f} TFLOP/s, copy bandwidth "
          f"{result['bandwidth'] / 1e9:.0f} GB/s, both measured here; bytes: each operand once):")
    print(f"  {'class':14s} {'GFLOP':>8s} {'GB':>8s} {'ms':>8s} {'TFLOP/s':>8s} {'GB/s':>8s} {'bound ms':>9s} "
          f"{'of roof':>8s}  bound by")
    for name, row in sorted(result["classes"].items(), key=lambda kv: -kv[1]["seconds"]):
        if row["seconds"] or row["bytes"]:
            print(f"  {name:14s} {row['flops'] / 1e9:8.1f} {row['bytes'] / 1e9:8.2f} {row['seconds'] * 1e3:8.2f} "
                  f"{row['tflops']:8.1f} {row['gb_per_s']:8.0f} {row['bound_seconds'] * 1e3:9.2f} "
                  f"{row['of_roof']:8.0%}  {row['bound_by']}")
    step, kernel, bound = result["sec_per_step"], result["kernel_seconds"], result["bound_seconds"]
    print(f"  step {step * 1e3:.1f} ms = kernels {kernel * 1e3:.1f} ms + device idle {result['idle_seconds'] * 1e3:.1f} "
          f"ms (launches, host, syncs); at the roof the kernels would take {bound * 1e3:.1f} ms "
          f"(the FLOPs alone at peak: {result['flop_bound_seconds'] * 1e3:.1f} ms)")
