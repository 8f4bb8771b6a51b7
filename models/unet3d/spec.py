"""SC22's U-Net's spec: what the techniques and tools need of it (models/spec.py says what each field means)."""

from __future__ import annotations

from models.spec import ModelPlan, ModelSpec, register

from .network import UNet3D


def check(cfg) -> None:
    """The U-Net's keys: its widths, and crops it can halve once per level."""
    d, t, widths, full_scale = cfg.data, cfg.train, cfg.model.model_args["widths"], cfg.model.model_args["full_scale"]
    if not widths or min(widths) < 1:
        raise ValueError(f"widths must be one or more positive channel counts, got {widths}")
    levels = len(widths) + full_scale
    if d.crop_size < 2 ** levels or d.crop_size % 2 ** levels:
        raise ValueError(f"crop_size {d.crop_size} must be a multiple of 2**{levels} = {2 ** levels}: the U-Net "
                         f"halves it {levels} times ({len(widths)} widths{' + full_scale' if full_scale else ''}"
                         f"); use {max(2 ** levels, d.crop_size // 2 ** levels * 2 ** levels)} or fewer levels")
    if "layer" in (t.ac, cfg.dist.fsdp_unit):
        raise ValueError("ac/fsdp_unit 'layer' is SwinIR's RSTB; the U-Net's unit is its block (each level's "
                         "convolution): use block")


SPEC = register(ModelSpec(
    UNet3D,
    ModelPlan(units={"block": lambda model: model.blocks()}),
    name="unet3d",
    build="models.unet3d:UNet3D",
    memory="models.unet3d.memory:UNet3DShape",
    tasks=("volume",),
    check=check,
    fp32_modules=("last",),  # no normalisations: the last transposed convolution, which writes the output
    flat_keys=("widths", "full_scale"),
))
