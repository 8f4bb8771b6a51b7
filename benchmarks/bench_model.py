"""Time one SwinIR training step and compare its FLOP rate with the device's measured matmul peak.

A step is forward + L1 loss + backward + AdamW step on random low-res inputs (batch --batch_size,
--size x --size pixels) of the named config's model (default: the tutorial's 11.75M SwinIR).
FLOPs per step are counted with torch.utils.flop_counter.FlopCounterMode (matmuls, convolutions
and attention; multiply and add counted separately). The matmul peak is measured in the same run
on the same device with large square matmuls (fp32, and bf16 where the device supports it): a
sweep of sizes picks the fastest, which is then measured again right after every timed step. The
fraction of peak is the median over steps of (FLOPs per step / that step's seconds) / (the matmul
FLOP/s measured right after it), so a slow moment of a shared machine affects both sides.

    python benchmarks/bench_model.py                       # tutorial model, LR 64x64, batch 1
    python benchmarks/bench_model.py --dtype bf16          # under bf16 autocast, vs the bf16 peak
    python benchmarks/bench_model.py --config quickstart --size 16 --steps 1 --warmup 1   # tiny
    python benchmarks/bench_model.py --breakdown           # + time per FLOP-counted op, and the ceiling
    python benchmarks/bench_model.py --dtype bf16 --roofline   # + a roofline by kernel class (benchmarks/roofline.py)

--breakdown profiles a few more steps and splits the step time between the ops that FlopCounterMode
counts (matmuls, convolutions, attention) and everything else. Its "ceiling" is the fraction of
peak the step would reach if everything else took no time.

The last line printed is one JSON object (sec_per_step, flops_per_step, matmul_peak_flops,
fraction_of_peak, and more).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
import yaml
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import roofline  # noqa: E402
from models import build_model, count_parameters  # noqa: E402
from utils.config import ConfigError, build_config  # noqa: E402
from utils.precision import DTYPES as ALL_DTYPES  # noqa: E402

DTYPES = {name: ALL_DTYPES[name] for name in ("fp32", "bf16")}  # the precisions these benchmarks time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="baseline", help="named config whose model section is timed")
    parser.add_argument("--size", type=int, default=64, help="low-res input side in pixels")
    parser.add_argument("--batch_size", type=int, default=1, help="samples per step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="bf16 runs the step under autocast")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--model_args", type=yaml.safe_load, default=None, metavar="MAPPING",
                        help="the model's arguments over the config's, in YAML: '{drop_path_rate: 0}' (no stochastic "
                             "depth; default: the config's)")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (peak and step alike)")
    parser.add_argument("--peak_seconds", type=float, default=0.3, help="time spent per matmul size for the peak")
    parser.add_argument("--peak_sizes", type=int, nargs="+", default=None, metavar="N",
                        help="matmul sides swept for the peak (default: 1024 2048 4096 on a CPU, 4096 8192 on a GPU)")
    parser.add_argument("--breakdown", action="store_true",
                        help="profile 3 more steps: time per FLOP-counted op and the fraction's ceiling")
    parser.add_argument("--roofline", action="store_true",
                        help="profile 3 more steps: FLOPs, bytes and kernel time by kernel class against the "
                             "measured matmul peak and copy bandwidth (benchmarks/roofline.py)")
    args = parser.parse_args(argv)
    for name in ("size", "batch_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.peak_sizes and min(args.peak_sizes) < 1:
        parser.error(f"--peak_sizes must be >= 1, got {args.peak_sizes}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (use --device cpu)")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def supports_bf16_matmul(device: torch.device) -> bool:
    """bf16 matmuls run natively: CUDA with bf16 support, or a CPU with AVX512-BF16/AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16"))


