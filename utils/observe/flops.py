"""What the device does: model FLOPs, peak FLOP/s, MFU, and the device's memory peak.

- MFU (model FLOPs utilisation) = model FLOPs per second / peak FLOP/s of the device(s):
  :func:`train_flops_per_sample` counts the FLOPs of one training step on the meta device,
  :func:`device_peak_flops` gives the peak (datasheet table, else a measured matmul), :func:`mfu` divides.
- :func:`peak_memory_gb` and :func:`reset_peak_memory`: peak memory of this process on a device. They live
  here, with the other figures read from the device (logged next to MFU as ``peak_mem_gb``), not in
  logger.py, which writes records and knows nothing of devices.
"""

from __future__ import annotations

import re
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import psutil
import torch
from torch.utils.flop_counter import FlopCounterMode

from models import on_meta
from utils.precision import dtype_of

# ------------------------------------------------------------------------------------- FLOPs, MFU


def train_flops_per_sample(model_fn: Callable[[], torch.nn.Module], input_shape: Sequence[int]) -> float:
    """Model FLOPs of one training step (forward + backward) for one sample of shape ``input_shape``.

    The model is built by ``model_fn()`` on the meta device (or, if its constructor needs real
    values, on the CPU and then moved there) and run on a meta input, so counting costs no
    compute and no activation memory, whatever the input size. FLOPs count a multiply and an add
    separately (2 per multiply-accumulate) and cover matmuls, convolutions and attention (what
    FlopCounterMode counts); element-wise work is left out, as usual for MFU. The input needs no
    gradient, so the first layer's backward computes only its weight gradient.
    """
    model = on_meta(model_fn)
    sample = torch.empty((1, *input_shape), device="meta")
    model.train()
    with FlopCounterMode(display=False) as counter:
        output = model(sample)
        output.float().sum().backward()
    return float(counter.get_total_flops())


# Dense (no structured sparsity) peak tensor throughput in TFLOP/s per GPU, from NVIDIA's datasheets
# (sparse figures halved) and architecture whitepapers:
#   H100 SXM5 / PCIe: "NVIDIA H100 Tensor Core GPU Architecture" whitepaper (2022), table 3;
#   H100 NVL, H200 SXM / NVL: H100 and H200 product datasheets (nvidia.com/h100, nvidia.com/h200);
#   GH200: "NVIDIA GH200 Grace Hopper Superchip" datasheet; A100: "NVIDIA A100 Tensor Core GPU"
#   datasheet (40 and 80 GB, SXM and PCIe alike); A30, A10, A40, L4, L40, L40S, T4, V100/V100S:
#   the respective product datasheets. None: no such tensor path -> measured instead.
# First matching pattern wins, so more specific names come first. Names as torch.cuda.get_device_name
# reports them, e.g. "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA A100-SXM4-40GB", "Tesla V100-SXM2-16GB".
_GPU_PEAK_TFLOPS = [
    # pattern,          fp32,  tf32,   bf16,    fp16
    (r"\bGH200\b",      67.0,  494.7,  989.4,   989.4),
    (r"\bH200 NVL\b",   60.0,  417.5,  835.5,   835.5),
    (r"\bH200\b",       67.0,  494.7,  989.4,   989.4),
    (r"\bH100 NVL\b",   60.0,  417.5,  835.5,   835.5),
    (r"\bH100 PCIe\b",  51.2,  378.0,  756.0,   756.0),
    (r"\bH100\b",       66.9,  494.7,  989.4,   989.4),
    (r"\bA100\b",       19.5,  156.0,  312.0,   312.0),
    (r"\bA30\b",        10.3,   82.0,  165.0,   165.0),
    (r"\bL40S\b",       91.6,  183.0,  362.05,  362.05),
    (r"\bL40\b",        90.5,   90.5,  181.05,  181.05),
    (r"\bA40\b",        37.4,   74.8,  149.7,   149.7),
    (r"\bA10\b",        31.2,   62.5,  125.0,   125.0),
    (r"\bL4\b",         30.3,   60.0,  121.0,   121.0),
    (r"\bV100S\b",      16.4,   None,  None,    130.0),
    (r"\bV100-PCIE\b",  14.0,   None,  None,    112.0),
    (r"\bV100\b",       15.7,   None,  None,    125.0),
    (r"\bT4\b",          8.1,   None,  None,     65.0),
]
_PRECISIONS = ("fp32", "tf32", "bf16", "fp16")
_peak_cache: dict[tuple, float] = {}


