"""What a hand-written memory description provides, and the model's input size, read from the config.

A model's spec (models/spec.py) may name a hand-written memory description: a :class:`MemoryDescription` built from
the config's model section, beside the model (the built-in ones: ``models/swinir/memory.py``,
``models/vit/memory.py``, ``models/unet3d/memory.py``). It gives the exact parameter counts (and the parameter
tensors AdamW keeps a step count for), the parameters of each FSDP unit and pipeline unit, what tensor parallelism
splits, the linear/conv weights whose autocast copies stay saved, which ``ac``/``fsdp_unit`` settings the model
supports, its training graph (what each layer saves for backward, in the vocabulary of :mod:`utils.memory.graphs`)
and what its model parallelism communicates; :func:`model_shape` builds the config's. A model without one is traced
(utils/memory/traced.py). :func:`input_size` is the size of the model's input: a super-resolver's low-res crop or
whole field, a forecaster's img_size, a volume's cube.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from models import config_spec
from utils.config import Config, ConfigError
from utils.data.common import DataError
from utils.data.files import scan_split

ERA5_FIELD = (720, 1440)  # SuperBench's 721 x 1440 with the last latitude row dropped


# =============================================================================================
# A hand-written description
# =============================================================================================


def conv_params(cin: int, cout: int, k: int = 3) -> tuple[int, int]:
    """(weights that autocast casts, all parameters) of a conv or linear layer with bias."""
    return cin * cout * k * k, cin * cout * k * k + cout


def add_params(*parts: tuple[int, int]) -> tuple[int, int]:
    """The sum of :func:`conv_params` pairs."""
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


@dataclass
class ActivationGraph:
    """One microbatch's training graph on one rank, and how its tensors are typed (for the printout)."""

    graph: list
    """The layers in forward order (utils.memory.graphs.Layer)."""
    precision: str
    """How the saved tensors are typed, in words."""
    weight_copies: bool
    """Autocast saves a low-precision copy of each linear/conv weight it casts."""
    kernel: str
    """The attention (or convolution) kernel the graph assumes."""
    input_size: tuple[int, ...]
    """The rank's input (its band of rows under cp), before padding."""
    padded: tuple[int, ...]
    """The same, padded as the model pads it."""
    tokens: int
    """Positions (pixels, patches, voxels) the rank's whole batch holds."""
    setting: dict = field(default_factory=dict)
    """What the printout adds about the input (the field and where its size came from, the patch size, ...)."""


@dataclass(frozen=True)
class Traffic:
    """What a model's tensor or context parallelism sends per step, said in bytes and ranks, not seconds: the planner
    times it on a cluster's links (utils/plan/comm.py: ``traffic_seconds``), the estimate needs no link."""

    term: str
    """Its name in the plan's breakdown (traffics of one name add up to one term)."""
    group: str
    """The ranks it runs over: "tp" or "cp"."""
    kind: str
    """"all-reduce"; "all-gather" (or reduce-scatter: the same ring steps); "exchange": point-to-point messages."""
    nbytes: float
    """A collective's full (gathered) size; an exchange's: all its messages' bytes together."""
    count: int = 1
    """How many such collectives a step runs; an exchange's: how many messages (each pays the link's latency)."""


MEASURED_ON_CPU = "exact (measured on CPU)"
"""A built-in description's activations on CPU: its graph was measured there, op by op (utils/memory/measure.py)."""


