"""Models of the tutorial, and the one way every model is built: the built-in ones and yours alike.

``build_model(cfg)`` imports what ``cfg.model_class`` names by import path, ``module:Class`` (a class or a function
that returns the model; a built-in model's name stands for the builder its spec names, e.g. ``models.swinir:build``:
each built-in model is a folder, ``models/<name>/``, with its network and its spec, models/spec.py), and calls it
with the keyword arguments it names among:

- the data's, the model contract (docs/part4-your-model.md): ``in_chans``, ``out_chans``, ``img_size`` (height,
  width), ``upscale``, ``mean`` and ``std`` (per channel, physical units: a model fed physical units normalises
  inside, as models/common.py's ``PhysicalUnitsModel`` does; one that takes neither, a library's, is fed
  standardised fields and its outputs are turned back into physical units around it: :func:`units_inside`);
- ``model_args``, the model's own arguments (a built-in model's ``embed_dim``, ``depths``, ...:
  ``--model_args.embed_dim 16``), over its builder's defaults, as the config's validation typed and stored them
  (:meth:`ResolvedModel.arguments`).

What ``model_class`` names is imported and read once per process (:func:`resolve`): the config's checks, the builder,
the techniques' plans, the estimate and the task's contract all take it from there.

Then it checks what the techniques rely on: an ``nn.Module``, whose complex parameters (a spectral layer's weights,
as neuraloperator stores them) it stores as their real view, since fused AdamW, FSDP2 and DCP refuse complex ones
(:func:`store_complex_as_real`: models/adapt.py, which changes no class of the model). Every breach is one line
(:class:`ModelError`, exit code 2 in the scripts), not a traceback.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import yaml

from .adapt import complex_state_dict, copy_model, standardise_around, store_complex_as_real
from .spec import ModelSpec, built_in, built_in_names, target_spec

# The built-in models (models/<name>/: the network and its spec) are imported where a config names them, not here:
# their specs' memory descriptions use the helpers of utils/, which import this module.
__all__ = ["ModelError", "ResolvedModel", "build_model", "complex_state_dict", "config_spec", "copy_model",
           "count_parameters", "fixed_input_size", "load_model_class", "on_meta", "resolve", "store_complex_as_real",
           "units_inside"]

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
    found = resolve(cfg)
    target, takes = found.target, found.takes
    data = {**{name: getattr(cfg, name) for name in DATA_ARGS}, "img_size": cfg.img_hw}
    # The data's arguments go to the names the builder names; its **kwargs take model_args only: a library's class
    # hands them on to its parts (segmentation_models_pytorch's Unet to its encoder), which know none of these names.
    # model_args as the config's validation typed them and filled in the defaults (a constructor's refusal: below).
    kwargs = {**{k: v for k, v in data.items() if k in takes}, **cfg.model_args}
    if "mean" in kwargs and not kwargs["mean"]:
        raise ModelError("build_model: mean/std are empty; resolve them from the data first "
                         "(utils.data.era5.resolve_from_data) or set them in the config")
    try:
        model = target(**kwargs)
    except (TypeError, ValueError) as error:  # a constructor's own check of its arguments
        raise ModelError(f"{cfg.model_class}({_shown(kwargs)}): {str(error).splitlines()[0]}") from error
    check_contract(model, cfg.model_class)
    store_complex_as_real(model)
    if cfg.mean and not units_inside(takes):  # the data's statistics: a field task's physical units
        standardise_around(model, cfg.mean, cfg.std, cfg.out_mean, cfg.out_std)
    return model


def units_inside(takes) -> bool:
    """Whether a model whose builder names the arguments ``takes`` handles physical units itself, given the data's
    ``mean`` or ``std``; else the project standardises around it (models/adapt.py: ``standardise_around``)."""
    return "mean" in takes or "std" in takes


def check_contract(model: Any, name: str) -> None:
    """What every technique relies on, said at build time (not three layers down in fused AdamW or FSDP2)."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"{name} returned a {type(model).__name__}, not a torch.nn.Module")


