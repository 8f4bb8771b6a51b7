"""FSDP2 for train_fsdp.py: sharding (FSDP or HSDP), mixed precision, memory report.

- ``apply_fsdp``: ``fully_shard`` on each block (or SwinIR RSTB) and then on the root, over a 1-D mesh
  (FSDP: every rank holds 1/world_size of each parameter) or a 2-D mesh (HSDP: replicate across
  ``hsdp_replicas`` groups, shard within each). Apply it after activation checkpointing and compile,
  and build the optimizer afterwards, on the sharded parameters.
- ``memory_record``: bytes of parameters, gradients and AdamW state held by each rank, against the
  full copies that every DDP rank holds.

Its checkpoints, DCP folders that every rank writes its shards into: utils/checkpoint/sharded.py.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from utils.config import ConfigError
from utils.parallel.distributed import ensure_process_group
from utils.parallel.plans import ac_units
from utils.parallel.versions import average_fsdp_gradients
from utils.precision import DTYPES

# The config keys this file applies, and the scripts that apply them: any other script refuses them set away
# from their defaults (utils/config.py reads every file's APPLIED_BY as a literal, without importing the file).
APPLIED_BY = {
    ("fsdp_unit", "param_dtype", "reduce_dtype"): ("train_fsdp.py", "train_mp.py", "train_pp.py", "estimate_memory.py"),
    # train_pp.py keeps parameters gathered through a step
    "reshard_after_forward": ("train_fsdp.py", "train_mp.py", "estimate_memory.py"),
    # train_mp.py and train_pp.py shard over their own dp meshes
    "hsdp_replicas": ("train_fsdp.py", "estimate_memory.py"),
}

HSDP_DIMS = ("replicate", "shard")


# ----------------------------------------------------------------------------- sharding


def mesh_shape(world_size: int, hsdp_replicas: int) -> tuple[int, ...]:
    """(world_size,) for FSDP; (replicas, world_size // replicas) for HSDP."""
    if hsdp_replicas < 1 or world_size % hsdp_replicas:
        raise ConfigError(f"hsdp_replicas {hsdp_replicas} must be >= 1 and divide the {world_size} ranks: "
                          "use the number of nodes (replicate across nodes, shard within one)")
    return (world_size,) if hsdp_replicas == 1 else (hsdp_replicas, world_size // hsdp_replicas)


def build_mesh(hsdp_replicas: int, device: torch.device) -> DeviceMesh:
    """1-D mesh ("shard") over all ranks, or for HSDP a 2-D mesh ("replicate", "shard").

    Ranks fill the mesh row by row, and torchrun numbers the ranks of a node consecutively, so with
    ``hsdp_replicas`` = number of nodes each shard group is one node (fast links) and gradients
    cross the network only in the all-reduce between replicas.
    """
    ensure_process_group(device)
    shape = mesh_shape(dist.get_world_size(), hsdp_replicas)
    return init_device_mesh(device.type, shape, mesh_dim_names=HSDP_DIMS[-len(shape):])


def mixed_precision(dist_cfg, cast_forward_inputs: bool = True) -> MixedPrecisionPolicy:
    """Parameters all-gathered (and computed) in ``param_dtype``; gradients reduced in ``reduce_dtype``.

    The sharded parameters, gradients and AdamW state stay fp32 whatever the policy. reduce_dtype
    is always passed explicitly because its default has changed between PyTorch releases.
    """
    param_dtype = DTYPES[dist_cfg.param_dtype]
    return MixedPrecisionPolicy(param_dtype=None if param_dtype == torch.float32 else param_dtype,
                                reduce_dtype=DTYPES[dist_cfg.reduce_dtype], cast_forward_inputs=cast_forward_inputs)


def apply_fsdp(model: nn.Module, cfg, device: torch.device, mesh: Optional[DeviceMesh] = None,
               reshard_after_forward: Optional[bool] = None) -> nn.Module:
    """``fully_shard`` each unit (``fsdp_unit``: block or SwinIR RSTB), then the root; returns the model.

    ``mesh``: the data-parallel mesh to shard over (train_mp.py: dp x cp, whose tensor-parallel
    DTensors then become 2-D); by default all ranks (FSDP) or replicas x shards (HSDP).
    ``reshard_after_forward`` overrides the config's (train_pp.py: False, since a pipeline runs
    several microbatches' forwards before their backwards).

    Units are sharded first so that each unit's parameters are gathered just before it runs and
    freed after; the root then owns what is left (convolutions, norms, the head). The model must
    be initialised identically on every rank (same seed): fully_shard does not broadcast, it keeps
    each rank's slice of its own copy.

    The root does not cast its input: the model subtracts the physical mean and divides by the std
    in fp32 (a bf16 input would already be rounded, 278.39 K -> 278.0 K) and casts to the weights'
    dtype itself; SwinIR casts its buffers (attention masks, position index lookups) at use, and the
    ViT's position embedding is a parameter (gathered in param_dtype).
    """
    d = cfg.dist
    if mesh is not None and d.hsdp_replicas > 1:
        raise ConfigError(f"hsdp_replicas {d.hsdp_replicas} is train_fsdp.py's: train_mp.py shards over all its "
                          "dp x cp ranks; use --hsdp_replicas 1")
    mesh = build_mesh(d.hsdp_replicas, device) if mesh is None else mesh
    reshard = d.reshard_after_forward if reshard_after_forward is None else reshard_after_forward
    for unit in ac_units(model, d.fsdp_unit, required=False):  # without units: the root alone
        fully_shard(unit, mesh=mesh, mp_policy=mixed_precision(d), reshard_after_forward=reshard)
        average_fsdp_gradients(unit, mesh)  # gloo before torch 2.9 sums them
    # Root: reshard_after_forward left to FSDP (False for the root: backward needs its weights first).
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision(d, cast_forward_inputs=False))
    average_fsdp_gradients(model, mesh)
    return model


# ----------------------------------------------------------------------------- memory report


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * t.element_size() for t in tensors)


