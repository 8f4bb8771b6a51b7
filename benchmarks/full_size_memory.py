"""Steps 1-2 figures: memory and step time of whole 720x1440 fields, fp32 vs bf16 vs bf16 + AC (block).

For the tutorial's SwinIR at batch 1 (low-res input 360x720, upscale 2), three settings:
fp32; bf16 autocast; bf16 autocast + activation checkpointing per Swin block. It prints

1. activations held for backward at full size, estimated (utils/memory/estimate.py) and measured by up to
   three methods that never hold the fp32 activations (~100 GB) at once:
   - traced: one forward under FakeTensorMode (the real dispatch, no data, no memory);
   - forward: a real forward pass whose saved tensors are counted and dropped at once
     (SavedTensorBytes(hold=False)); --no_full_forward skips it (minutes on a laptop CPU);
   - ladder: real forwards on smaller fields, to show bytes per pixel are constant, extrapolated;
2. one measured training step on a reduced field (--step_size, default 48x96 low-res) per setting:
   peak memory (predicted vs measured) and seconds per step (median of --steps, in --repeats
   rounds over all settings because other processes may share the CPU), and ratios to fp32;
3. the estimate on the GPU path (SDPA's memory-efficient kernel, LayerNorm in fp32 under autocast): measured on an
   H200;
4. a PNG of memory by category for the three settings (default docs/memory_by_category.png).

    python benchmarks/full_size_memory.py --no_full_forward      # ~15 min on 2 busy cores
    python benchmarks/full_size_memory.py                        # + real full-size forwards (~20 TFLOP more)
    python benchmarks/full_size_memory.py --estimate_only        # seconds: estimate, traces, the PNG

Part II, ``--model vit``: the ViT forecaster on whole 360x720 fields (20 channels, patch 8, 4050
tokens), vit_base (23.8M) and vit_mp (350.1M) at 16 samples per GPU (NERSC's 64 over 4-way data
parallelism), fp32 / bf16 / bf16 + AC block: the activations estimated vs traced under
FakeTensorMode (CPU path: nothing is computed, the parameters are allocated but not initialised),
then the estimate on the GPU path for one GPU (batch 16 and vit_mp's whole batch of 64) against
40 and 80 GB. Seconds, and ~1.5 GB of memory for vit_mp's parameters; no PNG.

    python benchmarks/full_size_memory.py --model vit

``--measure`` runs real training steps on one device instead (a GPU: tests/gpu_check.py): per setting the
measured peak (``torch.cuda.max_memory_allocated`` over a step, parameters and AdamW state included) next to the
estimate of that device's path, and the seconds per step. SwinIR: the whole field in bf16 + AC, bf16 and fp32
(fp32 also at half the height and width where the estimate exceeds the GPU: the whole field then runs out of
memory, which is recorded), and first predict.py's forward of the whole field alone in bf16 and fp32 (inference:
nothing kept for a backward; the estimate is predict.py's, traced); the ViT (vit_mp, 16 samples): bf16 with and
without AC. One JSON line per setting as
it completes; arguments after ``--`` override config keys (the CPU dry run's tiny models).

    python benchmarks/full_size_memory.py --measure --device cuda
    python benchmarks/full_size_memory.py --measure --device cuda --model vit

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from utils.checkpoint.files import replaced_atomically, reporting_write_failures  # noqa: E402
from utils.config import build_config  # noqa: E402
from utils.memory.estimate import GB, estimate_memory  # noqa: E402
from utils.memory.measure import (build_for_measurement, loss_for, measure_config, measure_peak,  # noqa: E402
                                  measure_saved_activations, measure_training_memory, random_batch,
                                  time_training_step, trace_saved_activations)
from utils.memory.shapes import input_size  # noqa: E402
from utils.memory.traced import trace_inference  # noqa: E402
from utils.precision import autocast  # noqa: E402
from utils.training import run_cli

SETTINGS = {"fp32": dict(amp_dtype="none", ac="none"), "bf16": dict(amp_dtype="bf16", ac="none"),
            "bf16 + AC block": dict(amp_dtype="bf16", ac="block")}
FULL = (360, 720)  # low-res input of a 720 x 1440 field at upscale 2
LADDER = [(48, 96), (96, 192), (192, 384)]
REPO = Path(__file__).resolve().parent.parent


def size(text: str) -> tuple[int, int]:
    height, width = (int(v) for v in text.lower().split("x"))
    return height, width


def config(setting: str, device: str = "cpu", name: str = "full_size", overrides: Optional[dict] = None):
    # Stochastic depth off: the step is the same computation in every run (it changes no memory term).
    return build_config(name, {**SETTINGS[setting], "device": device, "model_args.drop_path_rate": 0.0,
                               **(overrides or {})})


def measure_full_size_activations(args) -> dict:
    """Activations of a full-size forward by each method (bytes), per setting."""
    results = {}
    for setting in SETTINGS:
        cfg = config(setting)
        model = build_for_measurement(cfg)
        row = {"estimate": estimate_memory(cfg, lr_size=FULL, device_type="cpu").activations}
        start = time.perf_counter()
        row["traced"] = trace_saved_activations(model, (1, 3, *FULL), cfg.train.amp_dtype).bytes
        row["traced_seconds"] = time.perf_counter() - start
        if setting == "fp32" and not args.estimate_only:
            per_pixel = []
            for lr_size in LADDER:
                lr, hr = random_batch(cfg, lr_size, batch=1)
                saved = measure_saved_activations(model, lr, hr, cfg.train.amp_dtype, hold=False).bytes
                per_pixel.append(saved / (lr_size[0] * lr_size[1]))
                print(f"  ladder {lr_size[0]}x{lr_size[1]}: {saved / GB:.3f} GB saved, "
                      f"{per_pixel[-1]:.0f} bytes per low-res pixel", flush=True)
            row["ladder_bytes_per_pixel"] = per_pixel
            row["ladder_extrapolated"] = per_pixel[-1] * FULL[0] * FULL[1]
        if args.full_forward:
            lr, hr = random_batch(cfg, FULL, batch=1)
            start = time.perf_counter()
            row["forward"] = measure_saved_activations(model, lr, hr, cfg.train.amp_dtype, hold=False).bytes
            row["forward_seconds"] = time.perf_counter() - start
        results[setting] = row
        shown = {k: (f"{v / GB:.2f} GB" if k in ("estimate", "traced", "forward", "ladder_extrapolated") else v)
                 for k, v in row.items() if k != "ladder_bytes_per_pixel"}
        print(f"  {setting}: {shown}", flush=True)
    return results


def measure_steps(args) -> dict:
    """Peak memory and seconds per step on a reduced field, per setting.

    The timing goes round-robin over the settings, ``repeats`` times, so that each round sees about
    the same load from other processes; ratios to fp32 are taken within a round, then the median.
    """
    results, models = {}, {}
    for setting in SETTINGS:
        cfg = config(setting)
        estimate = estimate_memory(cfg, lr_size=args.step_size, device_type="cpu")
        measured = measure_config(cfg, args.step_size)
        results[setting] = {
            "peak_predicted_gb": estimate.total / GB, "peak_measured_gb": measured.peak / GB,
            "activations_predicted_gb": estimate.activations / GB, "activations_measured_gb": measured.activations / GB,
            "seconds_per_step_rounds": [],
        }
        models[setting] = build_for_measurement(cfg), cfg.train.amp_dtype
    lr, hr = random_batch(config("fp32"), args.step_size, batch=1)
    for round_index in range(args.repeats):
        for setting, (model, amp_dtype) in models.items():
            seconds = statistics.median(time_training_step(model, lr, hr, amp_dtype, steps=args.steps))
            results[setting]["seconds_per_step_rounds"].append(seconds)
        print(f"  round {round_index + 1}: " + ", ".join(
            f"{n} {r['seconds_per_step_rounds'][-1]:.2f} s" for n, r in results.items()), flush=True)
    fp32 = results["fp32"]
    for setting, row in results.items():
        row["seconds_per_step"] = min(row["seconds_per_step_rounds"])
        row["time_vs_fp32"] = statistics.median(
            t / f for t, f in zip(row["seconds_per_step_rounds"], fp32["seconds_per_step_rounds"]))
        row["activations_vs_fp32"] = row["activations_measured_gb"] / fp32["activations_measured_gb"]
        print(f"  {setting}: {row}", flush=True)
    return results


def plot(estimates: dict, measured: dict, path: Path) -> None:
    """Stacked bars of memory by category per setting: this CPU (with measurements) and a GPU (modelled)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = [  # (label, colour, function of an estimate -> bytes)
        ("parameters + gradients + AdamW state", "#4c72b0", lambda e: e.params + e.grads + e.optimizer),
        ("activations: Swin blocks", "#dd8452", lambda e: e.activations_by_part["swin_blocks"]),
        ("activations: convs, upsampler, loss, casts", "#c8a26b",
         lambda e: e.activations - e.activations_by_part["swin_blocks"]),
        ("temporary peak in backward", "#8c8c8c", lambda e: e.temporary),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.8), sharey=True)
    names = list(SETTINGS)
    for ax, device in zip(axes, ("cpu", "cuda")):
        bottoms = [0.0] * len(names)
        for label, colour, value in categories:
            heights = [value(estimates[device][n]) / GB for n in names]
            ax.bar(names, heights, bottom=bottoms, color=colour, label=label, width=0.6)
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        for i, (name, total) in enumerate(zip(names, bottoms)):
            activations = estimates[device][name].activations / GB
            ax.text(i, total + 1.5, f"{total:.1f} GB\n(activations {activations:.1f})", ha="center", fontsize=9)
        ax.axhline(80, color="#c44e52", linestyle="--", linewidth=1)
        ax.text(len(names) - 0.7, 82, "80 GB GPU", color="#c44e52", ha="center", fontsize=9)
        if device == "cpu":
            method = "forward" if all("forward" in measured[n] for n in names) else "traced"
            points = [measured[n][method] / GB for n in names]
            how = {"forward": "real forward", "traced": "FakeTensor trace"}[method]
            ax.scatter(names, points, marker="_", s=900, color="black", zorder=3,
                       label=f"activations measured at full size ({how})")
            ax.set_title("This CPU: explicit window attention\n(estimate; activations measured)", fontsize=10)
        else:
            ax.set_title("A GPU: SDPA's memory-efficient kernel, LayerNorm in fp32\n"
                         "(modelled; an H200 measured each peak within 0.5 %)", fontsize=10)
        ax.set_xlabel("autocast dtype + activation checkpointing")
    axes[0].set_ylabel("GB per training step (peak)")
    axes[0].set_ylim(0, max(bottoms) * 1.3 + 5)
    fig.suptitle("SwinIR (11.75M parameters), one 720×1440 field, batch 1: training memory by category", fontsize=11)
    handles, labels = axes[0].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i].startswith("activations measured"))
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="lower center", ncol=3, fontsize=9,
               frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    # A full disk: one line, exit 4, no partial picture.
    with reporting_write_failures("plot", path, hint="free space or choose another --png path"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(path) as temporary:
            fig.savefig(temporary, dpi=130, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)


VIT_CONFIGS = ("vit_base", "vit_mp")
VIT_BATCH_PER_GPU = 16  # NERSC: global batch 64 over 4-way data parallelism


def vit_config(name: str, setting: str, device: str = "cpu", batch: int = VIT_BATCH_PER_GPU,
               overrides: Optional[dict] = None):
    return build_config(name, {**SETTINGS[setting], "device": device, "batch_size": batch, **(overrides or {})})


def vit_full_size(args) -> dict:
    """Part II: the ViT's activations at full size, estimated and traced, and the GPU estimates."""
    import dataclasses

    from models import build_model
    from utils.parallel.techniques import apply_ac

    print(f"threads {torch.get_num_threads()}; GB = 1e9 bytes")
    print(f"1. ViT activations at full size (360x720, 20 channels), batch {VIT_BATCH_PER_GPU}, CPU path: "
          "estimate vs FakeTensor trace")
    traced = {}
    for name in VIT_CONFIGS:
        base = vit_config(name, "fp32")
        m = base.model
        model_cfg = dataclasses.replace(m, mean=[0.0] * m.in_chans, std=[1.0] * m.in_chans)  # no data: any stats
        with torch.device("meta"):  # shapes first: vit_mp's 350M parameters need no initialisation here
            plain = build_model(model_cfg)
        plain = plain.to_empty(device="cpu")
        for setting in SETTINGS:  # AC comes last: once applied, it stays
            cfg = vit_config(name, setting)
            model = apply_ac(plain, cfg.train.ac)
            shape = (VIT_BATCH_PER_GPU, m.in_chans, *m.img_size)
            start = time.perf_counter()
            saved = trace_saved_activations(model, shape, cfg.train.amp_dtype, loss_for(cfg)).bytes
            estimate = estimate_memory(cfg, device_type="cpu").activations
            traced[f"{name} {setting}"] = {"estimate": estimate / GB, "traced": saved / GB,
                                           "seconds": time.perf_counter() - start}
            print(f"  {name:8s} {setting:16s} estimate {estimate / GB:8.3f} GB, traced {saved / GB:8.3f} GB "
                  f"({'equal' if estimate == saved else f'{(estimate - saved) / saved:+.2%}'}), "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    print("2. GPU path (modelled), GB per GPU: params+grads+optimizer | activations | temporary | total | fits 40/80 GB")
    gpu = {}
    for name, batch in (("vit_base", 16), ("vit_mp", 16), ("vit_mp", 64)):
        for setting in SETTINGS:
            e = estimate_memory(vit_config(name, setting, "cuda", batch), device_type="cuda")
            gpu[f"{name} batch {batch} {setting}"] = e.to_json()
            fits = "/".join("yes" if e.total <= size * GB else "no" for size in (40, 80))
            print(f"  {name:8s} batch {batch:2d} {setting:16s} {(e.params + e.grads + e.optimizer) / GB:7.2f} "
                  f"{e.activations / GB:8.2f} {e.temporary / GB:6.2f} {e.total / GB:8.2f}  {fits}  ({e.setting['attention']})")
    summary = {"vit_activations_full_size_gb": traced, "vit_estimate_gpu": gpu, "threads": torch.get_num_threads()}
    print(json.dumps(summary))
    return 0


def measured_cases(args, device: torch.device, overrides: dict) -> list[tuple[str, object, Optional[tuple]]]:
    """(setting, config, low-res size or None for the model's own) of each --measure run, cheapest first: a run
    that runs out of memory (fp32's whole field on an 80 GB GPU) comes last."""
    if args.model == "vit":
        name = args.config or "vit_mp"
        return [(s, vit_config(name, s, device.type, args.batch, overrides), None) for s in ("bf16 + AC block", "bf16")]
    name, field = args.config or "full_size", args.lr_size
    cases = [(s, config(s, device.type, name, overrides), field) for s in ("bf16 + AC block", "bf16", "fp32")]
    fp32 = cases[-1][1]
    if device.type == "cuda" and estimate_memory(fp32, lr_size=field, device_type="cuda").total > \
            torch.cuda.get_device_properties(device).total_memory:
        cases.insert(2, ("fp32", fp32, (field[0] // 2, field[1] // 2)))
    return cases


def measure_case(cfg, lr_size, device: torch.device, steps: int) -> dict:
    """One setting on ``device``: the estimate, the measured step (peak, activations) and its seconds."""
    estimate = estimate_memory(cfg, lr_size=lr_size, device_type=device.type)
    row = {"input": list(lr_size or input_size(cfg)), "batch": cfg.train.batch_size,
           "estimate_gb": estimate.total / GB, "estimate_activations_gb": estimate.activations / GB}
    try:
        model = build_for_measurement(cfg, device)
        lr, hr = random_batch(cfg, lr_size, device)
        measured = measure_training_memory(model, lr, hr, cfg.train.amp_dtype, loss_for(cfg))
        row.update(measured_peak_gb=measured.peak / GB, measured_activations_gb=measured.activations / GB,
                   estimate_error=(estimate.total - measured.peak) / measured.peak, method=measured.method)
        times = time_training_step(model, lr, hr, cfg.train.amp_dtype, loss_for(cfg), steps=steps)
        row["seconds_per_step"] = statistics.median(times)
    except torch.OutOfMemoryError as error:  # recorded: the estimate said whether it would fit
        row.update(oom=True, error=str(error).splitlines()[0][:200])
    return row


def measure_inference_case(cfg, lr_size, device: torch.device, steps: int) -> dict:
    """predict.py's forward of the whole field (no_grad, autocast, nothing kept for a backward): the estimate it
    prints (trace_inference, on fake tensors) against the measured peak, parameters and input included."""
    model = build_for_measurement(cfg, device).eval()
    lr, _ = random_batch(cfg, lr_size, device)

    def forward(call, x):
        with autocast(x.device, cfg.train.amp_dtype):
            return call(x).float()

    estimate = trace_inference(model, forward, tuple(lr.shape), device)
    row = {"input": list(lr.shape[-2:]), "batch": lr.shape[0], "estimate_gb": estimate / GB}
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers(), lr])
    try:
        with torch.no_grad():
            forward(model, lr)  # the model's caches (shift masks), as the traced forward makes them
            peak = measure_peak(lambda: forward(model, lr), device) + held
            times = []
            for _ in range(steps):
                started = time.perf_counter()
                forward(model, lr)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                times.append(time.perf_counter() - started)
        row.update(measured_peak_gb=peak / GB, estimate_error=(estimate - peak) / peak,
                   seconds_per_step=statistics.median(times))
    except torch.OutOfMemoryError as error:
        row.update(oom=True, error=str(error).splitlines()[0][:200])
    return row


def measure_on_device(args) -> int:
    """--measure: one JSON line per setting, then a summary line."""
    device = torch.device(args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu")
    if args.overrides and (len(args.overrides) % 2 or not all(k.startswith("--") for k in args.overrides[::2])):
        raise SystemExit(f"error: after -- come config keys and values (--key value ...), got {args.overrides}")
    overrides = {key[2:]: value for key, value in zip(args.overrides[::2], args.overrides[1::2])}
    rows = []
    cases = measured_cases(args, device, overrides)
    if args.model == "swinir":  # predict.py's whole field: cheapest of all, so first
        cases = [(f"inference {s}", config(s, device.type, cases[0][1].name, overrides), args.lr_size)
                 for s in ("bf16", "fp32")] + cases
    for setting, cfg, lr_size in cases:
        measure = measure_inference_case if setting.startswith("inference") else measure_case
        row = {"setting": setting, "model": args.model, "config": cfg.name, "device": str(device),
               **measure(cfg, lr_size, device, args.steps)}
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next setting starts from an empty allocator
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"measured": rows, "threads": torch.get_num_threads()}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["swinir", "vit"], default="swinir",
                        help="swinir: Part I (the default); vit: Part II's forecaster (estimate and traces only)")
    parser.add_argument("--step_size", type=size, default=(48, 96), metavar="HxW",
                        help="low-res size of the timed training steps")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per repeat (after one warm-up)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of timing over all settings (ratios: median over rounds)")
    parser.add_argument("--no_full_forward", dest="full_forward", action="store_false",
                        help="skip the real full-size forward passes (the slowest part)")
    parser.add_argument("--estimate_only", action="store_true",
                        help="only the estimate, the FakeTensor traces and the PNG (seconds): no real runs")
    parser.add_argument("--png", default=str(REPO / "docs" / "memory_by_category.png"))
    parser.add_argument("--measure", action="store_true",
                        help="real training steps on --device: measured peak vs the estimate, seconds per step")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="--measure's device")
    parser.add_argument("--config", default=None,
                        help="--measure's config (default: full_size; vit_mp for --model vit)")
    parser.add_argument("--lr_size", type=size, default=FULL, metavar="HxW", help="--measure's SwinIR low-res input")
    parser.add_argument("--batch", type=int, default=VIT_BATCH_PER_GPU, help="--measure's ViT batch")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="--measure: -- then config keys and values")
    args = parser.parse_args(argv)
    args.overrides = [a for a in args.overrides if a != "--"]
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here")
    if args.overrides and not args.measure:
        parser.error("config overrides after -- are for --measure only")
    if args.measure:
        return measure_on_device(args)
    if args.model == "vit":
        return vit_full_size(args)
    if args.estimate_only:
        args.full_forward = False
    torch.manual_seed(0)

    print(f"threads {torch.get_num_threads()}; GB = 1e9 bytes")
    print("1. activations at full size (low-res 360x720, batch 1), CPU path")
    activations = measure_full_size_activations(args)
    steps = {}
    if not args.estimate_only:
        print(f"2. one training step at low-res {args.step_size[0]}x{args.step_size[1]}, batch 1")
        steps = measure_steps(args)
    estimates = {device: {n: estimate_memory(config(n, device), lr_size=FULL, device_type=device) for n in SETTINGS}
                 for device in ("cpu", "cuda")}
    print("3. estimate at full size (GB): setting | device | params+grads+optimizer | activations | temporary | total")
    for device, rows in estimates.items():
        for name, e in rows.items():
            print(f"  {name:16s} {device:4s} {(e.params + e.grads + e.optimizer) / GB:8.3f} {e.activations / GB:9.2f} "
                  f"{e.temporary / GB:8.2f} {e.total / GB:8.2f}")
    plot(estimates, activations, Path(args.png))
    print(f"4. wrote {args.png}")

    fp32, best = activations["fp32"], activations["bf16 + AC block"]
    measured_key = "forward" if args.full_forward else "traced"
    ratio = fp32[measured_key] / best[measured_key]
    time_ratio = steps["bf16 + AC block"]["time_vs_fp32"] if steps else None
    timing = f" at {time_ratio:.2f}x the fp32 step time (target <= 1.5x) on this CPU" if steps else ""
    print(f"bf16 + AC block holds {ratio:.1f}x less activation memory than fp32 (target >= 5x){timing}")
    summary = {
        "activations_full_size": {n: {k: (v / GB if k in ("estimate", "traced", "forward", "ladder_extrapolated") else v)
                                      for k, v in row.items()} for n, row in activations.items()},
        "step": {"lr_size": list(args.step_size), **steps},
        "estimate_full_size_gb": {d: {n: e.to_json() for n, e in rows.items()} for d, rows in estimates.items()},
        "activation_ratio_fp32_vs_bf16_ac": ratio, "step_time_ratio_bf16_ac_vs_fp32": time_ratio,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    run_cli(main)  # a full disk at the PNG: one line, exit 4
