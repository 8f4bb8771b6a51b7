"""The ViT forecaster's spec: what the techniques and tools need of it (models/spec.py says what each field means)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from models.spec import ModelPlan, ModelSpec, StagePlan, TensorParallelPlan, TokenPlan, check_heads, register

from .network import ViT


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


def check(cfg) -> None:
    """The ViT's keys: one stage, whole patches."""
    check_heads(cfg)
    m, t, a = cfg.model, cfg.train, cfg.model.model_args
    if len(a["depths"]) != 1:
        raise ValueError(f"the ViT has one stage: depths must have one entry (its depth), got {a['depths']}")
    if "layer" in (t.ac, cfg.dist.fsdp_unit):
        raise ValueError("ac/fsdp_unit 'layer' is SwinIR's RSTB; the ViT's unit is the transformer block: use block")
    height, width, patch = *m.img_hw, a["patch_size"]
    if not patch > 0:
        raise ValueError(f"patch_size must be > 0, got {patch}")
    if height % patch or width % patch:
        raise ValueError(f"img_size {height}x{width} is not divisible by patch_size {patch}: "
                         "use a patch size that divides both sides")


SPEC = register(ModelSpec(
    ViT,
    ModelPlan(
        units={"block": lambda model: model.blocks()},
        tp=TensorParallelPlan(vit_styles, heads=lambda model: [b.attn.q.out_features // b.attn.head_dim
                                                                for b in model.transformer]),
        cp=TokenPlan(grid=lambda model: model.grid, first=lambda model: model.transformer[0],
                     gathered=lambda model: [m for b in model.transformer for m in (b.attn.k, b.attn.v)] + [model.head]),
        stages=StagePlan("transformer", stem=("patch_embed", "pos_embed"), tail=("norm", "head")),
    ),
    name="vit",
    build="models.vit:build",
    memory="models.vit.memory:ViTShape",
    fixed_input_size=True,
    tasks=("forecast", "diagnostic"),
    check=check,
    fp32_modules=("*norm*", "head"),  # every LayerNorm, and the head that writes the output patches
    flat_keys=("patch_size", "embed_dim", "depths", "num_heads", "mlp_ratio", "qkv_bias", "drop_path_rate"),
))