def optimizer_state_bytes(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
    """Bytes of optimizer state on this rank: measured once it exists, else AdamW's 2 x parameters.

    AdamW allocates exp_avg and exp_avg_sq (each the size of the local shard) at its first step.
    """
    state = optimizer.state.values() if optimizer is not None else ()
    measured = _bytes(t for s in state for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    return measured or 2 * _bytes(model.parameters())


def memory_record(model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, step: int = 0,
                  activations_bytes: Optional[int] = None, model_bytes: Optional[int] = None) -> dict:
    """Metrics record (kind "memory") of parameters + gradients + optimizer state per rank vs DDP.

    Collective: every rank must call it. ``shards``: ranks that split the largest parameter (world
    size for FSDP, ranks per replica for HSDP, dp x cp x tp for a column-wise weight under
    train_mp.py). Sizes in MB (1e6 bytes), of the largest rank; total_mb_min is the smallest
    (shards differ by at most a row). ddp_total_mb is what each DDP rank holds: full fp32 copies of
    all three. ``activations_bytes`` (this rank's tensors saved for backward in one step, see
    utils.memory.measure.SavedTensorBytes) adds activations_mb, the largest rank's. All-gathered
    parameters and communication buffers come on top. ``model_bytes``: the whole model's parameter
    bytes where ``model`` holds only part of it (train_pp.py's stages).
    """
    params = _bytes(model.parameters())
    columns = [params, params, optimizer_state_bytes(model, optimizer), activations_bytes or 0]
    local = torch.tensor(columns, dtype=torch.float64)
    device = _local(next(model.parameters())).device
    world = dist.get_world_size() if dist.is_initialized() else 1
    gathered = [torch.zeros_like(local, device=device) for _ in range(world)]
    if world > 1:
        dist.all_gather(gathered, local.to(device))
    else:
        gathered[0] = local
    per_rank = torch.stack(gathered).cpu() / 1e6  # (ranks, [params, grads, optimizer, activations])
    states = per_rank[:, :3]
    if model_bytes is None:
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    full_params = model_bytes / 1e6
    ddp_total = 4 * full_params  # parameters + gradients + AdamW's two moments
    largest = states[states.sum(1).argmax()]
    record = {"kind": "memory", "step": step, "ranks": world, "shards": _shards(model),
              "params_mb": largest[0].item(), "grads_mb": largest[1].item(),
              "optimizer_mb": largest[2].item(), "total_mb": largest.sum().item(),
              "total_mb_min": states.sum(1).min().item(), "ddp_total_mb": ddp_total,
              "vs_ddp": largest.sum().item() / ddp_total}
    if activations_bytes is not None:
        record["activations_mb"] = per_rank[:, 3].max().item()
    return record


def _shards(model: nn.Module) -> int:
    """Ranks that split the largest parameter: the product of the mesh sizes along which it is sharded."""
    largest = max(model.parameters(), key=lambda p: p.numel())
    placements = getattr(largest, "placements", ())
    return math.prod(largest.device_mesh.size(i) for i, p in enumerate(placements) if p.is_shard())
