"""Reading any checkpoint the scripts write, for predict.py and rollout.py: its config, step and weights, before a
model is built (the model itself: utils/predict/model.py).

- a run folder or its ``checkpoints/`` folder: the newest complete checkpoint of either kind;
- a ``step_N.pt`` file (train.py, train_ddp.py, an exported DCP folder);
- a DCP ``step_N`` folder of any layout (train_fsdp.py, train_mp.py's tp/cp, train_pp.py): every layout saves the
  whole model's parameter names, so DCP reads the full tensors into one plain model, the model entry alone
  (no optimizer state, no export to a temporary file);
- weights without a config (the original SwinIR's ``params`` / ``params_ema``, SuperBench's, a bare state
  dict).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from utils.checkpoint.files import (DCP_METADATA, CheckpointError, damage_in, latest_checkpoint,
                                    latest_sharded_checkpoint)
from utils.checkpoint.single import load_checkpoint
from utils.checkpoint.state import TrainState

WEIGHT_KEYS = ("model", "params_ema", "params", "model_state_dict", "state_dict")
"""Where a file's weights may lie: the scripts' checkpoints, then the original SwinIR's (EMA first), then others."""


@dataclass
class Checkpoint:
    """What a checkpoint holds, before a model is built: its config (flat, None for bare weights), its training
    step, and its weights (None for a DCP folder: read straight into the model)."""

    path: Path
    run_dir: Path
    config: Optional[dict]
    step: int
    weights: Optional[dict]


def find_checkpoint(path) -> tuple[Path, Path]:
    """(checkpoint, run_dir) for a run folder, its checkpoints/ folder, a .pt file or a DCP step folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no such checkpoint: {path}; pass a run folder, a step_N.pt file or a "
                              "train_fsdp.py step_N folder")
    checkpoint = path
    if path.is_dir() and not (path / DCP_METADATA).is_file():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        checkpoint = latest_checkpoint(folder) or latest_sharded_checkpoint(folder)
        if checkpoint is None:
            raise CheckpointError(f"{folder}: no checkpoint (step_N.pt or step_N/); train first, or pass a "
                                  "checkpoint file")
    run_dir = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent
    return checkpoint, run_dir


def read_checkpoint(path) -> Checkpoint:
    """The checkpoint at ``path`` (any of the module's kinds); its weights stay on disk for a DCP folder."""
    checkpoint, run_dir = find_checkpoint(path)
    if checkpoint.is_dir():
        saved = {"config": "", "train_state": asdict(TrainState())}
        _dcp_load(saved, checkpoint)  # two small entries: the weights are read once the model is built
        return Checkpoint(checkpoint, run_dir, json.loads(saved["config"] or "{}") or None,
                          int(saved["train_state"]["step"]), None)
    payload = load_checkpoint(checkpoint)
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint {checkpoint} holds a {type(payload).__name__}, not a dict of weights")
    step = int((payload.get("train_state") or {}).get("step", -1)) if isinstance(payload.get("train_state"), dict) else -1
    config = payload.get("config") if isinstance(payload.get("config"), dict) and payload["config"] else None
    weights = next((payload[k] for k in WEIGHT_KEYS if isinstance(payload.get(k), dict)), None)
    if weights is None and payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
        weights = payload  # a bare state dict
    if weights is None:
        raise CheckpointError(f"checkpoint {checkpoint} holds no model weights (none of {', '.join(WEIGHT_KEYS)}): "
                              "pass one written by the training scripts, or a state dict")
    return Checkpoint(checkpoint, run_dir, config, step, weights)


def model_weights(saved: Checkpoint, model: nn.Module) -> dict:
    """The checkpoint's weights for ``model``: a file's as read; a DCP folder's model entry read now into full tensors
    shaped as ``model``'s. Buffers a layout did not save (rebuilt from the config, as SwinIR's masks) keep the
    model's own values; a missing parameter is an error."""
    if saved.weights is not None:
        return saved.weights
    folder = saved.path
    stored = {key[len("model."):] for key in dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
              if key.startswith("model.")}
    state = model.state_dict()
    missing = [name for name, _ in model.named_parameters() if name not in stored]
    if missing:
        raise CheckpointError(f"checkpoint {folder}: no weights for {missing[0]} ({len(missing)} parameters in all): "
                              "it holds another model than its config describes")
    wanted = {name: tensor for name, tensor in state.items() if name in stored}
    _dcp_load({"model": wanted}, folder)
    return {**state, **wanted}


def _dcp_load(state: dict, folder: Path) -> None:
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
            dcp.load(state, checkpoint_id=str(folder))
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        reason = damage_in(error) or " ".join(str(error).split())[:200]
        raise CheckpointError(f"checkpoint {folder} cannot be read ({reason})") from None
