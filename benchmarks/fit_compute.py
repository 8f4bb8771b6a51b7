"""The planner's per-class efficiencies (utils/plan/compute.py: CLASS_EFFICIENCY), derived from measured steps.

    python benchmarks/fit_compute.py        # the constants, then each calibration step: measured, modelled, ratio

1. Bytes: SwinIR's step on an H200 (benchmarks/results/2026-11-28-h200/bench_model_batch64.json, the roofline of
   `bench_model.py --config baseline --size 64 --batch_size 64`, bf16): per class, the bytes traced here for the
   same step over the seconds the class took, over the H200's HBM bandwidth. SwinIR's matmuls, attention and
   convolutions are short of work per byte: their byte efficiencies come from the same report.
2. FLOPs: matmul and attention from the ViT steps (NERSC's A100 ladder, this project's H200 ladder and vit_mp step:
   a grid search of the two fractions, least squares of log(samples/s)); convolution from SC22's U-Net (A100).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils.config import build_config  # noqa: E402
from utils.observe.flops import gpu_spec_peak_flops  # noqa: E402
from utils.plan.compute import BF16_BYTES, BYTE_CLASSES, CLASS_EFFICIENCY, Efficiency, step_profile  # noqa: E402

REPORT = Path(__file__).resolve().parent / "results" / "2026-11-28-h200" / "bench_model_batch64.json"
A100, H200 = ("NVIDIA A100-SXM4-40GB", 1555e9), ("NVIDIA H200", 4800e9)  # datasheet HBM bandwidths
# (label, config, overrides, precision, batch, GPU, measured samples/s): what the FLOP fractions are fitted to
VIT = [("ViT base bf16, one A100 (NERSC SC25 ladder)", "vit_base", {}, "bf16", 16, A100, 54.0),
       ("ViT base bf16, one H200 (2026-11-28-h200/vit_ladder.json, synthetic)", "vit_base", {}, "bf16", 16, H200,
        131.3),
       ("ViT embed 1536 bf16, one H200 (2026-11-28-h200/gpu_check.json: 0.5277 s per step of 16)", "vit_mp", {},
        "bf16", 16, H200, 16 / 0.5277)]
UNET = [("U-Net 64^3 fp32 (TF32), one A100 (NERSC SC22, DALI)", "unet3d_base", {}, "fp32", 64, A100, 578.0),
        ("U-Net 64^3 AMP, one A100 (NERSC SC22)", "unet3d_base", {}, "bf16", 64, A100, 776.5)]


def modelled(step, eff: Efficiency) -> float:
    _, config, overrides, precision, batch, (gpu, bandwidth), _ = step
    peak = gpu_spec_peak_flops(gpu, "bf16" if precision == "bf16" else "tf32")
    return batch / step_profile(build_config(config, overrides)).seconds(batch, precision, peak, bandwidth, eff=eff)


def byte_efficiencies() -> dict:
    report = json.loads(REPORT.read_text())
    classes, batch = report["roofline"]["classes"], report["batch_size"]
    cfg = build_config(report["config"], {"crop_size": report["size"] * build_config(report["config"]).model.upscale})
    traced = step_profile(cfg).by_class()
    out = {c: BF16_BYTES * traced[c]["bytes"] * batch / (classes[c]["seconds"] * H200[1])
           for c in ("matmul", "attention", "convolution", *BYTE_CLASSES)}
    out["optimizer"] = out["elementwise"]  # a streaming update of large tensors (SwinIR's is too small to tell)
    return out


def fit_flops(eff: Efficiency, steps: list, classes: tuple[str, ...]) -> dict:
    grid = [round(0.05 * i, 2) for i in range(2, 20)]
    best = None
    for values in itertools.product(grid, repeat=len(classes)):
        trial = dataclasses.replace(eff, flops={**eff.flops, **dict(zip(classes, values))})
        error = sum(math.log(modelled(s, trial) / s[-1]) ** 2 for s in steps)
        if best is None or error < best[0]:
            best = (error, trial)
    return best[1].flops


def main() -> int:
    eff = dataclasses.replace(CLASS_EFFICIENCY, bytes=byte_efficiencies())
    eff = dataclasses.replace(eff, flops=fit_flops(eff, VIT, ("matmul", "attention")))
    eff = dataclasses.replace(eff, flops=fit_flops(eff, UNET, ("convolution",)))
    print("flops:", {c: round(v, 3) for c, v in eff.flops.items()})
    print("bytes:", {c: round(v, 3) for c, v in eff.bytes.items()})
    for step in VIT + UNET:
        for name, e in (("fitted", eff), ("in use", CLASS_EFFICIENCY)):
            value = modelled(step, e)
            print(f"  {step[0]:<90} {name}: measured {step[-1]:7.1f}, modelled {value:7.1f} ({value / step[-1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