class MemoryDescription:
    """What a hand-written description provides; subclasses are frozen dataclasses of the model's sizes.

    A subclass sets ``name`` and implements ``from_config``, the parameter counts, ``cast_weights`` and
    ``activation_graph``; the rest have defaults for a model that no technique splits further."""

    name = "model"

    activations_accuracy = {"cpu": "as described (not measured here)", "cuda": "as described (not measured here)"}
    """What the activations row promises, per device type, beside the figure: a built-in model's were measured (its
    memory.py says how close they came)."""

    def input_line(self, s: dict) -> str:
        """The table's line about the input of one rank (``s``: the estimate's setting); a description with more to
        say of it (windows and their padding, tokens, crops) says it in its own words."""
        return (f"  input {'x'.join(map(str, s['lr_input']))}{' (the largest band)' if 'cp' in s else ''}, "
                f"batch {s['batch_per_rank']} per rank; device {s['device_type']}; {s['precision']}; "
                f"activation checkpointing {s['ac']}")

    @classmethod
    def from_config(cls, model_cfg, target_chans: Optional[int] = None) -> "MemoryDescription":
        """The description of the config's model section; ``target_chans``: the channels of its output."""
        raise NotImplementedError

    def num_params(self) -> int:
        raise NotImplementedError

    def num_param_tensors(self) -> int:
        """Parameter tensors: AdamW keeps a step count each."""
        raise NotImplementedError

    def fsdp_units(self, unit: str) -> list[int]:
        """Parameters of each FSDP unit (the root keeps the rest)."""
        raise NotImplementedError

    def cast_weights(self, ac: str) -> int:
        """Linear/conv weights whose autocast copies stay saved: those used outside checkpointed units."""
        raise NotImplementedError

    def activation_graph(self, cfg, device_type: str, param_dtype: str, batch: int, graph_batch: int,
                         field: Optional[tuple[int, int]], lr_size: Optional[tuple[int, int]], tp: int,
                         cp: int) -> ActivationGraph:
        """The graph of one microbatch of ``graph_batch`` samples (``batch``: the rank's, for ``tokens``)."""
        raise NotImplementedError

    def check_supported(self, ac: str = "none", fsdp_unit: str = "block") -> None:
        """ConfigError for an ``ac``/``fsdp_unit`` (or model key) the description cannot describe."""

    def unsplit_params(self) -> int:
        """Parameters in tensors whose first dimension is 1, which FSDP2 cannot split."""
        return 0

    def pipeline_units(self) -> tuple[list[int], int, int]:
        """(parameters of each unit a pipeline cuts at, of what the first stage keeps before them, of what the last
        keeps after them); no units: the model has no pipeline plan."""
        return [], 0, 0

    def tp_split_params(self) -> int:
        """Parameters tensor parallelism splits over its ranks."""
        return 0

    def without_sequence_parallelism(self) -> "MemoryDescription":
        """The description of the model under tensor parallelism that keeps the residual stream and the norms whole
        on every tp rank (Megatron's all-reduces, as published runs use it; plan.py models such layouts, which the
        scripts do not run). A description whose tensor parallelism already does so (SwinIR's) is itself."""
        return self

    def adjust_held(self, parts: dict[str, float], graph: ActivationGraph, cp: int) -> None:
        """Corrects the held activations per part where the graph of one band is not the whole story (halos)."""

    def model_parallel_traffic(self, tp: int, cp: int, cfg, replica_batch: int, a: int) -> list[Traffic]:
        """What tensor and context parallelism send per step (``a``: bytes per activation element); the planner
        times it."""
        return []

    def boundary_bytes(self, cfg, micro: int, a: int) -> float:
        """Bytes a pipeline stage sends the next one per microbatch."""
        return 0.0


def has_description(model_cfg) -> bool:
    """Whether the config's model has a hand-written description (else the estimate traces it:
    utils/memory/traced.py)."""
    return config_spec(model_cfg).memory is not None


def model_shape(model_cfg, target_chans: Optional[int] = None) -> MemoryDescription:
    """The hand-written description of the config's model (its spec's ``memory``); ``target_chans``
    (``Config.target_chans``): the channels of its output."""
    described = config_spec(model_cfg).memory_description() if has_description(model_cfg) else None
    if described is None:
        raise ConfigError(f"model {getattr(model_cfg, 'model', None)!r} has no hand-written memory description "
                          "(a spec's memory: models/spec.py): use the traced estimate (utils/memory/traced.py)")
    return described.from_config(model_cfg, target_chans)


# =============================================================================================
# Input geometry
# =============================================================================================


def field_size_of(cfg: Config) -> tuple[tuple[int, int], str]:
    """High-res whole-field size when crop_size is 0, and where it came from: the data's grid if
    the training split exists, else ERA5's 720 x 1440."""
    split = Path(cfg.data.data_dir) / cfg.data.train_split
    try:
        first = scan_split(split)[0]
    except DataError:
        return ERA5_FIELD, f"ERA5's grid ({split} has no data; --field HxW sets another)"
    return (first.height - 1, first.width), f"the grid of {first.path}"  # the dataset drops the last row


def lr_input_size(cfg: Config, field: Optional[tuple[int, int]] = None) -> tuple[int, int]:
    """Height and width of the model's input: the low-res crop, or the low-res whole field."""
    hr = (cfg.data.crop_size, cfg.data.crop_size) if cfg.data.crop_size else (field or field_size_of(cfg)[0])
    if cfg.data.task in ("forecast", "diagnostic"):
        return hr
    s = cfg.model.upscale
    if hr[0] % s or hr[1] % s:
        raise ConfigError(f"the high-res size {hr[0]}x{hr[1]} is not divisible by upscale {s}")
    return hr[0] // s, hr[1] // s


def input_size(cfg: Config, field: Optional[tuple[int, int]] = None) -> tuple[int, ...]:
    """Spatial size of the model's input, by task (any model's, as the contract says): a forecaster's img_size (the
    field it is given; the ViT's only size), a super-resolver's low-res input, a volume's crop (side, side, side)."""
    if cfg.data.task in ("forecast", "diagnostic"):
        return cfg.model.img_hw
    if cfg.data.task == "volume":
        return (cfg.data.crop_size,) * 3
    return lr_input_size(cfg, field)
