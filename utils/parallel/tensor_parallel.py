"""Tensor parallelism with DTensor's ``parallelize_module``; each model's plan is in its spec,
beside the network (models/<name>/spec.py), which knows nothing of it.

SwinIR's plan: see models/swinir/spec.py's ``swinir_styles`` (window attention by heads, MLP by hidden units, the rest replicated).

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
from torch.distributed.tensor.parallel import parallelize_module

from models.spec import FusedQKV
from utils.config import ConfigError
from utils.parallel.plans import missing_plan, model_plan
from utils.parallel.versions import replicated_convolutions_locally

# The config keys this file applies, and the scripts that apply them: any other script refuses them set away
# from their defaults (utils/config.py reads every file's APPLIED_BY as a literal, without importing the file).
APPLIED_BY = {
    "tp": ("train_mp.py", "estimate_memory.py"),
}


def _heads_of_this_rank(attn: FusedQKV, mesh) -> None:
    """After qkv: (windows, N, 3 * D) sharded by columns -> this rank's heads of q, k and v, a local tensor.

    The output is all-gathered and re-split by heads (one all-gather per block that Megatron's layout
    avoids by permuting qkv's rows, which would change the checkpoint layout). In backward, the head
    gradients are all-gathered back, so every rank gets the whole gradient of its column shard. The
    attention's other per-head parameters are the plan's to shard (``by_head``).
    """
    def regroup(_module, _args, out):
        full = out.redistribute(placements=[Replicate()])
        B_, N, _ = full.shape
        mine = full.view(B_, N, 3, attn.heads, attn.head_dim).redistribute(placements=[Shard(3)]).to_local()
        return mine.flatten(2)

    attn.qkv.register_forward_hook(regroup)
    attn.by_head(mesh)


def check_heads(heads: int, tp: int) -> None:
    if heads % tp:
        raise ConfigError(f"{heads} attention heads are not divisible by tp {tp}: each tp rank holds whole heads; "
                          f"use a tp that divides {heads}")


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Parallelize ``model`` over the 1-D ``tp_mesh`` with its plan; a mesh of size 1 changes nothing."""
    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    plan = model_plan(model).tp
    if plan is None:
        raise missing_plan(model, "tensor-parallel", "--tp 1")
    for heads in plan.heads(model):
        check_heads(heads, tp_mesh.size())
    parallelize_module(model, tp_mesh, plan.styles(model))
    for attn in plan.fused_qkv(model):
        _heads_of_this_rank(attn, tp_mesh)  # after the plan's own hooks on qkv
    # The ViT adds its (replicated) position embedding to the patch embedding's output: DTensors there.
    replicate_rest(model, tp_mesh, local_output=plan.local_output)
    return model


def replicate_rest(model: nn.Module, mesh, local_output: bool = False) -> None:
    """Parameters no style split become replicated DTensors; their modules take DTensors and give DTensors
    (or, ``local_output``, plain tensors, as the unsplit model's code expects between its layers).

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

    def output_to_local(_module, output, _device_mesh):
        # A copy, not to_local's alias: SwinIR applies in-place activations (LeakyReLU(inplace=True) after
        # conv_before_upsample) to some of these outputs, which autograd forbids on a custom function's alias.
        return output.to_local().clone() if isinstance(output, DTensor) else output

    for module in model.modules():
        plain = [p for p in module.parameters(recurse=False) if not isinstance(p, DTensor)]
        if plain and module is not model:
            distribute_module(module, mesh, to_replicated, input_fn=input_to_dtensor,
                              output_fn=output_to_local if local_output else None)
            replicated_convolutions_locally(module)  # torch < 2.15: their gradients would be summed over tp
        elif plain:  # the root's own parameters (the position embedding): no input conversion
            to_replicated("", module, mesh)
