"""The model a checkpoint holds (utils/checkpoint/reading.py reads any kind), rebuilt from the checkpoint's own config.

Weights without a config (the original SwinIR's, SuperBench's, a bare state dict) are described by a named config
(``config_name``, from ``config_file`` if given). A checkpoint of a task the tool does not take is refused in one
line (ConfigError) before any weight is read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from models import ModelError, build_model, on_meta
from utils.checkpoint.files import CheckpointError
from utils.checkpoint.reading import Checkpoint, model_weights
from utils.checkpoint.state import strip_wrapper_prefixes
from utils.config import Config, ConfigError, build_config, load_named_configs


def config_from_checkpoint(saved: Checkpoint, overrides: dict, tasks: Sequence[str], need: str,
                           config_name: Optional[str] = None, config_file: Optional[Path] = None) -> Config:
    """The run's config: its named config with every recorded key as an override (mean, std and channel names are
    recorded already resolved from the data); for bare weights, ``config_name``'s (None: the tool takes none). A
    task not in ``tasks`` is refused with ``need`` (what the tool takes instead)."""
    if saved.config is None:
        if config_name is None:
            raise CheckpointError(f"checkpoint {saved.path} records no config: pass one written by the training "
                                  "scripts")
        if not config_name:
            raise CheckpointError(f"checkpoint {saved.path} records no config (the original SwinIR or SuperBench "
                                  "weights?): name the config that describes its model with --config NAME "
                                  "(and --config_file PATH for one of yours)")
        cfg = build_config(config_name, overrides, path=config_file)
    else:
        values = {**saved.config, **overrides}
        name = values.pop("config")
        # A run of --config_file names a config this folder lacks; every key is recorded, so any named base does.
        base = name if name in load_named_configs() else next(iter(load_named_configs()))
        try:
            cfg = build_config(base, values)
        except ConfigError as error:
            raise ConfigError(f"checkpoint {saved.path}: its config does not build with this code ({error})") from None
        cfg.name = name
    if cfg.data.task not in tasks:
        raise ConfigError(f"checkpoint {saved.path} is a {cfg.model.model} model for task {cfg.data.task!r} "
                          f"(config {cfg.name}); {need}")
    return cfg


def load_model(cfg: Config, saved: Checkpoint, device: torch.device) -> nn.Module:
    """The model ``cfg`` describes with the checkpoint's weights, strictly (a partial load would predict with
    random weights), in eval mode on ``device``."""
    model = build_model(cfg.model)
    weights = model_weights(saved, model)
    try:
        model.load_state_dict(strip_wrapper_prefixes(weights))
    except (RuntimeError, ValueError) as error:
        reason = " ".join(str(error).split())[:300]
        raise CheckpointError(f"checkpoint {saved.path}: its weights do not fit the model its config describes "
                              f"({reason})") from None
    return model.to(device).eval()


def output_shape(cfg: Config, shape: Sequence[int]) -> Optional[tuple[int, ...]]:
    """What the model makes of one input of ``shape`` (channels, *spatial), found on the meta device (no memory, no
    time); ModelError (one line) for a grid it cannot take; None where an operator has no meta kernel."""
    model = on_meta(lambda: build_model(cfg.model)).eval()
    try:
        with torch.no_grad():
            return tuple(model(torch.empty((1, *shape), device="meta")).shape[1:])
    except NotImplementedError:
        return None  # the first real forward will tell
    except Exception as error:  # noqa: BLE001 -- any model's own complaint about the shape
        grid = "x".join(map(str, shape[1:]))
        raise ModelError(f"the model of this checkpoint ({cfg.model.model_class}) cannot take a {grid} grid of "
                         f"{shape[0]} channels: {str(error).splitlines()[0][:200]}") from None