def cpu_description() -> str:
    """'AMD EPYC (family 25, model 1, AVX2)': the same model name can hide CPUs of different speed."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(re.findall(r"^(model name|cpu family|model|flags)\s*:\s*(.*)$", info, re.MULTILINE))
    flags = set(fields.get("flags", "").split())
    isa = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                if flag in flags), "no AVX2")
    if "model name" not in fields:
        return "cpu"
    return f"{fields['model name']} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')}, {isa})"


def seconds_in_ops(step, op_names, device: torch.device, steps: int = 3) -> dict[str, float]:
    """Seconds per step spent in each named aten op (with what it calls), from torch.profiler.

    CPU: wall time inside the op; CUDA: time of the kernels it launched.
    """
    events = {event.key: event for event in roofline.profiled_ops(step, device, steps)}
    seconds = {}
    for name in op_names:
        event = events.get(name.replace(".", "::", 1))  # FlopCounterMode's "aten.mm" is the profiler's "aten::mm"
        micros = 0.0 if event is None else event.device_time_total if device.type == "cuda" else event.cpu_time_total
        seconds[name] = micros / 1e6 / steps
    return seconds


def print_breakdown(flops_by_op: dict[str, int], seconds_by_op: dict[str, float], sec_per_step: float,
                    peak_flops: float) -> float | None:
    """Table of FLOPs, time and rate per op; returns the ceiling (the fraction without other work)."""
    if not sum(seconds_by_op.values()):  # e.g. CUDA without CUPTI: the profiler saw no kernel time
        print("breakdown: the profiler recorded no time in the FLOP-counted ops; no ceiling")
        return None
    print("where a step's time goes (torch.profiler over 3 more steps; an op's time includes what it calls):")
    print(f"  {'op':28s} {'GFLOP':>8s} {'s/step':>8s} {'GFLOP/s':>8s} {'of peak':>8s}")
    for name in sorted(flops_by_op, key=lambda op: -seconds_by_op[op]):
        flops, seconds = flops_by_op[name], seconds_by_op[name]
        rate = flops / seconds if seconds else float("nan")
        print(f"  {name:28s} {flops / 1e9:8.1f} {seconds:8.3f} {rate / 1e9:8.1f} {rate / peak_flops:8.2f}")
    counted = sum(seconds_by_op.values())
    total_flops = sum(flops_by_op.values())
    print(f"  {'all FLOP-counted ops':28s} {total_flops / 1e9:8.1f} {counted:8.3f} {total_flops / counted / 1e9:8.1f} "
          f"{total_flops / counted / peak_flops:8.2f}")
    print(f"  {'everything else':28s} {'':8s} {sec_per_step - counted:8.3f}   (median step time minus the above)")
    ceiling = total_flops / counted / peak_flops
    print(f"ceiling: fraction_of_peak would be {ceiling:.3f} if everything else took no time")
    return ceiling


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, min_seconds: float) -> float:
    """FLOP/s of n x n matmuls on device, timed for at least min_seconds."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)
    synchronize(device)
    reps, elapsed = 0, 0.0
    start = time.perf_counter()
    while elapsed < min_seconds:
        torch.mm(a, b)
        synchronize(device)
        reps += 1
        elapsed = time.perf_counter() - start
    return 2 * n ** 3 * reps / elapsed


def matmul_peak(device: torch.device, dtype: torch.dtype, min_seconds: float = 0.3,
                sizes: Optional[list[int]] = None) -> tuple[float, int]:
    """Best FLOP/s (and the size reaching it) of square matmuls on device."""
    sizes = sizes or ((1024, 2048, 4096) if device.type == "cpu" else (4096, 8192))
    return max((matmul_rate(device, dtype, n, min_seconds), n) for n in sizes)



