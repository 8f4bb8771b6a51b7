"""What a checkpoint holds, built and restored here for every kind: single.py's files (train.py, train_ddp.py) and
sharded.py's DCP folders (train_fsdp.py, train_mp.py, train_pp.py).

Both hold the same entries: the model under its plain parameter names, the optimizer, scheduler and grad scaler,
where training is (:class:`TrainState`), every RNG state and the config. A technique that holds the model in parts
(pipeline stages) gives :func:`sharded_payload` the whole model's parameter names and its process group; it never
builds the contents itself.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Optional, Sequence

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from utils.checkpoint.state import (TrainState, capture_rng_state, check_model_settings, model_state,
                                    restore_rng_state, tensors_only)


def checkpoint_payload(model, optimizer, scheduler, scaler, state: TrainState, cfg) -> dict:
    """A single-file checkpoint's contents: everything a resumed run needs; the model under its plain (unwrapped)
    parameter names."""
    return {
        "model": model_state(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "train_state": asdict(state),
        "rng": capture_rng_state(),
        "config": cfg.to_dict(),
    }


def restore_payload(payload: dict, model, optimizer, scheduler, scaler, cfg=None,
                    path="the checkpoint") -> TrainState:
    """Load a single-file checkpoint's contents into the run's objects; with ``cfg``, first check that it
    builds the same model (one line naming the keys that differ, instead of load_state_dict's size mismatch)."""
    if cfg is not None:
        check_model_settings(payload.get("config", {}), cfg, path)
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    scaler.load_state_dict(payload["scaler"])
    restore_rng_state(payload["rng"])
    return TrainState(**payload["train_state"])


def sharded_payload(model, optimizer, scheduler, scaler, state: TrainState, cfg=None, *,
                    names: Optional[Sequence[str]] = None, group=None) -> dict:
    """What a resumed run needs, as a DCP state dict (the entries of train.py's checkpoints).

    Model and optimizer come from ``get_state_dict``: sharded tensors under plain parameter names,
    which is what lets DCP reshard them. The other entries are the same on every rank and DCP
    writes them once. The CUDA RNG states are a tuple and the config a JSON string because DCP
    loads such values whole, whatever their length or keys, so a run resumes on another GPU
    count or with a newer config schema.

    ``names``, ``group``: a model held in parts over ``group``'s ranks (pipeline stages), whose parameter names in
    order are ``names``. Each optimizer param group then lists the names of every part, in that order: DCP writes
    such a list once (rank 0's), so it must be the same on every rank; loading into any layout picks its own names
    from it. Collective over ``group``.
    """
    weights, optimizer_state = get_state_dict(model, optimizer)
    weights = tensors_only(weights)  # as the single files (a library's state_dict may hold more)
    if names is not None:
        groups = optimizer_state["param_groups"]
        gathered = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, [g["params"] for g in groups], group=group)
        for i, param_group in enumerate(groups):
            held = {name for per_rank in gathered for name in per_rank[i]}
            param_group["params"] = [name for name in names if name in held]
    rng = capture_rng_state()
    rng["cuda"] = tuple(rng.get("cuda", ()))
    return {"model": weights, "optimizer": optimizer_state, "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "train_state": asdict(state), "rng": rng,
            "config": json.dumps(cfg.to_dict() if cfg is not None else {})}


def restore_sharded_payload(payload: dict, model, optimizer, scheduler, scaler) -> TrainState:
    """Put a loaded DCP state dict (:func:`sharded_payload`'s entries, filled by ``dcp.load``) into the run's
    already sharded model and its optimizer, and the rest of the run's objects."""
    set_state_dict(model, optimizer, model_state_dict=payload["model"], optim_state_dict=payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    scaler.load_state_dict(payload["scaler"])
    restore_rng_state(payload["rng"])
    return TrainState(**payload["train_state"])
