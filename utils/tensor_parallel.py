"""Tensor parallelism with DTensor's ``parallelize_module``: the per-model plans live here, not in models/.

The ViT's plan over the "tp" mesh dimension (Megatron's split, plus sequence parallelism):

    residual stream, norm1, norm2, final norm   Shard(1): each tp rank holds 1/tp of the tokens
    attention / MLP input                       all-gathered to every tp rank (Replicate)
    q, k, v, fc1                                ColwiseParallel: each rank holds whole heads / 1/tp of the MLP
    proj, fc2                                   RowwiseParallel, output reduce-scattered to Shard(1)
    head                                        ColwiseParallel from the sharded tokens, output all-gathered
    patch embedding, position embedding         replicated (computed once per rank, small)

NERSC's tutorial leaves the LayerNorms and the residual stream replicated: every tp rank then
stores the full (batch, tokens, D) activations of the norms and the residual additions, which
tensor parallelism does not shrink. Sequence parallelism shards exactly those tensors over the
tokens, and it turns each all-reduce into a reduce-scatter + all-gather of the same total size.
The norms' weights stay replicated DTensors: DTensor sums their partial gradients over tp.

Every parameter becomes a DTensor on the tp mesh (replicated ones included), so that FSDP2 and
the optimizer see one kind of tensor.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from utils.config import ConfigError


def vit_plan(model: nn.Module) -> dict:
    """The ViT's plan: {module name: ParallelStyle}."""
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


PLANS = {"ViT": vit_plan}


def check_heads(num_heads: int, tp: int) -> None:
    if num_heads % tp:
        raise ConfigError(f"num_heads {num_heads} is not divisible by tp {tp}: each tp rank holds whole heads; "
                          f"use a tp that divides {num_heads}")


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Parallelize ``model`` over the 1-D ``tp_mesh`` with its plan; a mesh of size 1 changes nothing."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    plan = PLANS.get(type(model).__name__)
    if plan is None:
        raise ConfigError(f"no tensor-parallel plan for {type(model).__name__}: use --tp 1 "
                          f"(plans: {', '.join(PLANS)})")
    attn = model.transformer[0].attn
    check_heads(attn.q.out_features // attn.head_dim, tp_mesh.size())
    parallelize_module(model, tp_mesh, plan(model))
    replicate_rest(model, tp_mesh)
    return model


def replicate_rest(model: nn.Module, mesh) -> None:
    """Parameters no style split become replicated DTensors; their modules take and give DTensors.

    (PyTorch has no public ParallelStyle for "replicate this module".) Buffers stay plain tensors.
    """
    def to_replicated(_name, module, device_mesh):
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                module.register_parameter(name, nn.Parameter(distribute_tensor(param.data, device_mesh, [Replicate()]),
                                                             requires_grad=param.requires_grad))

    def input_to_dtensor(_module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    for module in model.modules():
        plain = [p for p in module.parameters(recurse=False) if not isinstance(p, DTensor)]
        if plain and module is not model:
            distribute_module(module, mesh, to_replicated, input_fn=input_to_dtensor)
        elif plain:  # the root's own parameters (the position embedding): no input conversion
            to_replicated("", module, mesh)
