"""Models of the tutorial; ``build_model(cfg)`` turns the config's model section into a module."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch.nn as nn

from .swinir import SwinIR
from .unet3d import UNet3D
from .vit import ViT

__all__ = ["SwinIR", "UNet3D", "ViT", "build_model", "count_parameters", "fixed_input_size"]


def build_model(cfg) -> nn.Module:
    """The model described by ``cfg`` (a ``utils.config.ModelConfig``, or a whole ``Config``).

    mean/std must be set (utils.data.era5.resolve_from_data fills them from the data's statistics).
    """
    if not isinstance(getattr(cfg, "model", None), str):  # a whole Config: use its model section
        cfg = cfg.model
    kwargs = dataclasses.asdict(cfg)
    name = kwargs.pop("model")
    if name == "unet3d":  # works on the stored (scaled) fields: no mean/std
        return UNet3D(cfg.in_chans, cfg.out_chans, cfg.widths, cfg.full_scale)
    if not kwargs["mean"]:
        raise ValueError("build_model: mean/std are empty; resolve them from the data first "
                         "(utils.data.era5.resolve_from_data) or set them in the config")
    img_size = cfg.img_hw
    kwargs.pop("img_size")
    if name == "swinir":
        kwargs.pop("patch_size")  # SwinIR embeds single pixels
        for key in ("out_chans", "widths", "full_scale"):  # the U-Net's
            kwargs.pop(key)
        return SwinIR(img_size=img_size, **kwargs)
    if name == "vit":
        return ViT(img_size=img_size, patch_size=kwargs["patch_size"], in_chans=kwargs["in_chans"],
                   embed_dim=kwargs["embed_dim"], depth=kwargs["depths"][0], num_heads=kwargs["num_heads"][0],
                   mlp_ratio=kwargs["mlp_ratio"], qkv_bias=kwargs["qkv_bias"],
                   drop_path_rate=kwargs["drop_path_rate"], mean=kwargs["mean"], std=kwargs["std"])
    raise ValueError(f"unknown model {name!r}; available: 'swinir', 'vit', 'unet3d'")


def fixed_input_size(cfg) -> Optional[tuple[int, int]]:
    """(height, width) the model accepts and nothing else (the ViT: its position embedding), or None (any size)."""
    return cfg.img_hw if cfg.model == "vit" else None


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
