"""The compute of a training step on a GPU, per kernel class: what scales with the work, and how fast each class runs.

The step of one sample is traced once on the meta device (utils/observe/kernels.py: every aten call with its FLOPs
and the bytes its operands move; SDPA as the fused kernel a GPU runs, its matmuls padded to the head dimension the
kernels are built for). Each kernel takes

    matmul, attention, convolution:           max(FLOPs / (peak x flop_efficiency), bytes / (HBM x byte_efficiency))
    normalisation, elementwise, copies:       bytes / (HBM x byte_efficiency)

with an efficiency per class, and the AdamW update reads and writes ADAMW_BYTES per parameter once per step. So a
wider ViT is more efficient than a narrow one for the reasons a GPU has (its matmuls do more FLOPs per byte, its
attention more per score), and SwinIR, whose step is copies, normalisation and elementwise kernels over small
windows (benchmarks/results/2026-11-28-h200/: 158.6 ms against a 45.7 ms roof), is slow per byte, not per FLOP.

The efficiencies (CLASS_EFFICIENCY) come from measured steps, and only from them: the byte efficiencies from the H200
roofline report of SwinIR's step (per class: the seconds it took for the bytes traced here; per traced byte, so an
elementwise class whose kernels move less than their operands' bytes may exceed 1), the FLOP efficiencies of matmul
and attention from the ViT's H200 steps (embed 1536 against 384); benchmarks/fit_compute.py derives them.

The class model gives the shape, a measured step the level: a built-in model's step is scaled by ANCHORS, one
measured step per model and precision (measured / modelled on its GPU), so that its calibration figure comes out as
measured and every other size, GPU and layout moves by what the classes say (a model of yours, with no anchor, is
the class model alone). benchmarks/plan_vs_published.py marks the anchors as calibration. The trace runs in fp32; a bf16 step moves
BF16_BYTES of its bytes (autocast keeps the residual stream, the norms and the loss in fp32, and adds casts: the
H200's SwinIR ladder, TF32 90.2 and bf16 97.7 samples/s, both bound by bytes).

Tensor parallelism splits every class over its ranks, except, without sequence parallelism, the byte classes
(the norms, the residual stream's elementwise work, autocast's casts of the whole stream), which every tp rank does
whole (an upper bound: the MLP's GELU is split). Not modelled: torch.compile's fusion, the input
pipeline, the launch gaps between kernels (the H200's SwinIR step idled 2-8 % of it).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Optional

import torch

from utils.config import build_config
from utils.memory.measure import model_on_meta
from utils.memory.shapes import input_size
from utils.observe.flops import gpu_spec_peak_flops
from utils.observe.kernels import step_ops

FLOP_CLASSES = ("matmul", "attention", "convolution")
BYTE_CLASSES = ("normalisation", "elementwise", "copies")
HEAD_DIM_STEP = 32  # fused attention kernels are instantiated for head dims in steps of 32 (64 at least)
ADAMW_BYTES = 28  # fp32 parameter, gradient and two moments read (16), parameter and moments written (12)
BF16_BYTES = 0.92  # of the fp32 trace's bytes a bf16 autocast step moves (the module docstring)


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions of the dense tensor peak (per FLOP class) and of the HBM bandwidth (per class)."""

    flops: dict
    bytes: dict


CLASS_EFFICIENCY = Efficiency(
    flops={"matmul": 0.45, "attention": 0.45, "convolution": 0.45},
    bytes={"matmul": 0.425, "attention": 0.723, "convolution": 0.117, "normalisation": 0.224, "elementwise": 1.467,
           "copies": 0.196, "optimizer": 1.467},
)
"""From benchmarks/fit_compute.py (rounded); see the module docstring. Convolution's FLOP fraction is matmul's."""


@dataclass(frozen=True)
class Anchor:
    """A measured step of a built-in model on one GPU: the level of its modelled steps (the module docstring)."""

    source: str
    config: str
    overrides: tuple  # (key, value) pairs: hashable, for the cache
    gpu: str
    bandwidth: float  # the GPU's HBM bandwidth, B/s (datasheet)
    batch: int
    samples_per_sec: float


A100_40, H200 = ("NVIDIA A100-SXM4-40GB", 1555e9), ("NVIDIA H200", 4800e9)
ANCHORS = {  # model -> precision -> its measured step
    "vit": {"bf16": Anchor("NERSC SC25 ladder, one A100", "vit_base", (), *A100_40, 16, 54.0)},
    "swinir": {"bf16": Anchor("H200 ladder, bf16 rung (2026-11-28-h200/gpu_check.json)", "baseline", (), *H200, 16,
                              97.67),
               "fp32": Anchor("H200 ladder, TF32 rung (2026-11-28-h200/gpu_check.json)", "baseline", (), *H200, 16,
                              90.1)},
    "unet3d": {"bf16": Anchor("NERSC SC22, AMP, one A100", "unet3d_base", (), *A100_40, 64, 776.5),
               "fp32": Anchor("NERSC SC22, TF32 with DALI, one A100", "unet3d_base", (), *A100_40, 64, 578.0)},
}


