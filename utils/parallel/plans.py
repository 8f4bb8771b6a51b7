"""What is model-specific in the parallel techniques: one plan per model class, declared beside the model.

The techniques (``techniques.py``: AC and compile; ``fsdp.py``; ``tensor_parallel.py``;
``context_parallel.py`` and ``domain_parallel.py``; ``pipeline_parallel.py``) are written once for every
model and read only a model's plan; the models themselves know nothing of parallelism. The built-in models'
plans are registered below; a model of yours registers its own where it is defined (the module that
``model_class`` names, which the scripts import before anything reads the plan)::

    from utils.parallel.plans import ModelPlan, register_plan
    register_plan(FNO2d, ModelPlan(units={"block": lambda model: model.blocks()}))

A model with no plan gets its units from its ``blocks()``, if it has that method (the model contract:
docs/part4-your-model.md), and nothing else. A plan may leave a technique out (None), and the technique then
refuses the model in one line that names it and the missing plan.

Each plan says:

- ``units``: the modules that activation checkpointing, torch.compile and FSDP2 wrap one by one, by unit
  name ("block": every transformer block or U-Net level; "layer": SwinIR's residual groups, RSTBs).
- ``tp``: the tensor-parallel plan (DTensor ``ParallelStyle`` per module name, which attention modules
  hold heads to split, and whether their q, k, v are one fused Linear).
- ``cp``: what context parallelism splits: "tokens" (the ViT: latitude bands of patch tokens, inside the
  model) or "fields" (SwinIR: latitude bands of the input field, domain parallelism with halos).
- ``stages``: where a pipeline may cut the model (the attribute holding its units, what the first stage
  keeps before them and the last after them).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Callable, Optional

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from models import SwinIR, UNet3D, ViT, load_model_class
from utils.config import ConfigError


UNITS = ("block", "layer")  # the unit names of the configs' ac and fsdp_unit keys


@dataclass(frozen=True)
class StagePlan:
    """Where a model is cut: the attribute holding its units, and what the first and last stages keep."""

    units: str
    stem: tuple[str, ...]
    tail: tuple[str, ...]


@dataclass(frozen=True)
class TensorParallelPlan:
    """How tensor parallelism splits a model (utils/parallel/tensor_parallel.py applies it)."""

    styles: Callable[[nn.Module], dict]
    """model -> {module name: ParallelStyle} for ``parallelize_module``."""
    heads: Callable[[nn.Module], list[int]]
    """The head count of each attention: every one must divide by tp (each rank holds whole heads)."""
    fused_qkv: Callable[[nn.Module], list[nn.Module]] = lambda model: []
    """Attention modules whose q, k and v are one Linear: split by rows, then regrouped by heads."""
    local_output: bool = False
    """Replicated modules hand plain tensors on (the model's code between layers expects them)."""


@dataclass(frozen=True)
class ModelPlan:
    """One model's row (the module docstring says what each field means); None: the technique refuses it."""

    units: dict[str, Callable[[nn.Module], list[nn.Module]]] = field(default_factory=dict)
    tp: Optional[TensorParallelPlan] = None
    cp: Optional[str] = None
    stages: Optional[StagePlan] = None


def vit_styles(model: nn.Module) -> dict:
    """The ViT's plan (Megatron's split plus sequence parallelism; see utils/parallel/tensor_parallel.py)."""
    gathered = dict(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {
        "transformer.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                            use_local_output=False),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.transformer)):
        block = f"transformer.{i}"
        plan.update({
            f"{block}.norm1": SequenceParallel(),
            f"{block}.attn": PrepareModuleInput(**gathered),
            **{f"{block}.attn.{name}": ColwiseParallel() for name in ("q", "k", "v")},
            f"{block}.attn.proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            f"{block}.norm2": SequenceParallel(),
            f"{block}.mlp": PrepareModuleInput(**gathered),
            f"{block}.mlp.fc1": ColwiseParallel(),
            f"{block}.mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        })
    return plan


def swinir_styles(model: nn.Module) -> dict:
    """SwinIR's plan for every Swin block: the window attention by heads, the MLP by its hidden units.

    Without sequence parallelism: the cyclic shift and the window partition reorder the tokens in every
    block, so a token-sharded residual stream would be all-gathered there anyway. The fused qkv linear
    is ColwiseParallel (its checkpoint layout unchanged), which gives each rank a contiguous 1/tp of the
    rows q|k|v rather than whole heads; the row's ``fused_qkv`` has them regrouped by heads.
    """
    plan = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "WindowAttention":
            plan.update({f"{name}.qkv": ColwiseParallel(use_local_output=False), f"{name}.proj": RowwiseParallel()})
        elif type(module).__name__ == "SwinTransformerBlock":
            plan.update({f"{name}.mlp.fc1": ColwiseParallel(), f"{name}.mlp.fc2": RowwiseParallel()})
    return plan


_PLANS: dict[type, ModelPlan] = {}


def register_plan(model_class: type, plan: ModelPlan) -> None:
    """Declare ``model_class``'s plan (for it and its subclasses); call it beside the model, once."""
    _PLANS[model_class] = plan


register_plan(SwinIR, ModelPlan(
    units={"block": lambda model: model.blocks(), "layer": lambda model: model.rstb_layers()},
    tp=TensorParallelPlan(swinir_styles, heads=lambda model: [b.attn.num_heads for b in model.swin_blocks()],
                          fused_qkv=lambda model: [b.attn for b in model.swin_blocks()], local_output=True),
    cp="fields",
    stages=StagePlan("layers", stem=("conv_first", "patch_embed", "absolute_pos_embed", "pos_drop"),
                     tail=("norm", "conv_after_body", "conv_before_upsample", "upsample", "conv_last",
                           "conv_up1", "conv_up2", "conv_hr", "lrelu")),
))
register_plan(ViT, ModelPlan(
    units={"block": lambda model: model.blocks()},
    tp=TensorParallelPlan(vit_styles, heads=lambda model: [b.attn.q.out_features // b.attn.head_dim
                                                            for b in model.transformer]),
    cp="tokens",
    stages=StagePlan("transformer", stem=("patch_embed", "pos_embed"), tail=("norm", "head")),
))
register_plan(UNet3D, ModelPlan(units={"block": lambda model: model.blocks()}))


def model_plan(model: nn.Module) -> ModelPlan:
    """The plan registered for the model's class (or a base class); else units from its ``blocks()``, if any."""
    return class_plan(type(model))


def class_plan(model_class: type) -> ModelPlan:
    """:func:`model_plan` before the model is built (the loaders of a model whose fields are split need it)."""
    for cls in model_class.__mro__:
        if cls in _PLANS:
            return _PLANS[cls]
    if callable(getattr(model_class, "blocks", None)):  # the contract's one optional method, not its internals
        return ModelPlan(units={"block": lambda model: model.blocks()})
    return ModelPlan()


def config_plan(model_cfg) -> ModelPlan:
    """The plan of the model a config's model section builds (its class, imported as build_model would)."""
    target = load_model_class(model_cfg.model_class, model_cfg.model_path)
    return class_plan(target if isinstance(target, type) else _returned_class(target))


def _returned_class(factory) -> type:
    # A factory (models.swinir:build) says what it returns in its annotation; without one, nothing is known.
    returned = typing.get_type_hints(factory).get("return")
    return returned if isinstance(returned, type) else object


def missing_plan(model: nn.Module, what: str, flag: str) -> ConfigError:
    """The one line of a technique that the model's plan leaves out."""
    name = type(model).__name__
    return ConfigError(f"the {name} has no {what} plan: use {flag}, or declare one beside the model "
                       f"(register_plan({name}, ModelPlan(...)): utils/parallel/plans.py, docs/part4-your-model.md)")


def ac_units(model: nn.Module, unit: str) -> list[nn.Module]:
    """The modules a technique wraps one by one (AC, FSDP2): unit "block" or "layer" of the model's row."""
    if unit not in UNITS:
        raise ValueError(f"unit must be 'block' or 'layer', got {unit!r}")
    units = model_plan(model).units
    if not units:
        raise missing_plan(model, "unit (blocks() returning its repeated layers, or a plan with units)", "--ac none")
    if unit not in units:
        name, have = type(model).__name__, " and ".join(f"{u}s" for u in units)
        fix = " / ".join(f"--ac {u} / --fsdp_unit {u}" for u in units)
        raise ConfigError(f"unit {unit!r} is not one of the {name}'s units: the {name} has {have} only: use {fix}")
    return list(units[unit](model))