@dataclass(frozen=True)
class ResolvedModel:
    """A config's model as found once per process (:func:`resolve`): what ``model_class`` names, the arguments its
    builder takes, and the module that holds it. Its spec is read from the registry each time (models/spec.py: a
    ``register_plan`` after the import lands there), which costs a lookup, not an import."""

    target: Callable[..., nn.Module]
    takes: dict[Optional[str], Any]
    """{argument name: its default (inspect.Parameter.empty: required)}; the key None if it takes **kwargs."""
    module: Any

    @property
    def spec(self) -> ModelSpec:
        return target_spec(self.target)

    @property
    def named(self) -> set[str]:
        """The names of the arguments the builder names (the data's go to these alone)."""
        return {name for name in self.takes if name}

    @property
    def accepted(self) -> Optional[set[str]]:
        """The names of the arguments the builder takes (None: any, it takes **kwargs)."""
        return None if None in self.takes else self.named

    def arguments(self, model_args: dict[str, Any], name: str) -> dict[str, Any]:
        """``model_args`` over the builder's defaults (those that are plain values: numbers, strings, lists; another
        default, an object, stays the builder's own), typed as the defaults are, the data's arguments left to the
        data: what the config's validation stores back, so that a config (and a checkpoint) names the whole model.

        ModelError, in one line, for an argument the builder does not take, one it needs that is not given, or a
        value of another kind than its default (a list for a number); ``name``: the model_class, for the errors."""
        takes = self.takes
        wrong = sorted(set(model_args) - set(takes)) if None not in takes else []
        if wrong:
            raise ModelError(f"model_args {', '.join(wrong)}: not an argument of {name} (it takes "
                             f"{', '.join(n for n in takes if n and n not in DATA_ARGS) or 'none'})")
        defaults = {n: _plain(d) for n, d in takes.items() if n and n not in DATA_ARGS and _plain(d) is not _NOT_PLAIN}
        args = {**defaults, **{n: _typed(n, v, takes.get(n, _EMPTY)) for n, v in model_args.items()}}
        missing = [n for n, d in takes.items() if n and d is _EMPTY and n not in args and n not in DATA_ARGS]
        if missing:
            raise ModelError(f"{name} needs {', '.join(missing)}: set them in model_args (the data gives only "
                             f"{', '.join(DATA_ARGS)})")
        return args


_RESOLVED: dict[tuple[str, str], ResolvedModel] = {}


def resolve(cfg) -> ResolvedModel:
    """The model a config's model section names, imported and read once per process (``load_model_class`` once per
    model_class and folder): the config's validation, the builder, the techniques, the estimate and the task's
    checks all take it from here. Found again only if its module left ``sys.modules`` (a test that imports it anew)."""
    key = (cfg.model_class, cfg.model_path)
    found = _RESOLVED.get(key)
    if found is None or sys.modules.get(found.module.__name__) is not found.module:
        target = load_model_class(*key)
        module = sys.modules[cfg.model_class.partition(":")[0]]
        found = _RESOLVED[key] = ResolvedModel(target, _arguments(target, cfg.model_class), module)
    return found


_EMPTY, _NOT_PLAIN = inspect.Parameter.empty, object()


def _plain(value: Any) -> Any:
    """``value`` as a config holds it (a tuple as a list), or _NOT_PLAIN if YAML cannot hold it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(_plain(v) is v for v in value):
        return list(value)
    return _NOT_PLAIN


def _typed(name: str, value: Any, default: Any) -> Any:
    """``value`` checked against the kind of the argument's default (a whole number for a float's is that float)."""
    if default is _EMPTY or default is None or value is None:
        return value
    kinds = [(bool, "true or false"), (int, "a whole number"), (float, "a number"), (str, "a string"),
             ((list, tuple), "a list")]
    kind, said = next(((k, s) for k, s in kinds if isinstance(default, k)), (None, ""))
    if isinstance(value, str) and kind not in (None, str):  # a command line's text: YAML's syntax, or 2,2 for a list
        try:
            items = value.strip().removeprefix("[").removesuffix("]").split(",")
            value = [yaml.safe_load(v) for v in items if v.strip()] if kind == (list, tuple) else yaml.safe_load(value)
        except yaml.YAMLError:
            pass  # said below, as a value of the wrong kind
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return list(value) if kind == (list, tuple) else value
    raise ModelError(f"model_args.{name}: expected {said} (its default is {default!r}), got {value!r}")


def _arguments(target: Callable, name: str) -> dict[Optional[str], Any]:
    """{argument name: its default (inspect.Parameter.empty: required)} of a class's constructor or a function; the
    key None if it takes **kwargs."""
    try:
        parameters = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        raise ModelError(f"model_class {name}: its arguments cannot be read (inspect.signature)") from None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes: dict[Optional[str], Any] = {p.name: p.default for p in parameters if p.kind in kinds}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        takes[None] = None
    return takes


def _shown(kwargs: dict) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k not in ("mean", "std"))
    return shown if len(shown) < 120 else shown[:117] + "..."


def config_spec(cfg) -> ModelSpec:
    """The spec (models/spec.py) of the model a config's model section builds: its module imported, as
    :func:`build_model` imports it, so that the spec registered beside the model is found."""
    if not cfg.model_class:  # a config not yet validated (validation fills in a built-in model's model_class)
        return built_in(cfg.model) if cfg.model in built_in_names() else ModelSpec(object)
    return resolve(cfg).spec


def fixed_input_size(cfg) -> Optional[tuple[int, int]]:
    """(height, width) the model accepts and nothing else (the ViT: its position embedding), or None (any size)."""
    return cfg.img_hw if config_spec(cfg).fixed_input_size else None


def count_parameters(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