def _precision_key(device: torch.device, dtype: torch.dtype, tf32: Optional[bool]) -> str:
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    if dtype != torch.float32:
        raise ValueError(f"no peak FLOP/s for dtype {dtype}: use float32, bfloat16 or float16")
    if tf32 is None:
        tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


def gpu_spec_peak_flops(device_name: str, precision: str) -> Optional[float]:
    """Datasheet dense peak FLOP/s of a GPU by name for "fp32"/"tf32"/"bf16"/"fp16"; None if unknown."""
    for pattern, *peaks in _GPU_PEAK_TFLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            peak = peaks[_PRECISIONS.index(precision)]
            return None if peak is None else peak * 1e12
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Below these sides per-call overhead (dispatch, OpenMP start-up, a kernel launch) dominates a matmul's time,
# so its FLOP/s say nothing of the peak: the probe grows at least this far, however long a small call took.
MIN_PROBE_SIDE = {"cpu": 512, "cuda": 2048}
MAX_PROBE_SIDE = {"cpu": 2048, "cuda": 8192}
BUSY_SPREAD = 2.0  # median / fastest repetition above this: other processes took the cores while we timed


@dataclass(frozen=True)
class PeakMeasurement:
    """What :func:`measure_matmul_peak` found: the best FLOP/s, at which side, and whether the machine was busy."""

    flops: float
    side: int
    spread: float
    """Median over fastest time of the repetitions at ``side`` (1.0: every repetition as fast as the best)."""
    busy: bool
    """The repetitions were too uneven (spread > BUSY_SPREAD) to trust the figure: another process held the cores."""

    def warning(self) -> str:
        return (f"the machine was too busy to measure its peak: repeated {self.side}x{self.side} matmuls varied "
                f"{self.spread:.1f}x (median/fastest), so {self.flops / 1e9:.1f} GFLOP/s may be low and MFU high; "
                "measure again on an idle machine")


