"""Predicted vs measured training memory on a grid of small SwinIR and ViT configs (utils/memory/estimate.py).

For each case the estimate (estimate_memory.py's numbers) is compared with a real training step:
activations = bytes saved for backward (saved_tensors_hooks, one count per storage), and the peak
= parameters + AdamW state + the rise of allocated memory during the step (CUDA: allocator
statistics; CPU: the profiler's allocation trace). The grid varies input size (with and without
padding), batch, activation checkpointing (none/block/layer), dtype (fp32/bf16), upsampler,
residual connection and loss, on small models and on the tutorial's 11.75M SwinIR; for the ViT
forecaster (its input is always the whole img_size field): size, patch, batch, AC (none/block),
dtype (fp32/bf16/fp16), loss (NERSC's relative L2 on normalised fields, MSE), stochastic depth, and
vit_short's width (embed 384, 8 heads) at a reduced field.

    python benchmarks/validate_memory_estimate.py                  # this machine's device
    python benchmarks/validate_memory_estimate.py --device cpu --quick
    python benchmarks/validate_memory_estimate.py --model vit      # only the ViT rows
    python benchmarks/validate_memory_estimate.py --json           # one JSON object per case, then a summary

Exit status 1 if an activation prediction is off by more than --tolerance (default 15 %).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from utils.config import build_config  # noqa: E402
from utils.memory.estimate import GB, estimate_memory  # noqa: E402
from utils.memory.measure import measure_config  # noqa: E402

# A small SwinIR with the tutorial's structure (window 8, MLP ratio 2) that steps in about a second.
SMALL = {"model_args": {"embed_dim": 48, "depths": [2, 2], "num_heads": [6, 6], "drop_path_rate": 0.1}, "img_size": 32}
TUTORIAL = {"model_args": {"embed_dim": 180, "depths": [6] * 6, "num_heads": [6] * 6, "mlp_ratio": 2.0,
                           "drop_path_rate": 0.1}, "img_size": 64}

# (name, model, overrides, low-res input size); batch_size is per step (one rank).
GRID = [
    ("fp32", SMALL, dict(batch_size=2), (32, 64)),
    ("fp32 AC block", SMALL, dict(batch_size=2, ac="block"), (32, 64)),
    ("fp32 AC layer, padded", SMALL, dict(batch_size=3, ac="layer"), (36, 60)),
    ("bf16", SMALL, dict(batch_size=1, amp_dtype="bf16"), (48, 48)),
    ("bf16 AC block", SMALL, dict(batch_size=2, amp_dtype="bf16", ac="block"), (32, 64)),
    ("bf16 AC layer, x4", SMALL, dict(batch_size=1, amp_dtype="bf16", ac="layer", upscale=4), (24, 40)),
    ("bf16, 3conv, nearest+conv, MSE", SMALL,
     {"batch_size": 2, "amp_dtype": "bf16", "model_args.resi_connection": "3conv",
      "model_args.upsampler": "nearest+conv", "loss": "mse"}, (20, 44)),
    ("fp32, pixelshuffledirect x3", SMALL, {"batch_size": 1, "model_args.upsampler": "pixelshuffledirect",
                                            "upscale": 3}, (40, 24)),
    ("tutorial model bf16 AC block", TUTORIAL, dict(batch_size=1, amp_dtype="bf16", ac="block"), (24, 32)),
    ("tutorial model fp32", TUTORIAL, dict(batch_size=1), (16, 24)),
]

# The ViT forecaster: 20 channels like NERSC's data; relative L2 on normalised fields unless said.
VIT_SMALL = {"model": "vit", "in_chans": 20, "img_size": [32, 64],
             "model_args": {"patch_size": 4, "embed_dim": 64, "depths": [2], "num_heads": [4], "drop_path_rate": 0.0}}
VIT_SHORT_REDUCED = {"model": "vit", "in_chans": 20, "img_size": [90, 180],  # vit_short's width, 2 of its 12 blocks
                     "model_args": {"patch_size": 6, "embed_dim": 384, "depths": [2], "num_heads": [8],
                                    "drop_path_rate": 0.0}}
VIT_GRID = [
    ("ViT fp32", VIT_SMALL, dict(batch_size=2), None),
    ("ViT bf16", VIT_SMALL, dict(batch_size=2, amp_dtype="bf16"), None),
    ("ViT fp32 AC block", VIT_SMALL, dict(batch_size=2, ac="block"), None),
    ("ViT bf16 AC block", VIT_SMALL, dict(batch_size=2, amp_dtype="bf16", ac="block"), None),
    ("ViT bf16 64x128 p8, MSE, drop path", {**VIT_SMALL, "img_size": [64, 128], "model_args.patch_size": 8,
                                            "model_args.depths": [3]},
     {"batch_size": 3, "amp_dtype": "bf16", "loss": "mse", "loss_space": "physical",
      "model_args.drop_path_rate": 0.1}, None),
    ("ViT fp16 AC block", VIT_SMALL, dict(batch_size=1, amp_dtype="fp16", ac="block"), None),
    ("ViT width 384, 90x180 p6, fp32", VIT_SHORT_REDUCED, dict(batch_size=1), None),
    ("ViT width 384, 90x180 p6, bf16", VIT_SHORT_REDUCED, dict(batch_size=2, amp_dtype="bf16"), None),
]
QUICK = GRID[:6] + VIT_GRID[:4]


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def run_case(name, model, overrides, lr_size, device: torch.device) -> dict:
    """One row; ``lr_size`` None = the model's own input size (the ViT's img_size)."""
    base = "vit_quickstart" if model.get("model") == "vit" else "quickstart"
    cfg = build_config(base, {**model, **overrides, "device": device.type, "crop_size": 0})
    estimate = estimate_memory(cfg, lr_size=lr_size, device_type=device.type)
    start = time.perf_counter()
    measured = measure_config(cfg, lr_size, device)
    return {
        "case": name, "model": estimate.setting["model"], "lr_size": estimate.setting["lr_input"],
        "batch": cfg.train.batch_size, "amp_dtype": cfg.train.amp_dtype,
        "ac": cfg.train.ac, "params": estimate.setting["num_params"],
        "activations_predicted_gb": estimate.activations / GB, "activations_measured_gb": measured.activations / GB,
        "activations_error": relative_error(estimate.activations, measured.activations),
        "peak_predicted_gb": estimate.total / GB, "peak_measured_gb": measured.peak / GB,
        "peak_error": relative_error(estimate.total, measured.peak),
        "params_exact": estimate.params == measured.params and estimate.optimizer == measured.optimizer,
        "grads_exact": estimate.grads == measured.grads,
        "peak_method": measured.method, "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} cases (small models)")
    parser.add_argument("--model", choices=["all", "swinir", "vit"], default="all", help="which model's rows")
    parser.add_argument("--tolerance", type=float, default=0.15, help="largest accepted relative activation error")
    parser.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda requested but CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if not args.json:
        print(f"device {device}; activations = bytes saved for backward; peak = params + optimizer + rise "
              "during one step; MB = 1e6 bytes")
        print(f"{'case':34s} {'input':>8s} {'b':>2s} | {'act pred':>9s} {'measured':>9s} {'error':>7s} | "
              f"{'peak pred':>9s} {'measured':>9s} {'error':>7s}")
    results = []
    cases = QUICK if args.quick else GRID + VIT_GRID
    cases = [c for c in cases if args.model in ("all", "vit" if c[1].get("model") == "vit" else "swinir")]
    for case in cases:
        r = run_case(*case, device)
        results.append(r)
        if args.json:
            print(json.dumps(r))
        else:
            size = "x".join(map(str, r["lr_size"]))
            print(f"{r['case']:34s} {size:>8s} {r['batch']:>2d} | {r['activations_predicted_gb'] * 1e3:9.2f} "
                  f"{r['activations_measured_gb'] * 1e3:9.2f} {r['activations_error']:+7.1%} | "
                  f"{r['peak_predicted_gb'] * 1e3:9.2f} {r['peak_measured_gb'] * 1e3:9.2f} {r['peak_error']:+7.1%}",
                  flush=True)
    worst = max(abs(r["activations_error"]) for r in results)
    worst_peak = max(abs(r["peak_error"]) for r in results)
    exact = all(r["params_exact"] and r["grads_exact"] for r in results)
    ok = worst <= args.tolerance
    summary = {"cases": len(results), "device": str(device), "worst_activation_error": worst,
               "worst_peak_error": worst_peak, "params_grads_optimizer_exact": exact, "tolerance": args.tolerance,
               "pass": ok}
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"worst activation error {worst:.1%} (target <= {args.tolerance:.0%}): {'PASS' if ok else 'FAIL'}; "
              f"worst peak error {worst_peak:.1%}; parameters, gradients, optimizer state exact: {exact}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
