"""Models of the tutorial, and the one way every model is built: the built-in ones and yours alike.

``build_model(cfg)`` imports what ``cfg.model_class`` names by import path, ``module:Class`` (a class or a function
that returns the model; a built-in model's name stands for the builder its spec names, e.g. ``models.swinir:build``:
each built-in model is a folder, ``models/<name>/``, with its network and its spec, models/spec.py), and calls it
with the keyword arguments it names among:

- the data's, the model contract (docs/part4-your-model.md): ``in_chans``, ``out_chans``, ``img_size`` (height,
  width), ``upscale``, ``mean`` and ``std`` (per channel, physical units: a model fed physical units normalises
  inside, as models/common.py's ``PhysicalUnitsModel`` does);
- for the models of this package, the config's model keys (``embed_dim``, ``depths``, ...: ``--embed_dim 16``);
- ``model_args``, your model's own arguments from the config (they win).

Then it checks what the techniques rely on: an ``nn.Module``, whose complex parameters (a spectral layer's weights,
as neuraloperator stores them) it stores as their real view, since fused AdamW, FSDP2 and DCP refuse complex ones
(:func:`store_complex_as_real`). Every breach is one line (:class:`ModelError`, exit code 2 in the scripts), not a
traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from .spec import ModelSpec, built_in, built_in_names, target_spec

# The built-in models (models/<name>/: the network and its spec) are imported where a config names them, not here:
# their specs' memory descriptions use the helpers of utils/, which import this module.
__all__ = ["ModelError", "build_model", "config_spec", "count_parameters", "fixed_input_size", "load_model_class",
           "on_meta"]

DATA_ARGS = ("in_chans", "out_chans", "img_size", "upscale", "mean", "std", "out_mean", "out_std")
"""What a model may take from the data (resolved from it before the model is built)."""


class ModelError(ValueError):
    """A model that cannot be built or breaks the contract, said in one line with the fix."""


def load_model_class(path: str, folder: str = "", key: str = "model_class") -> Callable[..., nn.Module]:
    """What ``module:Class`` names: the module on PYTHONPATH, or in ``folder`` (model_path: the config file's);
    ``key``: the config key that names it, for the errors (task_class finds a task the same way)."""
    module_name, _, name = path.partition(":")
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name.split(".")[0] and error.name != module_name:
            raise  # the module exists, and imports something that does not: its own traceback says what
        where = f" or in {folder}" if folder else ""
        raise ModelError(f"{key} {path}: no module {module_name!r} on PYTHONPATH{where}: set model_path to its "
                         "folder, or give the config with --config_file in that folder") from None
    target = getattr(module, name, None)
    if not callable(target):
        raise ModelError(f"{key} {path}: module {module_name} ({module.__file__}) has no class or function "
                         f"{name!r}")
    return target


def on_meta(model_fn: Callable[[], nn.Module]) -> nn.Module:
    """``model_fn()``'s model on the meta device: shapes without storage, built in no time and no memory."""
    try:
        with torch.device("meta"):
            return model_fn()
    except (NotImplementedError, RuntimeError):
        # The constructor read a tensor's values (e.g. torch.linspace(...).tolist()), which meta
        # tensors do not have: build on the CPU once, then drop the storage.
        return model_fn().to("meta")


def build_model(cfg) -> nn.Module:
    """The model described by ``cfg`` (a ``utils.config.ModelConfig``, or a whole ``Config``); see the module's text.

    mean/std must be set for a model that takes them (utils.data.era5.resolve_from_data fills them from the data's
    statistics)."""
    if not isinstance(getattr(cfg, "model", None), str):  # a whole Config: use its model section
        cfg = cfg.model
    if not cfg.model_class:
        raise ModelError(f"model {cfg.model!r}: model_class is empty; build the config with utils.config."
                         "build_config, which names the built-in models' classes")
    target = load_model_class(cfg.model_class, cfg.model_path)
    keys = {**dataclasses.asdict(cfg), "img_size": cfg.img_hw}
    offered = {name: keys[name] for name in DATA_ARGS}
    if cfg.model_class.startswith(f"{__name__}."):  # the built-in models read the config's own model keys
        offered.update({k: v for k, v in keys.items() if k not in ("model", "model_class", "model_path", "model_args")})
    takes = _arguments(target, cfg.model_class)
    wrong = sorted(set(cfg.model_args) - set(takes)) if None not in takes else []
    if wrong:
        raise ModelError(f"model_args {', '.join(wrong)}: not an argument of {cfg.model_class} (it takes "
                         f"{', '.join(n for n in takes if n) or 'none'})")
    kwargs = {**{k: v for k, v in offered.items() if k in takes or None in takes}, **cfg.model_args}
    if "mean" in kwargs and not kwargs["mean"]:
        raise ModelError("build_model: mean/std are empty; resolve them from the data first "
                         "(utils.data.era5.resolve_from_data) or set them in the config")
    missing = [n for n, required in takes.items() if n and required and n not in kwargs]
    if missing:
        raise ModelError(f"{cfg.model_class} needs {', '.join(missing)}: set them in model_args (the data gives only "
                         f"{', '.join(DATA_ARGS)})")
    try:
        model = target(**kwargs)
    except (TypeError, ValueError) as error:  # a constructor's own check of its arguments
        raise ModelError(f"{cfg.model_class}({_shown(kwargs)}): {str(error).splitlines()[0]}") from error
    check_contract(model, cfg.model_class)
    store_complex_as_real(model)
    return model


def check_contract(model: Any, name: str) -> None:
    """What every technique relies on, said at build time (not three layers down in fused AdamW or FSDP2)."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"{name} returned a {type(model).__name__}, not a torch.nn.Module")


class _ComplexFromReal(nn.Module):
    """The parametrization: the stored parameter is real (..., 2), the module reads a complex view of it."""

    def forward(self, real: torch.Tensor) -> torch.Tensor:
        return torch.view_as_complex(real)

    def right_inverse(self, value: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.view_as_real(value),)  # a sequence: parametrize lets only those change the dtype


def store_complex_as_real(model: nn.Module) -> list[str]:
    """Each complex parameter stored as its real view (``torch.nn.utils.parametrize``): fused AdamW, FSDP2's
    sharding and DCP see real numbers, while the model's own code, unchanged, still reads a complex tensor (a view
    of the same memory, no copy). AdamW on the real view is AdamW on the complex numbers (torch's own optimizer
    views them so). In checkpoints the weight is ``<module>.parametrizations.<name>.original0``. Returns the names."""
    names = [n for n, p in model.named_parameters() if p.is_complex()]
    for name in names:
        owner, _, attribute = name.rpartition(".")
        parametrize.register_parametrization(model.get_submodule(owner), attribute, _ComplexFromReal(), unsafe=True)
    return names


_REAL_VIEW = ".parametrizations."  # <owner>.parametrizations.<name>.original0: a complex parameter's real view


def complex_state_dict(state_dict: dict) -> dict:
    """A state_dict of :func:`store_complex_as_real`'s model with each real view back under its own name, complex:
    what the model's own class, built without this project, loads (``load_state_dict``)."""
    plain = {}
    for key, value in state_dict.items():
        owner, found, rest = f".{key}".partition(_REAL_VIEW)  # the leading dot: the root module's own parameters
        if found and rest.endswith(".original0"):
            plain[f"{owner}.{rest[:-len('.original0')]}"[1:]] = torch.view_as_complex(value.contiguous())
        else:
            plain[key] = value
    return plain


def _arguments(target: Callable, name: str) -> dict[Optional[str], bool]:
    """{argument name: required?} of a class's constructor or a function; the key None if it takes **kwargs."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        raise ModelError(f"model_class {name}: its arguments cannot be read (inspect.signature)") from None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes: dict[Optional[str], bool] = {p.name: p.default is inspect.Parameter.empty
                                        for p in parameters if p.kind in kinds}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        takes[None] = False
    return takes


def _shown(kwargs: dict) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k not in ("mean", "std"))
    return shown if len(shown) < 120 else shown[:117] + "..."


def config_spec(cfg) -> ModelSpec:
    """The spec (models/spec.py) of the model a config's model section builds: its module imported, as
    :func:`build_model` imports it, so that the spec registered beside the model is found."""
    if not cfg.model_class:  # a config not yet validated (validation fills in a built-in model's model_class)
        return built_in(cfg.model) if cfg.model in built_in_names() else ModelSpec(object)
    return target_spec(load_model_class(cfg.model_class, cfg.model_path))


def fixed_input_size(cfg) -> Optional[tuple[int, int]]:
    """(height, width) the model accepts and nothing else (the ViT: its position embedding), or None (any size)."""
    return cfg.img_hw if config_spec(cfg).fixed_input_size else None


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