def measure_matmul_peak(device, dtype=torch.float32, budget_s: float = 1.0) -> PeakMeasurement:
    """Best FLOP/s of square matmuls on ``device`` within about ``budget_s`` seconds, and how trustworthy it is.

    Grows the side from 128 until one matmul takes ~20 ms (or MAX_PROBE_SIDE), but never stops below
    MIN_PROBE_SIDE: a busy machine can make a 128x128 matmul take 24 ms (two OpenMP threads waiting for one
    core), and stopping there reported 0.15 GFLOP/s for a CPU that does 60. Then it spends the rest of the
    budget repeating the last size: the best repetition is the peak (preemption only ever slows a repetition
    down), and the spread of the repetitions says whether the machine was busy. The budget may be exceeded to
    reach MIN_PROBE_SIDE. Uses its own random generator, so the global RNG stream is untouched. On CPU the
    result is for the threads torch uses now (torchrun sets OMP_NUM_THREADS=1).
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    kind = "cuda" if device.type == "cuda" else "cpu"
    min_side, max_side = MIN_PROBE_SIDE[kind], MAX_PROBE_SIDE[kind]
    deadline = time.perf_counter() + budget_s

    def timings(a: torch.Tensor, b: torch.Tensor, repeats: int) -> list[float]:
        times: list[float] = []
        for repeat in range(repeats):
            if repeat > 2 and time.perf_counter() > deadline:  # at least 3: a median and a best
                break
            _synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _synchronize(device)
            times.append(max(time.perf_counter() - start, 1e-9))
        return times

    side = 128
    while True:
        a = torch.randn(side, side, device=device, dtype=dtype, generator=generator)
        b = torch.randn(side, side, device=device, dtype=dtype, generator=generator)
        fastest = min(timings(a, b, repeats=4))  # the first includes kernel selection and allocation
        # The next size costs ~8x as much per matmul.
        out_of_time = time.perf_counter() + 8 * fastest * 4 > deadline
        if side >= max_side or (side >= min_side and (fastest > 0.02 or out_of_time)):
            break
        side *= 2
    times = timings(a, b, repeats=20 if time.perf_counter() < deadline else 3)
    fastest = min(fastest, *times)
    spread = statistics.median(times) / fastest
    return PeakMeasurement(2 * side**3 / fastest, side, spread, spread > BUSY_SPREAD)


def measure_matmul_flops(device, dtype=torch.float32, budget_s: float = 1.0) -> float:
    """:func:`measure_matmul_peak`'s FLOP/s; measured once more with twice the budget if the machine was busy,
    and a warning if it still was (the better of the two figures is returned)."""
    peak = measure_matmul_peak(device, dtype, budget_s)
    if peak.busy:
        again = measure_matmul_peak(device, dtype, 2 * budget_s)
        peak = again if again.flops > peak.flops else peak
        if again.busy:
            warnings.warn(peak.warning(), RuntimeWarning, stacklevel=2)
    return peak.flops


def device_peak_flops(device, dtype=torch.float32, tf32: Optional[bool] = None) -> float:
    """Peak dense FLOP/s of one ``device`` for matmuls in ``dtype`` (the denominator of MFU).

    CUDA: the datasheet figure for known GPUs (float32 counts as TF32 when
    ``torch.backends.cuda.matmul.allow_tf32`` is on, or ``tf32=True``), else a measured matmul.
    CPU: measured (under ~1 s), so MFU on CPU is relative to what this machine's BLAS reaches.
    ``dtype`` may also be "none"/"fp32"/"bf16"/"fp16" (the amp_dtype config values).
    Cached per (device, dtype, tf32) for the process.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if isinstance(dtype, str):
        dtype = dtype_of(dtype)
    precision = _precision_key(device, dtype, tf32)
    key = (str(device), precision)
    if key not in _peak_cache:
        peak = None
        if device.type == "cuda":
            peak = gpu_spec_peak_flops(torch.cuda.get_device_name(device), precision)
        if peak is None:
            if precision == "tf32":
                # Measure with TF32 on, whatever the global setting, since that is what was asked.
                previous = torch.backends.cuda.matmul.allow_tf32
                torch.backends.cuda.matmul.allow_tf32 = True
                try:
                    peak = measure_matmul_flops(device, dtype)
                finally:
                    torch.backends.cuda.matmul.allow_tf32 = previous
            else:
                peak = measure_matmul_flops(device, dtype)
        _peak_cache[key] = peak
    return _peak_cache[key]


def mfu(flops_per_sample: float, samples_per_sec: float, peak_flops: float) -> float:
    """Model FLOPs utilisation as a fraction (0.123 = 12.3 %).

    Pass the throughput and the peak of the same set of devices: per-rank throughput with one
    device's peak, or global throughput with ``world_size * peak``.
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    value = flops_per_sample * samples_per_sec / peak_flops
    if value > 1.0:  # a peak that the step itself beats is wrong: never a figure
        warnings.warn(f"MFU {100 * value:.0f} % > 100 %: the step ran {value:.1f}x faster than the measured peak "
                      f"({peak_flops / 1e9:.3g} GFLOP/s), which is too low: measured while the machine was busy, or "
                      "for matmuls in a precision the step mostly does not compute in (fp16 on a CPU); MFU is "
                      "reported as 100 %", RuntimeWarning, stacklevel=2)
        return 1.0
    return value


# ---------------------------------------------------------------------------------------- memory


def peak_memory_gb(device) -> float:
    """Peak memory of this process on ``device`` in GB (1e9 bytes).

    CUDA: the peak of memory allocated by tensors (since the last :func:`reset_peak_memory`),
    the figure PyTorch can control; the cache and the CUDA context add to what nvidia-smi shows.
    CPU: the peak resident set size of the whole process over its lifetime (cannot be reset).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    try:
        import resource  # Unix only: imported here so that Windows falls back below
    except ImportError:  # Windows: no getrusage; current RSS is the best available
        return psutil.Process().memory_info().rss / 1e9
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bytes_per_unit = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return max_rss * bytes_per_unit / 1e9


def reset_peak_memory(device) -> None:
    """Start a new peak for :func:`peak_memory_gb` (CUDA only; the CPU peak is per process)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
