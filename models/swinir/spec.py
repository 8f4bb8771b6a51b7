"""SwinIR's spec: what the techniques and tools need of it (models/spec.py says what each field means)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from models.spec import ModelPlan, ModelSpec, StagePlan, TensorParallelPlan, check_heads, register

from . import network
from .network import SwinIR


def swinir_styles(model: nn.Module) -> dict:
    """SwinIR's plan for every Swin block: the window attention by heads, the MLP by its hidden units.

    Without sequence parallelism: the cyclic shift and the window partition reorder the tokens in every
    block, so a token-sharded residual stream would be all-gathered there anyway. The fused qkv linear
    is ColwiseParallel (its checkpoint layout unchanged), which gives each rank a contiguous 1/tp of the
    rows q|k|v rather than whole heads; the plan's ``fused_qkv`` has them regrouped by heads.
    """
    plan = {}
    for name, module in model.named_modules():
        if isinstance(module, network.WindowAttention):
            plan.update({f"{name}.qkv": ColwiseParallel(use_local_output=False), f"{name}.proj": RowwiseParallel()})
        elif isinstance(module, network.SwinTransformerBlock):
            plan.update({f"{name}.mlp.fc1": ColwiseParallel(), f"{name}.mlp.fc2": RowwiseParallel()})
    return plan


SPEC = register(ModelSpec(
    SwinIR,
    ModelPlan(
        units={"block": lambda model: model.blocks(), "layer": lambda model: model.rstb_layers()},
        tp=TensorParallelPlan(swinir_styles, heads=lambda model: [b.attn.num_heads for b in model.swin_blocks()],
                              fused_qkv=lambda model: [b.attn for b in model.swin_blocks()], local_output=True),
        cp="fields",
        stages=StagePlan("layers", stem=("conv_first", "patch_embed", "absolute_pos_embed", "pos_drop"),
                         tail=("norm", "conv_after_body", "conv_before_upsample", "upsample", "conv_last",
                               "conv_up1", "conv_up2", "conv_hr", "lrelu")),
    ),
    name="swinir",
    build="models.swinir:build",
    memory="models.swinir.memory:SwinIRShape",
    check=check_heads,
    fresh_caches=network._cached_shift_mask.cache_clear,
))
