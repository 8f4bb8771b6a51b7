"""Scaling techniques, applied from outside to a plain model, always in this order (torchtitan's):

    tensor parallel -> context parallel -> keep_fp32 -> activation checkpointing -> torch.compile -> DDP / FSDP2

(tensor and context parallelism: utils/parallel/tensor_parallel.py, utils/parallel/context_parallel.py;
keep_fp32, the parts kept in fp32 under autocast: utils/precision.py; FSDP2: utils/parallel/fsdp.py.)

Each function takes the model and returns it (modified in place where possible), so a training
script reads ``model = apply_ac(model, ...); model = apply_compile(model, ...)`` and the model
code never mentions any of it. The "units" are the model's uniform block lists, named by its plan in
(its spec: models/spec.py): "block" (SwinIR's Swin transformer blocks, the ViT's transformer blocks, the
U-Net's levels) or, for SwinIR only, "layer" (every RSTB).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.nn.parallel import DistributedDataParallel

from utils.config import ConfigError
from utils.parallel.plans import ac_units

# The config keys this file applies, and the scripts that apply them: any other script refuses them set away
# from their defaults (utils/config.py reads every file's APPLIED_BY as a literal, without importing the file).
APPLIED_BY = {
    ("bucket_cap_mb", "broadcast_buffers", "static_graph", "no_ddp"): ("train_ddp.py",),
    "gradient_as_bucket_view": ("train_ddp.py", "estimate_memory.py"),
}


def apply_ac(model: nn.Module, mode: str) -> nn.Module:
    """Activation checkpointing per block ("block") or per SwinIR RSTB ("layer"); "none" does nothing.

    Non-reentrant checkpointing (the composable API) is the kind that works with DDP, FSDP2 and
    torch.compile, and it leaves parameter names unchanged, so checkpoints stay interchangeable
    between runs with and without it. Each unit keeps only its input for backward and recomputes
    its forward there: less memory for roughly one extra forward of compute.
    """
    if mode == "none":
        return model
    for unit in ac_units(model, mode):
        composable_checkpoint(unit)
    return model


def apply_compile(model: nn.Module, enabled: bool, backend: str = "inductor", cuda_graphs: bool = False,
                  call_is_step: bool = True) -> nn.Module:
    """torch.compile each block in place (``Module.compile``).

    Blocks share one code object, but dynamo specialises on their constants (SwinIR's shift, the
    drop-path probability) and their weights' shapes (the U-Net's levels), so it compiles one graph
    per distinct block. The recompile limit is raised to that count: at the default (8) the
    tutorial's 36 Swin blocks would silently run 28 of them eagerly. In-place compilation keeps
    parameter names free of ``_orig_mod.``.

    ``cuda_graphs``: inductor's reduce-overhead mode records each block's forward and backward kernels
    as CUDA graphs and replays them, one launch instead of hundreds: what small per-GPU batches need,
    where the CPU cannot queue kernels as fast as the GPU runs them. Each call of ``model`` then begins a new step of
    the graphs (:func:`begin_cuda_graph_step`); ``call_is_step=False`` where a step calls it several times before
    their backwards (a pipeline stage, once per microbatch): torch's own rule, a new step at a call with no backward
    pending, holds there.
    """
    if not enabled:
        return model
    if cuda_graphs and not on_cuda(model):
        raise ConfigError("cuda_graphs records CUDA kernels; this model is not on a CUDA device: drop --cuda_graphs "
                          "(or run on a GPU)")
    blocks = ac_units(model, "block", required=False) or [model]  # no units: the model as one
    # Each block may differ (a shifted window, a drop-path rate, a level's width) and compile once more for
    # validation (no_grad) and, under autocast, for an fp32 and a low-precision input: a limit per block.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(blocks))
    for block in blocks:
        block.compile(backend=backend, mode="reduce-overhead" if cuda_graphs else None)
    if cuda_graphs and call_is_step and blocks != [model]:  # (a model compiled whole is one graph call a step)
        model.register_forward_pre_hook(begin_cuda_graph_step)
    return model


def on_cuda(model: nn.Module) -> bool:
    return all(p.is_cuda for p in model.parameters())


def begin_cuda_graph_step(_module: nn.Module = None, _args=None) -> None:
    """A forward pre-hook: this call of the model is a new step for the CUDA graphs of its compiled blocks.

    Without it torch begins a new step at every call of a compiled block with no backward pending: in a validation
    forward (no_grad) each block's call released the previous block's output, its own input ("accessing tensor
    output of CUDAGraphs that has been overwritten by a subsequent run", on an H200, torch 2.11). Once marked, torch
    counts steps by the marks alone: so every call, training's too, is marked.
    """
    torch.compiler.cudagraph_mark_step_begin()


def apply_ddp(model: nn.Module, cfg, device: torch.device) -> nn.Module:
    """Wrap in DistributedDataParallel: gradients are averaged over ranks during backward.

    ``no_ddp`` returns the model unwrapped, so ranks skip the all-reduce and drift apart: only
    useful to measure what the communication costs (NERSC's sc22 tutorial does the same).
    Always call the *returned* model in the training step; calling the plain model under DDP
    silently skips the gradient synchronisation.
    """
    if cfg.dist.no_ddp:
        return model
    # Recent PyTorch renamed the per-forward buffer sync; either way buffers are synced once at construction.
    new_name = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    buffer_sync = {"forward_sync_buffers" if new_name else "broadcast_buffers": cfg.dist.broadcast_buffers}
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.dist.bucket_cap_mb,
        gradient_as_bucket_view=cfg.dist.gradient_as_bucket_view,
        static_graph=cfg.dist.static_graph,
        **buffer_sync,
    )
