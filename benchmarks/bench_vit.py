"""Time one training step of the ViT forecaster on a reduced field; its FLOP rate and peak memory.

Part II's counterpart of bench_model.py, with its matmul-peak and device helpers: a step is
forward (under autocast for bf16) + the config's loss (vit_short: NERSC's relative L2 on
normalised fields, utils.training.build_loss) + backward + fused AdamW step, on random fields in
physical units. By default vit_short's model (embed 384, depth 12, 8 heads, patch 8, 20 channels)
on a 96x192 field (12x24 = 288 tokens instead of NERSC's 45x90 = 4050), batch 1: 43 GFLOP per
step, where NERSC's whole field needs 1.59 TFLOP per sample (FlopCounterMode under FakeTensorMode;
attention, quadratic in the tokens, is then 66 % of it, at 288 tokens 12 %).

It prints seconds per step (median of --steps after --warmup, the first of which counts the FLOPs
with FlopCounterMode), samples/s, the fraction of the matmul peak (paired per step as in
bench_model.py: step FLOP/s / the matmul FLOP/s measured right after that step), and the peak
memory of one more measured step (utils.memory.measure.measure_training_memory: CPU allocation trace or
CUDA allocator) next to estimate_memory.py's prediction for the same setting.

    python benchmarks/bench_vit.py                          # fp32
    python benchmarks/bench_vit.py --dtype bf16             # bf16 autocast
    python benchmarks/bench_vit.py --field 176x352 --batch_size 2
    python benchmarks/bench_vit.py --embed_dim 64 --depth 2 --num_heads 4 --field 32x64 --patch_size 4 \\
        --steps 1 --warmup 1 --peak_seconds 0.01          # tiny: seconds, mostly the matmul peak
    python benchmarks/bench_vit.py --threads 1 --steps 10   # steadier on a shared VM (benchmarks/README.md)

bf16 on a CPU without native bf16 matmuls (AVX2 only) runs, emulated and slowly; its fraction is
then given against the fp32 matmul peak only (a bf16 "peak" of square matmuls there takes minutes).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import DTYPES, cpu_description, matmul_peak, supports_bf16_matmul, timed_steps  # noqa: E402

from models import count_parameters  # noqa: E402
from utils.config import ConfigError, build_config  # noqa: E402
from utils.memory.estimate import GB, estimate_memory  # noqa: E402
from utils.memory.measure import build_for_measurement, loss_for, measure_training_memory, random_batch  # noqa: E402
from utils.precision import autocast


def field(text: str) -> list[int]:
    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not HEIGHTxWIDTH, e.g. 96x192") from None
    return [height, width]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default="vit_short", help="named ViT config whose model and loss are timed")
    parser.add_argument("--field", type=field, default=[96, 192], metavar="HxW", help="field size (the ViT's img_size)")
    parser.add_argument("--patch_size", type=int, default=None, help="default: the config's")
    parser.add_argument("--embed_dim", type=int, default=None, help="default: the config's")
    parser.add_argument("--depth", type=int, default=None, help="default: the config's")
    parser.add_argument("--num_heads", type=int, default=None, help="default: the config's")
    parser.add_argument("--batch_size", type=int, default=1, help="samples per step")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (the median is reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first counts FLOPs)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="bf16 runs the forward under autocast")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads (0 = torch's default); on a shared VM 1 thread is steadier, see benchmarks/README.md")
    parser.add_argument("--peak_seconds", type=float, default=0.3, help="time spent per matmul size for the peak")
    parser.add_argument("--no_memory", dest="memory", action="store_false",
                        help="skip the measured-memory step (two more steps)")
    args = parser.parse_args(argv)
    for name in ("batch_size", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.threads < 0:
        parser.error(f"--warmup and --threads must be >= 0, got {args.warmup} and {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here (use --device cpu)")
    return args


def build(args, device: torch.device):
    overrides = {"img_size": args.field, "batch_size": args.batch_size, "device": device.type,
                 "amp_dtype": "none" if args.dtype == "fp32" else args.dtype, "model_args.drop_path_rate": 0.0}
    for key, value in (("patch_size", args.patch_size), ("embed_dim", args.embed_dim),
                       ("depths", args.depth and [args.depth]), ("num_heads", args.num_heads and [args.num_heads])):
        if value:
            overrides[f"model_args.{key}"] = value
    cfg = build_config(args.config, overrides)
    if cfg.model.model != "vit":
        raise ConfigError(f"config {args.config!r} is not a ViT config (model: {cfg.model.model}); "
                          "use benchmarks/bench_model.py for SwinIR")
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # the matmul peak is measured with the same threads
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    try:
        cfg = build(args, device)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    native = dtype == torch.float32 or supports_bf16_matmul(device)
    amp = cfg.train.amp_dtype

    model = build_for_measurement(cfg, device)  # mean/std 0 and 1 when the config takes them from the data
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=tuple(cfg.train.betas),
                                  weight_decay=cfg.train.weight_decay, fused=True)
    inputs, target = random_batch(cfg, device=device)
    loss_fn = loss_for(cfg)

    def forward_backward():
        with autocast(device, amp):
            pred = model(inputs)
        loss_fn(pred.float(), target).backward()  # the loss in fp32, as train.py

    def step():
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # The matmul peak of the run's dtype; without native bf16 only fp32's (see the docstring).
    peak_dtype = dtype if native else torch.float32
    fp32_peak, peak_n = matmul_peak(device, torch.float32, args.peak_seconds)
    if peak_dtype != torch.float32:
        peak_n = matmul_peak(device, peak_dtype, args.peak_seconds)[1]

    with FlopCounterMode(display=False) as counter:  # the first warm-up step, or an extra untimed one
        step()
    flops_per_step = counter.get_total_flops()
    for _ in range(max(args.warmup - 1, 0)):
        step()
    times, peak_flops, fraction = timed_steps(step, flops_per_step, device, peak_dtype, peak_n, args.steps,
                                              args.peak_seconds)
    sec_per_step = statistics.median(times)

    memory = None
    if args.memory:
        measured = measure_training_memory(model, inputs, target, amp, loss_fn, optimizer)
        predicted = estimate_memory(cfg, device_type=device.type)
        memory = {"peak_measured_gb": measured.peak / GB, "peak_estimated_gb": predicted.total / GB,
                  "activations_measured_gb": measured.activations / GB,
                  "activations_estimated_gb": predicted.activations / GB, "method": measured.method}

    shape = cfg.model
    tokens = (shape.img_size[0] // shape.patch_size) * (shape.img_size[1] // shape.patch_size)
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    print(f"device: {name}{threads}; torch {torch.__version__}")
    print(f"model: config {args.config!r}, {count_parameters(model):,} parameters (embed {shape.embed_dim}, depth "
          f"{shape.depths[0]}, {shape.num_heads[0]} heads, patch {shape.patch_size}); field {shape.img_size[0]}x"
          f"{shape.img_size[1]} x {shape.in_chans} channels = {tokens} tokens, batch {args.batch_size}, {args.dtype}; "
          f"loss {cfg.train.loss} ({cfg.train.loss_space})")
    label = args.dtype if native else "fp32 (no native bf16 matmuls here: bf16 is emulated)"
    print(f"matmul peak {label}: {peak_flops / 1e9:.1f} GFLOP/s (n={peak_n}, median of the runs after each step)")
    print(f"model FLOPs per step: {flops_per_step / 1e9:.2f} GFLOP (forward + backward)")
    print(f"seconds per step: {sec_per_step:.4f} (median of {args.steps}; min {min(times):.4f}, max {max(times):.4f})")
    print(f"samples per second: {args.batch_size / sec_per_step:.3f}")
    print(f"achieved: {flops_per_step / sec_per_step / 1e9:.1f} GFLOP/s; {fraction:.3f} of the {label.split()[0]} "
          "matmul peak (median over steps of step FLOP/s / the matmul FLOP/s measured right after it)")
    if memory:
        print(f"peak memory of a step: {memory['peak_measured_gb'] * 1e3:.1f} MB measured ({memory['method']}), "
              f"{memory['peak_estimated_gb'] * 1e3:.1f} MB estimated (estimate_memory.py); activations "
              f"{memory['activations_measured_gb'] * 1e3:.2f} MB measured, {memory['activations_estimated_gb'] * 1e3:.2f} "
              "MB estimated; MB = 1e6 bytes")
    print(json.dumps({
        "sec_per_step": sec_per_step, "sec_per_step_min": min(times), "samples_per_sec": args.batch_size / sec_per_step,
        "flops_per_step": flops_per_step, "matmul_peak_flops": peak_flops, "fp32_matmul_peak_flops": fp32_peak,
        "fraction_of_peak": fraction, "peak_dtype": str(peak_dtype).removeprefix("torch."), "dtype": args.dtype,
        "native_bf16": native if dtype == torch.bfloat16 else None, "device": name, "config": args.config,
        "field": shape.img_size, "patch_size": shape.patch_size, "tokens": tokens, "batch_size": args.batch_size,
        "num_params": count_parameters(model), "memory": memory, "threads": torch.get_num_threads(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
