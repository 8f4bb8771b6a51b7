"""One description per model, beside the model: what the techniques and the tools need to know of it.

A :class:`ModelSpec` is registered once, where the model is defined: the built-in models from their own folders
(``models/swinir/spec.py``, ``models/vit/spec.py``, ``models/unet3d/spec.py``), a model of yours from the module
that ``model_class`` names (imported before anything reads the spec)::

    from models.spec import ModelPlan, ModelSpec, register
    register(ModelSpec(FNO2d, ModelPlan(units={"block": lambda model: model.blocks()})))

Nothing in ``utils/`` knows a model by its class or its name: the techniques read the spec's plan, the memory
estimate its memory description (or traces the model), the config checks its ``check``. A model without a spec gets
the default one: units from its ``blocks()`` if it has that method (the model contract, docs/part4-your-model.md),
else its top-level parts (:func:`top_level_parts`: a library's model, which has no ``blocks()``, still gets
activation checkpointing and FSDP2 units); the traced memory estimate; every task, the task's own check of the
contract deciding (utils/tasks.py: what the model takes, and one sample through it on the meta device).

The plan (:class:`ModelPlan`) says, for each technique (None: the technique refuses the model in one line):

- ``units``: the modules that activation checkpointing, torch.compile and FSDP2 wrap one by one, by unit
  name ("block": every transformer block or U-Net level; "layer": SwinIR's residual groups, RSTBs).
- ``tp``: the tensor-parallel plan (DTensor ``ParallelStyle`` per module name, which attention modules
  hold heads to split, and whether their q, k, v are one fused Linear).
- ``cp``: what context parallelism splits: tokens (:class:`TokenPlan`; the ViT: latitude bands of patch tokens,
  inside the model) or fields (:class:`FieldPlan`; SwinIR: latitude bands of the input field, with halos).
- ``stages``: where a pipeline may cut the model (the attribute holding its units, what the first stage
  keeps before them and the last after them).

This module imports nothing from ``utils/`` (the wall of models/): the spec is data the helpers read.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from torch import nn

UNITS = ("block", "layer")  # the unit names of the configs' ac and fsdp_unit keys
FIELD_TASKS = ("sr", "forecast", "diagnostic")  # the tasks of 2-D fields (the ERA5 layout)
TASKS = (*FIELD_TASKS, "volume")  # what a model trains on unless its spec says otherwise: any whose contract it meets


@dataclass(frozen=True)
class StagePlan:
    """Where a model is cut: the attribute holding its units, and what the first and last stages keep."""

    units: str
    stem: tuple[str, ...]
    tail: tuple[str, ...]


@dataclass(frozen=True)
class FusedQKV:
    """One attention whose q, k and v are one Linear, split by rows and regrouped by heads (tensor parallelism)."""

    qkv: Any
    """The Linear whose output columns are q | k | v, each ``heads`` x ``head_dim``."""
    heads: int
    head_dim: int
    by_head: Callable[[Any], None] = lambda mesh: None
    """tp mesh -> None: shards the attention's other per-head parameters over it (SwinIR's relative-position bias
    table), so that each rank holds those of its own heads."""


@dataclass(frozen=True)
class TensorParallelPlan:
    """How tensor parallelism splits a model (utils/parallel/tensor_parallel.py applies it)."""

    styles: Callable[[Any], dict]
    """model -> {module name: ParallelStyle} for ``parallelize_module``."""
    heads: Callable[[Any], list[int]]
    """The head count of each attention: every one must divide by tp (each rank holds whole heads)."""
    fused_qkv: Callable[[Any], list[FusedQKV]] = lambda model: []
    """model -> its attentions whose q, k and v are one Linear: split by rows, then regrouped by heads."""
    local_output: bool = False
    """Replicated modules hand plain tensors on (the model's code between layers expects them)."""


@dataclass(frozen=True)
class TokenPlan:
    """cp of the ViT's kind: how context parallelism splits a model's sequence of patch tokens into latitude bands
    (utils/parallel/context_parallel.py applies it)."""

    grid: Callable[[Any], tuple[int, int]]
    """model -> the (rows, columns) of its token grid: a band is whole rows."""
    first: Callable[[Any], Any]
    """model -> the module whose input, the (batch, tokens, channels) sequence, is cut to this rank's band."""
    gathered: Callable[[Any], list[Any]]
    """model -> the modules whose token outputs every band needs whole, all-gathered: each attention's keys and
    values, and the last (the head), after which every rank holds the whole field again."""


@dataclass(frozen=True)
class FieldPlan:
    """cp of SwinIR's kind: how domain parallelism splits a model's input field into latitude bands, with halos
    (utils/parallel/domain_parallel.py applies it; its 'same' 3x3 convolutions get halos without being named)."""

    rows: Callable[[dict], int]
    """The model's arguments (model_args) -> the rows a band is a multiple of (SwinIR: its attention window)."""
    shifted: Callable[[Any], list[Any]] = lambda model: []
    """model -> the shifted-window blocks: each has ``roll(x, shift)`` (its cyclic shift of (B, H, W, C)) and
    ``attention_mask(H, W, x)``, which the technique replaces by their band versions."""
    window: Callable[[Any], int] = lambda block: 1
    """A shifted-window block -> the rows of its window (its mask's windows)."""
    refuse: Callable[[Any], Optional[str]] = lambda model: None
    """model -> why this built model cannot be split (one line with the fix), or None."""


@dataclass(frozen=True)
class ModelPlan:
    """One model's parallel plan (the module docstring says what each field means); None: the technique refuses it."""

    units: dict[str, Callable[[Any], list[Any]]] = field(default_factory=dict)
    tp: Optional[TensorParallelPlan] = None
    cp: Optional[Union[TokenPlan, FieldPlan]] = None
    stages: Optional[StagePlan] = None


@dataclass(frozen=True)
class ModelSpec:
    """Everything the project's tools need of one model class (and its subclasses)."""

    model_class: type
    """The class the model is (a factory's: what its return annotation names)."""
    plan: ModelPlan = field(default_factory=ModelPlan)
    """What the parallel techniques split and wrap."""
    name: str = ""
    """A built-in model's name in the configs (``model: swinir``); yours is named in the config."""
    build: str = ""
    """A built-in model's ``module:function`` (or Class), called with the config's model keys."""
    memory: Union[str, type, None] = None
    """The hand-written memory description (``module:Class``, or the class; utils/memory/shapes.py says what it
    provides); None: the estimate traces the model (utils/memory/traced.py)."""
    fixed_input_size: bool = False
    """The model takes fields of its ``img_size`` and no other (the ViT: its position embedding)."""
    tasks: tuple[str, ...] = TASKS
    """The tasks it trains on (utils/tasks.py); by default every one, and the task checks the model's contract."""
    check: Optional[Callable[[Any], None]] = None
    """check(cfg): a ValueError, one line with the fix, for model keys that cannot work (a utils.config.Config)."""
    fp32_modules: tuple[str, ...] = ()
    """The parts that stay in fp32 under autocast with ``keep_fp32`` (utils/precision.py applies it): patterns
    (fnmatch's, on the names of ``named_modules()``: ``*norm*``, ``head``) of the modules whose rounding in bf16 costs
    skill: normalisations (statistics over many elements), the output head (the physical field's last digits),
    spectral layers (FFTs of a model of one's own). A pattern may match nothing in one configuration of the model."""
    fresh_caches: Optional[Callable[[], None]] = None
    """Empties what the model's module caches between calls (a memory measurement starts from nothing)."""
    flat_keys: tuple[str, ...] = ()
    """A built-in model's arguments that older versions took as flat config keys (``embed_dim: 16`` beside ``lr``):
    the configs and checkpoints that still hold them are read as its model_args (utils/config.py: fold_old_keys).
    Named here, not derived from the builder, so that a new argument never becomes one."""

    def memory_description(self) -> Optional[type]:
        """The memory description's class, imported if it is named by path."""
        if isinstance(self.memory, str):
            module, _, name = self.memory.partition(":")
            return getattr(importlib.import_module(module), name)
        return self.memory


_SPECS: dict[type, ModelSpec] = {}
_BY_NAME: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Declare a model's spec (for its class and subclasses); call it beside the model, once."""
    _SPECS[spec.model_class] = spec
    if spec.name:
        _BY_NAME[spec.name] = spec
    return spec


def register_plan(model_class: type, plan: ModelPlan) -> None:
    """Declare only the plan of ``model_class`` (the rest of its spec stays as it is, or the one it inherits)."""
    inherited = class_spec(model_class)
    named = inherited.model_class is model_class  # a subclass of a built-in model is not that model by name
    register(dataclasses.replace(inherited, model_class=model_class, plan=plan,
                                 **({} if named else {"name": "", "build": ""})))


def class_spec(model_class: type) -> ModelSpec:
    """The spec registered for the class (or a base class); else the default: units from its ``blocks()``, if it has
    that method, else its top-level parts."""
    for cls in model_class.__mro__:
        if cls in _SPECS:
            return _SPECS[cls]
    if callable(getattr(model_class, "blocks", None)):  # the contract's one optional method, not its internals
        return ModelSpec(model_class, ModelPlan(units={"block": lambda model: model.blocks()}))
    return ModelSpec(model_class, ModelPlan(units={"block": top_level_parts}))


def top_level_parts(model) -> list:
    """The units of a model that names none (no spec, no ``blocks()``), read from its module tree alone: its parts
    (:func:`_parts`), then, while one part holds more than half of the model's parameters, that part's own parts in
    its place, so that FSDP2 gathers no unit of nearly the whole model and activation checkpointing recomputes none.
    MONAI's UNet: its levels, down block and up block each, down to where the skip connections hold less than half;
    neuraloperator's FNO: lifting, each Fourier layer's spectral convolution, skip and channel MLP, projection;
    segmentation_models_pytorch's Unet: the encoder's stem and stages (the largest stage by its blocks), the decoder,
    the head. Each must be called by the model's forward: a part only read by another (a parameter holder) would
    stay sharded under FSDP2, and such a model names its units in a plan."""
    units, total = _parts(model), _size(model)
    while units:
        largest = max(units, key=_size)
        inner = _parts(largest)
        if 2 * _size(largest) <= total or len(inner) < 2:
            break
        at = next(i for i, unit in enumerate(units) if unit is largest)
        units[at:at + 1] = inner
    return units


def _parts(module) -> list:
    """The children of ``module`` that hold parameters (a container's, never called itself, in its place: a
    ModuleList, a ModuleDict); down a chain of single parts, those of the first module with several, or the chain's
    last module."""
    start = module
    while True:
        parts = _holding(module)
        if len(parts) != 1:
            return parts or ([module] if module is not start else [])
        module = parts[0]


def _holding(module) -> list:
    found = []
    for child in module.children():
        if _size(child):
            found.extend(_holding(child) if type(child).forward is nn.Module.forward else [child])
    return found


def _size(module) -> int:
    return sum(p.numel() for p in module.parameters())


def target_spec(target: Callable) -> ModelSpec:
    """The spec of what ``model_class`` names: a class, or a factory whose return annotation names the class."""
    if isinstance(target, type):
        return class_spec(target)
    returned = typing.get_type_hints(target).get("return")  # models.swinir:build says it returns a SwinIR
    return class_spec(returned if isinstance(returned, type) else object)


def built_in_names() -> list[str]:
    """The built-in models: the folders of this package (each registers its spec in its ``__init__``)."""
    return [m.name for m in pkgutil.iter_modules(importlib.import_module("models").__path__) if m.ispkg]


def built_in(name: str) -> ModelSpec:
    """The spec of the built-in model ``name`` (its folder imported: it registers itself)."""
    importlib.import_module(f"models.{name}")
    return _BY_NAME[name]


def old_flat_keys() -> frozenset[str]:
    """Every built-in model's :attr:`ModelSpec.flat_keys` (an old config's keys do not say which model they were for)."""
    return frozenset(key for name in built_in_names() for key in built_in(name).flat_keys)


def check_heads(cfg) -> None:
    """The checks of a transformer's embed_dim, depths and num_heads arguments (SwinIR's and the ViT's), for their
    specs (the config's model_args hold every argument by then: models.ResolvedModel.arguments)."""
    a = cfg.model.model_args
    depths, heads, dim = a["depths"], a["num_heads"], a["embed_dim"]
    if not dim > 0:
        raise ValueError(f"embed_dim must be > 0, got {dim}")
    if len(depths) != len(heads):
        raise ValueError(f"depths {depths} and num_heads {heads} must have the same length")
    if any(v <= 0 for v in depths + heads):
        raise ValueError(f"depths {depths} and num_heads {heads} must be > 0")
    if any(dim % h for h in heads):
        raise ValueError(f"embed_dim {dim} must be divisible by every num_heads {heads}")
    if [h for h in heads if h % cfg.dist.tp]:
        raise ValueError(f"num_heads {heads} must be divisible by tp {cfg.dist.tp}: each tensor-parallel "
                         "rank holds whole heads; use a tp that divides every num_heads")