def timed_steps(step, flops_per_step: float, device: torch.device, dtype: torch.dtype, peak_n: int, steps: int,
                peak_seconds: float) -> tuple[list[float], float, float]:
    """(seconds of each step, median matmul peak, median fraction of it) over ``steps`` calls of ``step``.

    Each timed step is paired with a matmul measurement right after it, so that a slow moment of
    a shared machine (another process, a VM's stolen time) lowers both and not just the step.
    """
    times, rates = [], []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
        rates.append(matmul_rate(device, dtype, peak_n, peak_seconds / 3))
    fraction = statistics.median(flops_per_step / t / rate for t, rate in zip(times, rates))
    return times, statistics.median(rates), fraction


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if args.tf32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    dtype = DTYPES[args.dtype]
    if dtype == torch.bfloat16 and not supports_bf16_matmul(device):
        print(f"error: --dtype bf16: this {device.type} has no native bf16 matmuls; use --dtype fp32", file=sys.stderr)
        return 2
    try:
        cfg = build_config(args.config, {"model_args": args.model_args} if args.model_args is not None else None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                  fused=True)
    mean = torch.tensor(cfg.model.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(cfg.model.std, device=device).view(1, -1, 1, 1)
    shape = (args.batch_size, cfg.model.in_chans, args.size, args.size)
    low_res = torch.randn(shape, device=device) * std + mean  # physical units, as the dataset gives
    high_res = F.interpolate(low_res, scale_factor=cfg.model.upscale, mode="bicubic", align_corners=False)

    def forward_backward():
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.l1_loss(model(low_res), high_res)
        loss.backward()

    def step():
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    peak_flops, peak_n = matmul_peak(device, dtype, args.peak_seconds, args.peak_sizes)
    with FlopCounterMode(display=False) as counter:
        forward_backward()
    optimizer.zero_grad(set_to_none=True)
    flops_per_step = counter.get_total_flops()
    flops_by_op = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}

    for _ in range(args.warmup):
        step()
    times, peak_flops, fraction = timed_steps(step, flops_per_step, device, dtype, peak_n, args.steps,
                                              args.peak_seconds)
    sec_per_step = statistics.median(times)
    if dtype == torch.bfloat16:
        bf16_peak = peak_flops
    else:
        bf16_peak = (matmul_peak(device, torch.bfloat16, args.peak_seconds, args.peak_sizes)[0]
                     if supports_bf16_matmul(device) else None)

    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    print(f"device: {name}{threads}; torch {torch.__version__}")
    print(f"model: config {args.config!r}, {count_parameters(model):,} parameters, "
          f"drop_path_rate {cfg.model.model_args['drop_path_rate']}; LR {args.size}x{args.size}, batch "
          f"{args.batch_size}, {args.dtype}")
    print(f"matmul peak {args.dtype}: {peak_flops / 1e9:.1f} GFLOP/s (n={peak_n}, median of the runs after each step)"
          + (f"; bf16: {bf16_peak / 1e9:.1f} GFLOP/s" if bf16_peak and dtype == torch.float32 else ""))
    print(f"model FLOPs per step: {flops_per_step / 1e9:.1f} GFLOP (forward + backward)")
    print(f"seconds per step: {sec_per_step:.4f} (median of {args.steps}; min {min(times):.4f}, max {max(times):.4f})")
    print(f"samples per second: {args.batch_size / sec_per_step:.2f}")
    print(f"achieved: {flops_per_step / sec_per_step / 1e9:.1f} GFLOP/s; {fraction:.3f} of the {args.dtype} matmul peak "
          "(median over steps of step FLOP/s / the matmul FLOP/s measured right after it)")
    ceiling, seconds_by_op = None, None
    if args.breakdown:
        seconds_by_op = seconds_in_ops(step, flops_by_op, device)
        ceiling = print_breakdown(flops_by_op, seconds_by_op, sec_per_step, peak_flops)
    roof = None
    if args.roofline:
        roof = roofline.roofline(flops_by_op, roofline.bytes_by_op(step), roofline.self_seconds_by_op(step, device),
                                  peak_flops, roofline.copy_bandwidth(device, 1 << (30 if device.type == "cuda" else 26)),
                                  sec_per_step)
        roofline.print_roofline(roof)
    print(json.dumps({
        "sec_per_step": sec_per_step, "flops_per_step": flops_per_step, "matmul_peak_flops": peak_flops,
        "fraction_of_peak": fraction, "sec_per_step_min": min(times), "samples_per_sec": args.batch_size / sec_per_step,
        "bf16_matmul_peak_flops": bf16_peak, "dtype": args.dtype, "device": name,
        "batch_size": args.batch_size, "size": args.size, "config": args.config,
        "fraction_ceiling": ceiling, "flops_by_op": flops_by_op, "seconds_by_op": seconds_by_op,
        "roofline": roof,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
