"""SwinIR's spec: what the techniques and tools need of it (models/spec.py says what each field means)."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Optional

from torch import nn
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from models.spec import (FIELD_TASKS, FieldPlan, FusedQKV, ModelPlan, ModelSpec, StagePlan, TensorParallelPlan, check_heads,
                         register)

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


def bias_table_by_head(attn: nn.Module, mesh) -> None:
    """This rank's heads are its columns of the relative-position bias table, looked up by the model's own method on
    the local shard (PyTorch has no parallel style for a table read by index)."""
    table = attn.relative_position_bias_table
    attn.register_parameter("relative_position_bias_table",
                            nn.Parameter(distribute_tensor(table.data, mesh, [Shard(1)])))
    method = type(attn).relative_position_bias
    attn.relative_position_bias = lambda: method(SimpleNamespace(
        relative_position_bias_table=attn.relative_position_bias_table.to_local(),
        relative_position_index=attn.relative_position_index))


def fused_qkv(model: nn.Module) -> list[FusedQKV]:
    return [FusedQKV(b.attn.qkv, b.attn.num_heads, b.attn.head_dim, partial(bias_table_by_head, b.attn))
            for b in model.swin_blocks()]


def refuse_bands(model: nn.Module) -> Optional[str]:
    """Why this SwinIR's field cannot be split into bands of whole windows (None: it can)."""
    if model.ape:
        return ("domain parallelism does not split the absolute position embedding of a SwinIR built with ape=True "
                "(this project's configs never build one): use cp 1")
    if any(block.window_size != model.window_size for block in model.swin_blocks()):
        return (f"img_size {model.patches_resolution} is not larger than window_size {model.window_size}; domain "
                "parallelism needs whole windows: use a larger img_size")
    return None


def check(cfg) -> None:
    """SwinIR's arguments: heads that divide embed_dim, a window of at least one token, an upsampler for task sr."""
    check_heads(cfg)
    window, upsampler = cfg.model.model_args["window_size"], cfg.model.model_args["upsampler"]
    if not window > 0:
        raise ValueError(f"window_size must be > 0, got {window}")
    if cfg.data.task == "sr" and not upsampler:
        raise ValueError("upsampler '' keeps the input's grid, and task sr's targets are upscale times finer: use "
                         "upsampler pixelshuffle (or pixelshuffledirect, nearest+conv), or a task on one grid")


SPEC = register(ModelSpec(
    SwinIR,
    ModelPlan(
        units={"block": lambda model: model.blocks(), "layer": lambda model: model.rstb_layers()},
        tp=TensorParallelPlan(swinir_styles, heads=lambda model: [b.attn.num_heads for b in model.swin_blocks()],
                              fused_qkv=fused_qkv, local_output=True),
        cp=FieldPlan(rows=lambda model_args: model_args["window_size"],
                     shifted=lambda model: [b for b in model.swin_blocks() if b.shift_size],
                     window=lambda block: block.window_size, refuse=refuse_bands),
        stages=StagePlan("layers", stem=("conv_first", "patch_embed", "absolute_pos_embed", "pos_drop"),
                         tail=("norm", "conv_after_body", "conv_before_upsample", "upsample", "conv_last",
                               "conv_up1", "conv_up2", "conv_hr", "lrelu")),
    ),
    name="swinir",
    build="models.swinir:build",
    memory="models.swinir.memory:SwinIRShape",
    tasks=FIELD_TASKS,
    check=check,
    # Every LayerNorm, and the head after the body: the upsampler's convolutions, which write the output field.
    fp32_modules=("*norm*", "conv_before_upsample", "upsample", "conv_last", "conv_up1", "conv_up2", "conv_hr"),
    fresh_caches=network._cached_shift_mask.cache_clear,
    flat_keys=("embed_dim", "depths", "num_heads", "window_size", "mlp_ratio", "qkv_bias", "drop_path_rate",
               "img_range", "upsampler", "resi_connection"),
))
