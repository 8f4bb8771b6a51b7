"""Models of the tutorial; ``build_model(cfg)`` turns the config's model section into a module."""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from .swinir import SwinIR

__all__ = ["SwinIR", "build_model", "count_parameters"]


def build_model(cfg) -> nn.Module:
    """The model described by ``cfg`` (a ``utils.config.ModelConfig``, or a whole ``Config``)."""
    if not isinstance(getattr(cfg, "model", None), str):  # a whole Config: use its model section
        cfg = cfg.model
    kwargs = dataclasses.asdict(cfg)
    name = kwargs.pop("model")
    if name != "swinir":
        raise ValueError(f"unknown model {name!r}; available: 'swinir'")
    return SwinIR(**kwargs)


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
