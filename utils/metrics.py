"""What a training run measures and shows: logs, throughput, memory, MFU, RMSE and sample images.

- :class:`MetricsLogger` writes every record to ``metrics.jsonl`` (one JSON object a line), to
  TensorBoard and as one line on the console. Records are dicts with ``kind`` and ``step``;
  the keys below get a compact console format, any other key prints as ``key value``:

  ============== ========================= =================================
  key            meaning                   console
  ============== ========================= =================================
  loss           training loss             ``loss 1.234``
  lr             learning rate             ``lr 8.0e-04``
  samples_per_sec  global throughput       ``123.4 samples/s``
  mfu            fraction of peak FLOP/s   ``mfu 12.3%``
  peak_mem_gb    peak memory (GB, 1e9 B)   ``mem 1.23 GB``
  step_time_s    seconds per step          ``0.123 s/step``
  ============== ========================= =================================

- MFU (model FLOPs utilisation) = model FLOPs per second / peak FLOP/s of the device(s):
  :func:`train_flops_per_sample` counts the FLOPs of one training step on the meta device,
  :func:`device_peak_flops` gives the peak, :func:`mfu` divides.
- :class:`RMSEAccumulator` gives per-channel (optionally latitude-weighted) RMSE over a whole
  validation set and all ranks; :class:`ACCAccumulator` the anomaly correlation of forecasts.
- :func:`save_sample_png` draws one super-resolution sample next to its bicubic baseline,
  :func:`save_forecast_png` one forecast next to persistence, :func:`save_volume_png` a slice of a 3-D
  sample (inputs, truth, model, error); :class:`L1Accumulator` gives per-channel mean absolute errors.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from utils.checkpoint import METRICS_FILE, find_run_dir, replaced_atomically, reporting_write_failures, write_failure
from utils.precision import dtype_of

# --------------------------------------------------------------------------------------- logging

_CONSOLE_FORMATS = {
    "loss": "loss {:.4g}",
    "lr": "lr {:.1e}",
    "samples_per_sec": "{:.1f} samples/s",
    "mfu": "mfu {:.1%}",
    "peak_mem_gb": "mem {:.2f} GB",
    "step_time_s": "{:.3f} s/step",
}
_NOT_METRICS = ("kind", "step", "time")


def _to_python(value: Any) -> Any:
    """Tensors and NumPy values -> Python numbers and lists (JSON- and TensorBoard-ready)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, dict):
        return {str(key): _to_python(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_python(item) for item in value]
    return value


def json_safe(value: Any) -> Any:
    # Strict JSON has no NaN/Infinity: write null so every JSON reader (jq, pandas, JS) accepts the file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_safe(item) for item in value]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class MetricsLogger:
    """Writes records to ``run_dir/metrics.jsonl``, TensorBoard (event files in run_dir) and the console.

    ``enabled=False`` (ranks other than 0) makes every method a no-op that creates nothing.
    ``console`` takes one string per record (``print``, ``tqdm.write``, or None for silence).
    ``channel_names`` name the entries of list values in TensorBoard and on the console;
    ``console_channels`` (names) limit the console to those channels (20 channels x 6 forecast
    metrics would not fit a line); metrics.jsonl and TensorBoard always get every channel.
    A resumed run appends to the existing metrics.jsonl.

    A write that fails for lack of space (or quota, or an I/O error) raises StorageError, one line that
    names the last good checkpoint; metrics.jsonl keeps only whole records, and the logger is closed.
    """

    def __init__(
        self,
        run_dir,
        enabled: bool = True,
        tensorboard: bool = True,
        console: Optional[Callable[[str], Any]] = print,
        channel_names: Optional[Sequence[str]] = None,
        console_channels: Optional[Sequence[str]] = None,
    ):
        self.enabled = enabled
        self.console = console
        self.channel_names = list(channel_names) if channel_names else None
        self.console_channels = list(console_channels) if console_channels else None
        self.run_dir = Path(run_dir)
        self._jsonl = None
        self._writer = None
        self._metrics_path = self.run_dir / METRICS_FILE
        if not enabled:
            return
        with self._reporting("metrics", self._metrics_path):
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Unbuffered bytes: a failed write raises at once and leaves nothing queued for close() to retry.
            self._jsonl = open(self._metrics_path, "ab", buffering=0)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                self._say("tensorboard is not installed: metrics go to metrics.jsonl only (pip install tensorboard)")
            else:
                _quiet_tensorboard_write_thread()
                with self._reporting("TensorBoard events in", self.run_dir):
                    # flush_secs: log() flushes every record itself, so the writer thread never needs to.
                    self._writer = SummaryWriter(log_dir=str(self.run_dir), flush_secs=10**9)

    @contextlib.contextmanager
    def _reporting(self, what: str, path: Path):
        """A failed write becomes StorageError; the logger then closes what it holds without writing more."""
        try:
            yield
        except Exception as error:
            failure = write_failure(error, what, path, run_dir=self.run_dir)
            if failure is None:
                raise
            self._abandon()
            raise failure from None

    def _abandon(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()  # unbuffered: closing writes nothing
            self._jsonl = None
        self._writer = None  # its thread has stopped with the error; closing it would flush and fail again

    def _append(self, line: bytes) -> None:
        """Append one record whole: a short write on a full disk is cut off again, so every line stays JSON."""
        fd = self._jsonl.fileno()
        size = os.fstat(fd).st_size
        try:
            written = 0
            while written < len(line):
                written += self._jsonl.write(line[written:])
        except OSError:
            os.ftruncate(fd, size)
            raise

    def _say(self, line: str) -> None:
        if self.console is not None:
            self.console(line)

    def log(self, record: dict) -> None:
        """Write one record: ``{"kind": "train" | "val" | ..., "step": int, key: value, ...}``.

        Values may be numbers, strings, 0-d tensors, lists (per channel) or dicts of numbers.
        Non-finite numbers are written as null in metrics.jsonl.
        """
        if "kind" not in record or "step" not in record:
            raise ValueError(f"a metrics record needs 'kind' and 'step', got keys {sorted(record)}")
        if not self.enabled:
            return
        if self._jsonl is None:
            raise ValueError("MetricsLogger.log called after close()")
        record = {key: _to_python(value) for key, value in record.items()}
        record.setdefault("time", round(time.time(), 3))
        with self._reporting("metrics", self._metrics_path):
            self._append((json.dumps(json_safe(record)) + "\n").encode())  # unbuffered: a killed run keeps it
        if self._writer is not None:
            # The writer thread's error surfaces in these calls.
            with self._reporting("TensorBoard events in", self.run_dir):
                for tag, value in self._scalars(record):
                    self._writer.add_scalar(tag, value, global_step=int(record["step"]))
                self._writer.flush()
        self._say(self.format_line(record))

    def _names_for(self, values: list) -> list[str]:
        if self.channel_names and len(self.channel_names) == len(values):
            return self.channel_names
        return [str(index) for index in range(len(values))]

    def _scalars(self, record: dict):
        """(tag, number) pairs: ``kind/key`` for numbers, ``kind/key/name`` for lists and dicts."""
        kind = record["kind"]
        for key, value in record.items():
            if key in _NOT_METRICS:
                continue
            if isinstance(value, list):
                value = dict(zip(self._names_for(value), value))
            if isinstance(value, dict):
                for name, item in value.items():
                    if _is_number(item):
                        yield f"{kind}/{key}/{name}", float(item)
            elif _is_number(value):
                yield f"{kind}/{key}", float(value)

    def format_line(self, record: dict) -> str:
        """The console line: ``step     50 | loss 1.234 | lr 8.0e-04 | 123.4 samples/s | ...``."""
        head = f"step {record['step']:>6}"
        if record["kind"] != "train":
            head = f"{record['kind']:<5} {head}"
        parts = [head]
        for key, value in record.items():
            if key in _NOT_METRICS or value is None:
                continue
            if key in _CONSOLE_FORMATS and _is_number(value):
                parts.append(_CONSOLE_FORMATS[key].format(value))
            elif isinstance(value, list) and self._names_for(value) != self.channel_names:
                parts.append(f"{key} " + "/".join(_fmt_value(item) for item in value))
            elif isinstance(value, (list, dict)):
                named = value if isinstance(value, dict) else dict(zip(self.channel_names, value))
                if isinstance(value, list) and self.console_channels:
                    named = {name: named[name] for name in self.console_channels if name in named}
                # Commas: channel names may contain spaces ("temperature 2 m").
                parts.append(f"{key}: " + ", ".join(f"{name} {_fmt_value(item)}" for name, item in named.items()))
            else:
                parts.append(f"{key} {_fmt_value(value)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._writer is not None:
            with self._reporting("TensorBoard events in", self.run_dir):
                self._writer.close()
            self._writer = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _quiet_tensorboard_write_thread() -> None:
    """Keep TensorBoard's writer thread from printing a traceback for a full disk.

    The thread stores its error and ends; SummaryWriter raises it again in the next add_scalar or flush,
    in the training loop, where MetricsLogger reports it as one line. Other errors print as before.
    """
    previous = threading.excepthook
    if getattr(previous, "quiet_tensorboard", False):
        return

    def hook(args) -> None:
        if not (type(args.thread).__name__ == "_AsyncWriterThread" and write_failure(args.exc_value, "", ".")):
            previous(args)

    hook.quiet_tensorboard = True
    threading.excepthook = hook


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
        import resource
    except ImportError:  # Windows: no getrusage; current RSS is the best available
        import psutil

        return psutil.Process().memory_info().rss / 1e9
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bytes_per_unit = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return max_rss * bytes_per_unit / 1e9


def reset_peak_memory(device) -> None:
    """Start a new peak for :func:`peak_memory_gb` (CUDA only; the CPU peak is per process)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


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
    try:
        with torch.device("meta"):
            model = model_fn()
    except (NotImplementedError, RuntimeError):
        # The constructor read a tensor's values (e.g. torch.linspace(...).tolist()), which meta
        # tensors do not have: build on the CPU once, then drop the storage.
        model = model_fn().to("meta")
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


def measure_matmul_flops(device, dtype=torch.float32, budget_s: float = 1.0) -> float:
    """Best FLOP/s of square matmuls on ``device`` within about ``budget_s`` seconds.

    Grows the side until one matmul takes ~20 ms (or 2048 on CPU, 8192 on GPU), then spends the
    rest of the budget repeating it: the best repetition is the peak, so a busy machine (other
    processes preempting ours) lowers the figure less than a single timing would.
    Uses its own random generator, so the global RNG stream (and hence reproducibility) is untouched.
    On CPU the result is for the threads torch uses now (torchrun sets OMP_NUM_THREADS=1).
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    max_side = 8192 if device.type == "cuda" else 2048
    deadline = time.perf_counter() + budget_s

    def fastest_of(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
        fastest = math.inf
        for repeat in range(repeats):
            if repeat > 0 and time.perf_counter() > deadline:
                break
            _synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            _synchronize(device)
            fastest = min(fastest, max(time.perf_counter() - start, 1e-9))
        return fastest

    side = 128
    while True:
        a = torch.randn(side, side, device=device, dtype=dtype, generator=generator)
        b = torch.randn(side, side, device=device, dtype=dtype, generator=generator)
        fastest = fastest_of(a, b, repeats=4)  # the first includes kernel selection and allocation
        # The next size costs ~8x as much per matmul.
        # Below 512 per-call overhead dominates: a busy machine must not stop the growth there.
        out_of_time = side >= 512 and time.perf_counter() + 8 * fastest * 4 > deadline
        if fastest > 0.02 or side >= max_side or out_of_time:
            break
        side *= 2
    if time.perf_counter() < deadline:
        fastest = min(fastest, fastest_of(a, b, repeats=20))
    return 2 * side**3 / fastest


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
    return flops_per_sample * samples_per_sec / peak_flops


# ----------------------------------------------------------------------------------------- RMSE


class RMSEAccumulator:
    """Per-channel RMSE over a whole validation set, independent of how it is batched or sharded.

    Accumulates the (weighted) sum of squared errors and the sum of weights per channel in float64;
    the RMSE is taken once at the end, never averaged over batches. ``row_weights`` (H,) weight the
    latitude rows (forecasting: cos-latitude, mean 1); None weighs every pixel alike.
    """

    def __init__(self, channels: int, device="cpu", row_weights: Optional[torch.Tensor] = None):
        self.channels = channels
        # Row 0: sum of squared errors, row 1: sum of weights; one tensor -> one all_reduce.
        self._sums = torch.zeros(2, channels, dtype=torch.float64, device=device)
        self._weights = None if row_weights is None else row_weights.to(device, torch.float64).view(1, 1, -1, 1)

    def reset(self) -> None:
        self._sums.zero_()

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        """Add a batch: ``pred`` and ``target`` of shape (B, C, H, W) in the same units."""
        if pred.shape != target.shape or pred.dim() != 4 or pred.shape[1] != self.channels:
            raise ValueError(
                f"RMSEAccumulator({self.channels} channels) needs pred and target of equal shape "
                f"(B, {self.channels}, H, W); got {tuple(pred.shape)} and {tuple(target.shape)}"
            )
        error = pred.detach().to(self._sums.device, torch.float64) - target.detach().to(self._sums.device, torch.float64)
        squared = error.square()
        if self._weights is None:
            self._sums[1] += pred[:, 0].numel()
        else:
            if self._weights.shape[2] != pred.shape[2]:
                raise ValueError(f"RMSEAccumulator: {self._weights.shape[2]} row weights for {pred.shape[2]} rows")
            squared = squared * self._weights
            self._sums[1] += self._weights.sum() * pred.shape[0] * pred.shape[3]
        self._sums[0] += squared.sum(dim=(0, 2, 3))

    def compute(self, all_reduce: bool = False) -> list[float]:
        """Per-channel RMSE. ``all_reduce=True`` sums over all ranks first (every rank must call it;
        a no-op without an initialised process group). The accumulator itself is not changed."""
        sums = _summed(self._sums, all_reduce)
        if (sums[1] == 0).any():
            raise ValueError("RMSEAccumulator.compute: no samples were added (empty validation set?)")
        return torch.sqrt(sums[0] / sums[1]).tolist()


class ACCAccumulator:
    """Anomaly correlation coefficient per channel, averaged over samples (as WeatherBench and FourCastNet).

    For each sample and channel, with anomalies against the climatology ``clim`` (C, H, W) and
    latitude weights w: ``sum(w f' a') / sqrt(sum(w f'^2) sum(w a'^2))``, f' = forecast - clim,
    a' = truth - clim (uncentred). 1 is a perfect pattern, 0 no skill; a sample whose forecast
    anomaly is zero everywhere (the climatology forecast itself) counts as 0.
    """

    def __init__(self, climatology: torch.Tensor, row_weights: torch.Tensor, device="cpu"):
        self.climatology = climatology.to(device, torch.float64)
        self.channels = climatology.shape[0]
        self._weights = row_weights.to(device, torch.float64).view(1, 1, -1, 1)
        self._sums = torch.zeros(2, self.channels, dtype=torch.float64, device=device)  # sum of ACC, samples

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        if pred.shape != target.shape or pred.shape[1:] != self.climatology.shape:
            raise ValueError(f"ACCAccumulator: pred and target must be (B, {', '.join(map(str, self.climatology.shape))}), "
                             f"got {tuple(pred.shape)} and {tuple(target.shape)}")
        f = pred.detach().to(self._sums.device, torch.float64) - self.climatology
        a = target.detach().to(self._sums.device, torch.float64) - self.climatology
        w = self._weights
        numerator = (w * f * a).sum(dim=(2, 3))
        denominator = torch.sqrt((w * f * f).sum(dim=(2, 3)) * (w * a * a).sum(dim=(2, 3)))
        acc = torch.where(denominator > 0, numerator / denominator.clamp_min(1e-300), torch.zeros_like(numerator))
        self._sums[0] += acc.sum(dim=0)
        self._sums[1] += pred.shape[0]

    def compute(self, all_reduce: bool = False) -> list[float]:
        sums = _summed(self._sums, all_reduce)
        if (sums[1] == 0).any():
            raise ValueError("ACCAccumulator.compute: no samples were added (empty validation set?)")
        return (sums[0] / sums[1]).tolist()


class L1Accumulator:
    """Per-channel mean absolute error over a whole validation set of (B, C, ...) tensors (2-D fields or 3-D
    volumes), independent of batching and of the number of ranks: sums in float64, divided once at the end."""

    def __init__(self, channels: int, device="cpu"):
        self.channels = channels
        self._sums = torch.zeros(2, channels, dtype=torch.float64, device=device)  # |error| sum, values

    def update(self, pred: torch.Tensor, target: torch.Tensor) -> None:
        if pred.shape != target.shape or pred.dim() < 3 or pred.shape[1] != self.channels:
            raise ValueError(f"L1Accumulator({self.channels} channels) needs pred and target of equal shape "
                             f"(B, {self.channels}, ...); got {tuple(pred.shape)} and {tuple(target.shape)}")
        error = pred.detach().to(self._sums.device, torch.float64) - target.detach().to(self._sums.device, torch.float64)
        self._sums[0] += error.abs().transpose(0, 1).reshape(self.channels, -1).sum(dim=1)
        self._sums[1] += pred[:, 0].numel()

    def compute(self, all_reduce: bool = False) -> list[float]:
        sums = _summed(self._sums, all_reduce)
        if (sums[1] == 0).any():
            raise ValueError("L1Accumulator.compute: no samples were added (empty validation set?)")
        return (sums[0] / sums[1]).tolist()


def _summed(sums: torch.Tensor, all_reduce: bool) -> torch.Tensor:
    sums = sums.clone()
    if all_reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    return sums


def latitude_weights(stored_height: int, rows: Optional[int] = None) -> torch.Tensor:
    """cos(latitude) of the first ``rows`` rows of a grid with ``stored_height`` rows from 90N to 90S
    (both poles included, as ERA5's 721), normalised to mean 1 over those rows."""
    rows = stored_height if rows is None else rows
    if stored_height < 2 or not 0 < rows <= stored_height:
        raise ValueError(f"latitude_weights: need 2 <= stored_height and 0 < rows <= stored_height, got {stored_height}, {rows}")
    lat = torch.deg2rad(90.0 - torch.arange(rows, dtype=torch.float64) * 180.0 / (stored_height - 1))
    weights = torch.cos(lat).clamp_min(0.0)
    return weights / weights.mean()


# ------------------------------------------------------------------------------- baseline, images


def bicubic_upsample(lr: torch.Tensor, factor: int, size: Optional[Sequence[int]] = None) -> torch.Tensor:
    """The bicubic baseline: ``lr`` (B, C, h, w) or (C, h, w) resized to ``size`` (H, W) or (h*factor, w*factor).

    Matches how the data's low-res input is made (bicubic, align_corners=False). Computed and
    returned in at least float32, so half-precision inputs do not degrade the baseline.
    """
    unbatched = lr.dim() == 3
    batch = lr.unsqueeze(0) if unbatched else lr
    if batch.dim() != 4:
        raise ValueError(f"bicubic_upsample needs (B, C, h, w) or (C, h, w), got shape {tuple(lr.shape)}")
    if size is None:
        size = (batch.shape[-2] * factor, batch.shape[-1] * factor)
    batch = batch.to(torch.promote_types(batch.dtype, torch.float32))
    upsampled = F.interpolate(batch, size=tuple(size), mode="bicubic", align_corners=False)
    return upsampled[0] if unbatched else upsampled


def _as_chw_numpy(tensor: torch.Tensor, name: str):
    if tensor.dim() == 4 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 3:
        raise ValueError(f"save_sample_png: {name} must be (C, H, W), got shape {tuple(tensor.shape)}")
    return tensor.detach().float().cpu().numpy()


def _rmse(a, b) -> float:
    return float(np.sqrt(np.nanmean((a - b) ** 2)))


def save_sample_png(
    path,
    lr: torch.Tensor,
    bicubic: torch.Tensor,
    pred: torch.Tensor,
    hr: torch.Tensor,
    channel_names: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    panel_width_in: float = 3.0,
    dpi: int = 110,
) -> None:
    """Draw one super-resolution sample: a row per channel; LR input, bicubic, model, HR truth, |model - truth|.

    The four field panels of a row share one colour range (the truth's min..max; values beyond it
    saturate), so they compare at a glance; the error has its own scale from 0. Panel titles give
    the RMSE of bicubic and model against the truth. Written atomically; parent folders are created.
    """
    lr_np, bicubic_np, pred_np, hr_np = (
        _as_chw_numpy(t, n) for t, n in ((lr, "lr"), (bicubic, "bicubic"), (pred, "pred"), (hr, "hr"))
    )
    if not (bicubic_np.shape == pred_np.shape == hr_np.shape) or lr_np.shape[0] != hr_np.shape[0]:
        raise ValueError(
            "save_sample_png: bicubic, pred and hr must have one shape and lr the same channels; got "
            f"lr {lr_np.shape}, bicubic {bicubic_np.shape}, pred {pred_np.shape}, hr {hr_np.shape}"
        )
    channels, height, width = hr_np.shape
    names = _channel_labels(channel_names, channels)
    rows = [(names[c], hr_np[c],
             [(lr_np[c], f"LR input {lr_np.shape[1]}×{lr_np.shape[2]}"),
              (bicubic_np[c], f"bicubic  RMSE {_rmse(bicubic_np[c], hr_np[c]):.4g}"),
              (pred_np[c], f"model  RMSE {_rmse(pred_np[c], hr_np[c]):.4g}"),
              (hr_np[c], f"HR truth {height}×{width}")],
             [(np.abs(pred_np[c] - hr_np[c]), "|model − truth|")])
            for c in range(channels)]
    _save_panels(path, rows, height / width, title, panel_width_in, dpi)


def save_forecast_png(
    path,
    inputs: torch.Tensor,
    truth: torch.Tensor,
    forecast: torch.Tensor,
    channel_names: Optional[Sequence[str]] = None,
    channels: Optional[Sequence[int]] = None,
    title: Optional[str] = None,
    panel_width_in: float = 3.0,
    dpi: int = 110,
) -> None:
    """Draw one forecast: a row per channel in ``channels`` (default: the first two); input (time t),
    truth (t + lead), forecast, then the errors of persistence (input − truth) and of the forecast.

    Input, truth and forecast share the truth's colour range; the two error panels share one
    scale, so the forecast's gain over persistence shows at a glance. Written atomically.
    """
    x_np, y_np, f_np = (_as_chw_numpy(t, n) for t, n in ((inputs, "inputs"), (truth, "truth"), (forecast, "forecast")))
    if not x_np.shape == y_np.shape == f_np.shape:
        raise ValueError(f"save_forecast_png: inputs, truth and forecast must have one shape; got "
                         f"{x_np.shape}, {y_np.shape}, {f_np.shape}")
    count, height, width = y_np.shape
    names = _channel_labels(channel_names, count)
    shown = list(channels) if channels is not None else list(range(min(2, count)))
    if not shown or any(not 0 <= c < count for c in shown):
        raise ValueError(f"save_forecast_png: channels {shown} must be indices of the {count} channels")
    rows = [(names[c], y_np[c],
             [(x_np[c], "input (t)"), (y_np[c], "truth (t + lead)"), (f_np[c], "forecast")],
             [(np.abs(x_np[c] - y_np[c]), f"|persistence − truth|  RMSE {_rmse(x_np[c], y_np[c]):.4g}"),
              (np.abs(f_np[c] - y_np[c]), f"|forecast − truth|  RMSE {_rmse(f_np[c], y_np[c]):.4g}")])
            for c in shown]
    _save_panels(path, rows, height / width, title, panel_width_in, dpi)


def save_volume_png(
    path,
    inputs: torch.Tensor,
    pred: torch.Tensor,
    truth: torch.Tensor,
    input_names: Optional[Sequence[str]] = None,
    channel_names: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    panel_width_in: float = 2.4,
    dpi: int = 110,
) -> None:
    """Draw the middle slice (along axis 0) of one 3-D sample: a row per output channel with an input channel
    (row r shows input r, as far as there are inputs), the truth, the model and |model − truth|.

    Truth and model share the truth's colour range; each input has its own. Written atomically.
    """
    x_np, p_np, t_np = (_as_chw_numpy(t[:, t.shape[1] // 2] if t.dim() == 4 else t, n)
                        for t, n in ((inputs, "inputs"), (pred, "pred"), (truth, "truth")))
    if p_np.shape != t_np.shape:
        raise ValueError(f"save_volume_png: pred and truth must have one shape; got {p_np.shape} and {t_np.shape}")
    in_names, out_names = _channel_labels(input_names, x_np.shape[0]), _channel_labels(channel_names, t_np.shape[0])
    from matplotlib.figure import Figure

    rows = max(len(in_names), len(out_names))
    fig = Figure(figsize=(4 * panel_width_in + 2.4, rows * (panel_width_in * t_np.shape[1] / t_np.shape[2] + 0.5) + 0.5),
                 layout="constrained")
    axes = fig.subplots(rows, 4, squeeze=False)
    for row in range(rows):
        if row < len(in_names):
            image = axes[row, 0].imshow(x_np[row], cmap="cividis")
            axes[row, 0].set_title(f"input: {in_names[row]}", fontsize=9)
            fig.colorbar(image, ax=axes[row, 0], shrink=0.9, pad=0.01)
        if row < len(out_names):
            vmin, vmax = float(np.nanmin(t_np[row])), float(np.nanmax(t_np[row]))
            for ax, field, label in ((axes[row, 1], t_np[row], f"truth: {out_names[row]}"),
                                     (axes[row, 2], p_np[row], f"model  L1 {np.abs(p_np[row] - t_np[row]).mean():.3g}")):
                image = ax.imshow(field, cmap="viridis", vmin=vmin, vmax=vmax)
                ax.set_title(label, fontsize=9)
            fig.colorbar(image, ax=list(axes[row, 1:3]), shrink=0.9, pad=0.01)
            error = np.abs(p_np[row] - t_np[row])
            image = axes[row, 3].imshow(error, cmap="magma", vmin=0.0, vmax=float(np.nanmax(error)) or 1.0)
            axes[row, 3].set_title("|model − truth|", fontsize=9)
            fig.colorbar(image, ax=axes[row, 3], shrink=0.9, pad=0.01)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
            if not ax.images:
                ax.set_axis_off()
    if title:
        fig.suptitle(title, fontsize=11)
    _save_figure(fig, path, dpi)


def _channel_labels(channel_names: Optional[Sequence[str]], channels: int) -> list[str]:
    return list(channel_names) if channel_names else [f"channel {c}" for c in range(channels)]


def _save_panels(path, rows, aspect: float, title: Optional[str], panel_width_in: float, dpi: int) -> None:
    """One figure row per (name, truth, fields, errors): the field panels share the truth's colour range, the
    error panels one scale from 0 (largest error of the row)."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas on save

    columns = len(rows[0][2]) + len(rows[0][3])
    panel_height_in = panel_width_in * aspect
    fig = Figure(figsize=(columns * panel_width_in + 1.6, len(rows) * (panel_height_in + 0.55) + 0.4),
                 layout="constrained")
    axes = fig.subplots(len(rows), columns, squeeze=False)
    for row, (name, truth, fields, errors) in enumerate(rows):
        vmin, vmax = float(np.nanmin(truth)), float(np.nanmax(truth))
        for ax, (field, label) in zip(axes[row], fields):
            image = ax.imshow(field, cmap="viridis", vmin=vmin, vmax=vmax)
            ax.set_title(label, fontsize=9)
        fig.colorbar(image, ax=list(axes[row, :len(fields)]), shrink=0.9, pad=0.01)
        error_max = max(float(np.nanmax(error)) for error, _ in errors) or 1.0
        for ax, (error, label) in zip(axes[row, len(fields):], errors):
            error_image = ax.imshow(error, cmap="magma", vmin=0.0, vmax=error_max)
            ax.set_title(f"{label}  max {float(np.nanmax(error)):.3g}", fontsize=9)
        fig.colorbar(error_image, ax=list(axes[row, len(fields):]), shrink=0.9, pad=0.01)
        axes[row, 0].set_ylabel(name, fontsize=10)
        for ax in axes[row]:
            ax.set_xticks([])
            ax.set_yticks([])
    if title:
        fig.suptitle(title, fontsize=11)
    _save_figure(fig, path, dpi)


def _save_figure(fig, path, dpi: int) -> None:
    """Write a figure as PNG atomically (parent folders created; a failed write is one line)."""
    path = Path(path)
    with reporting_write_failures("picture", path, run_dir=find_run_dir(path)):
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(path) as temporary:
            fig.savefig(temporary, format="png", dpi=dpi)