def anchor_of(model: str, precision: str) -> Optional[tuple[str, Anchor]]:
    """(its precision, the anchor) of a model in ``precision``, or in the other one (the classes carry the
    difference); None for a model without one."""
    anchors = ANCHORS.get(model, {})
    if precision in anchors:
        return precision, anchors[precision]
    return next(iter(anchors.items()), None)


def step_seconds(cfg, batch: float, precision: str, peak: float, bandwidth: float, split: float = 1.0,
                 whole_norms: float = 1.0) -> float:
    """The modelled step (StepProfile.seconds) of the config's model, at the level of its anchor."""
    seconds = step_profile(cfg).seconds(batch, precision, peak, bandwidth, split, whole_norms)
    found = anchor_of(cfg.model.model, precision)
    if found is None:
        return seconds
    p, a = found
    return seconds * (a.batch / a.samples_per_sec) / _anchor_modelled(p, a)


def calibration_note(cfg, gpu: str) -> str:
    """plan.py's line on which of its speeds are calibrated and which extrapolated."""
    anchors = ANCHORS.get(cfg.model.model, {})
    if not anchors:
        return (f"speed: per-kernel-class model (utils/plan/compute.py); no measured step of model {cfg.model.model} "
                "sets its level: extrapolated from the built-in models' calibration")
    same = [p for p, a in anchors.items() if a.gpu == gpu and a.config == cfg.name and not a.overrides]
    steps = "; ".join(f"{p}: {a.source}, {a.config} at batch {a.batch}" for p, a in anchors.items())
    where = (f"calibrated for one GPU in {', '.join(same)} (its other layouts, batches and precisions extrapolated)"
             if same else "extrapolated to this config, GPU and layouts")
    return f"speed: per-kernel-class model (utils/plan/compute.py) at the level of measured steps ({steps}): {where}"


@lru_cache(maxsize=None)
def _anchor_modelled(precision: str, a: Anchor) -> float:
    """The class model's seconds of an anchor's step on its GPU (once per process: a config built, a step traced)."""
    peak = gpu_spec_peak_flops(a.gpu, "bf16" if precision == "bf16" else "tf32")
    return step_profile(build_config(a.config, dict(a.overrides))).seconds(a.batch, precision, peak, a.bandwidth)


@dataclass(frozen=True)
class StepProfile:
    """One sample's training step, per kernel class: the FLOP classes' kernels as (class, FLOPs, bytes), the byte
    classes' bytes summed (fp32 trace), and the model's parameters."""

    kernels: tuple
    bytes: dict
    parameters: int

    def seconds(self, batch: float, precision: str, peak: float, bandwidth: float, split: float = 1.0,
                whole_norms: float = 1.0, eff: Efficiency = CLASS_EFFICIENCY) -> float:
        """Seconds of ``batch`` samples' step on one GPU at ``peak`` FLOP/s (the precision's) and ``bandwidth`` B/s:
        ``split`` ranks share each sample's work (tp x cp x pp), but the byte classes only ``whole_norms`` of them
        (tp without sequence parallelism: cp x pp)."""
        scale = BF16_BYTES if precision == "bf16" else 1.0
        per_sample = sum(max(f / (peak * eff.flops[c]), b * scale / (bandwidth * eff.bytes[c]))
                         for c, f, b in self.kernels) / split
        for c, b in self.bytes.items():
            per_sample += b * scale / (bandwidth * eff.bytes[c]) / whole_norms
        update = self.parameters / split * ADAMW_BYTES / (bandwidth * eff.bytes["optimizer"])
        return batch * per_sample + update

    def by_class(self) -> dict:
        """FLOPs and bytes per class (for the printout and the fit)."""
        out = {c: {"flops": 0.0, "bytes": 0.0} for c in (*FLOP_CLASSES, *BYTE_CLASSES)}
        for c, f, b in self.kernels:
            out[c]["flops"] += f
            out[c]["bytes"] += b
        for c, b in self.bytes.items():
            out[c]["bytes"] += b
        return out


def padded(head_dim: int) -> int:
    return max(2 * HEAD_DIM_STEP, HEAD_DIM_STEP * math.ceil(head_dim / HEAD_DIM_STEP))


_PROFILES: dict[str, StepProfile] = {}  # a plan asks once per layout: each model and input traced once per process


def step_profile(cfg) -> StepProfile:
    """The profile of one sample's step of the config's model (its input: utils/memory/shapes.py's input_size)."""
    shape = (cfg.model.in_chans, *input_size(cfg))
    key = json.dumps([asdict(cfg.model), shape], sort_keys=True, default=str)
    if key not in _PROFILES:
        _PROFILES[key] = _traced(cfg, shape)
    return _PROFILES[key]


def _traced(cfg, shape: tuple) -> StepProfile:
    model = model_on_meta(cfg)
    sample = torch.empty((1, *shape), device="meta")
    kernels, summed = [], dict.fromkeys(BYTE_CLASSES, 0.0)
    for op in step_ops(model, sample):
        if op.kind in FLOP_CLASSES:
            kernels.append((op.kind, op.flops * (padded(op.head_dim) / op.head_dim if op.head_dim else 1.0),
                            float(op.bytes)))
        elif op.kind in summed:
            summed[op.kind] += op.bytes
    return StepProfile(tuple(kernels), summed, sum(p.numel() for p in model.parameters() if p.requires_grad))
