"""What depends on the task, in one place: its baselines, its validation metrics and its picture.

The training scripts never branch on the model or the task; they do::

    task = build_task(cfg, device)
    result = task.evaluate(model, val_loader, device, amp_dtype, all_reduce)
    logger.log({"kind": "val", "step": step, **result.metrics})
    task.save_picture(path, result)

- ``sr`` (Part I, SwinIR): per-channel RMSE of the model and of bicubic interpolation of the same
  low-resolution inputs (the bar a super-resolution model must clear); picture: LR, bicubic,
  model, truth, error.
- ``forecast`` (Part II, the ViT): latitude-weighted RMSE and ACC per channel, of the model and of
  two baselines every forecaster is judged against: persistence (tomorrow = today) and the
  climatology (the training split's time-mean field, ``<data_dir>/stats/time_means.npy``);
  picture: input, truth, forecast and the errors of persistence and forecast.
- ``diagnostic`` (Part IV): fields computed from other fields of the same time (total column water vapour from the
  other 19 channels): latitude-weighted RMSE per target channel, of the model and of two baselines: a linear
  regression on the inputs fitted to the training split (what a network must beat to have learned more than a
  weighted sum) and the climatology; picture: baseline, truth, model and both errors.
- ``volume`` (Part III, the 3-D U-Net): per-channel L1 of the model and of the constant prediction of
  each target channel's mean over the training box (what a model must clearly beat to have learned
  anything); picture: the middle slice of inputs, truth, model and error.

All metrics are in physical units (for volumes: the stored, scaled fields) and independent of batching
and of the number of ranks. Under SwinIR's domain parallelism (``bands``) each rank evaluates its band
of every field, the metrics sum over the bands and the picture's sample is gathered band by band on the
first band's rank. A new task is one more class here and one branch in ``build_task``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from models import ModelError, build_model, load_model_class, on_meta, resolve, units_inside
from utils.config import ConfigError
from utils.data.common import DataError, evenly_spaced
from utils.data.era5 import ERA5Dataset, channel_sets, read_climatology
from utils.data.files import scan_split
from utils.data.volume import input_names, target_mean
from utils.observe.pictures import save_diagnostic_png, save_forecast_png, save_sample_png, save_volume_png
from utils.observe.scores import ACCAccumulator, L1Accumulator, RMSEAccumulator, bicubic_upsample, latitude_weights
from utils.parallel.domain_parallel import BICUBIC_REACH, gather_bands, halo
from utils.precision import autocast
from utils.stopping import heartbeat


@dataclass
class Evaluation:
    metrics: dict[str, list[float]]
    """Per-channel lists by name, e.g. {"rmse": [...], "bicubic_rmse": [...]} (the validation record)."""
    sample: tuple[torch.Tensor, ...]
    """The first validation sample's tensors for the picture, on the CPU."""


class Task:
    """Base of the tasks: the evaluation loop; subclasses say what to measure and draw."""

    name = ""
    bands = None
    """This rank's band of the fields (utils.parallel.domain_parallel.FieldBands) when they are split over ranks."""
    physical_units = True
    """The samples are in physical units (a model normalises them itself, from the mean and std it is given)."""
    other_outputs = False
    """The targets are other channels than the inputs: a physical-units model takes their out_mean and out_std."""

    def __init__(self, channel_names: list[str], key_channels: list[str]):
        self.channel_names = list(channel_names)
        self.key_channels = list(key_channels)

    def check_model(self, model_cfg, sample: tuple[torch.Tensor, torch.Tensor],
                    probe: Optional[nn.Module] = None) -> None:
        """The model contract of this task, at build time, each breach one line (ModelError): a model fed physical
        units takes both ``mean`` and ``std``, or neither (then the project standardises around it:
        models.units_inside), and, asked for other channels than it reads, ``out_mean`` and ``out_std`` too; a sample
        (input, target) of the data goes through the model to the target's shape (channels only for a rank's band).
        ``probe``: ``model_cfg``'s model on the meta device (no memory, no time, none of the real model's caches
        touched), which the scripts share with the FLOP count; None: built here."""
        inputs, target = sample
        name = model_cfg.model_class
        takes = resolve(model_cfg).named
        if self.physical_units and units_inside(takes):
            wanted = ("mean", "std", *(("out_mean", "out_std") if self.other_outputs else ()))
            missing = [n for n in wanted if n not in takes]
            if missing:
                raise ModelError(f"{name} takes {', '.join(n for n in wanted if n not in missing)} but not "
                                 f"{', '.join(missing)}: task {self.name} gives it physical units (z500 ~5e4, t2m ~280) "
                                 f"and wants {'other channels' if self.other_outputs else 'them'} back in their own "
                                 "units; take all of them and normalise inside, as models/common.py's "
                                 "PhysicalUnitsModel does, or none, and the project standardises around the model "
                                 "(docs/part4-your-model.md)")
        model = (probe if probe is not None else on_meta(lambda: build_model(model_cfg))).eval()
        try:
            with torch.no_grad():
                out = model(torch.empty((1, *inputs.shape), dtype=inputs.dtype, device="meta"))
        except NotImplementedError:
            return  # an operator without a meta kernel: the first step will tell
        except Exception as error:
            raise ModelError(f"{name} cannot take a sample of task {self.name}, shape (batch, "
                             f"{', '.join(map(str, inputs.shape))}): {str(error).splitlines()[0]}") from error
        got, want = tuple(out.shape[1:]), tuple(target.shape)
        if got != want and (self.bands is None or got[:1] != want[:1]):
            raise ModelError(f"{name} maps a sample of task {self.name} of shape {tuple(inputs.shape)} to {got}, but "
                             f"the targets are {want} (docs/part4-your-model.md: what each task feeds and expects)")

    def new_accumulators(self, channels: int, device: torch.device) -> dict:
        raise NotImplementedError

    def update(self, accumulators: dict, inputs: torch.Tensor, pred: torch.Tensor, target: torch.Tensor) -> None:
        raise NotImplementedError

    def picture_sample(self, inputs: torch.Tensor, pred: torch.Tensor, target: torch.Tensor) -> tuple:
        raise NotImplementedError

    def save_picture(self, path, evaluation: Evaluation) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def evaluate(self, model: nn.Module, loader, device: torch.device, amp_dtype: str,
                 all_reduce: bool = False) -> Evaluation:
        """Every metric of the task over the validation loader (all ranks together with ``all_reduce``)."""
        was_training = model.training
        model.eval()
        accumulators, sample, seen = None, None, 0
        padding_mask = getattr(loader.sampler, "padding_mask", None)
        for inputs, target in loader:
            heartbeat()  # a long validation is not a hang (utils.stopping.StepWatchdog)
            inputs, target = inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)
            with autocast(device, amp_dtype):  # every rank runs every batch: FSDP gathers in lockstep
                pred = model(inputs)
            pred = pred.float()
            if accumulators is None:
                accumulators = self.new_accumulators(target.shape[1], device)
                sample = tuple(self._on_cpu(t[0].detach()) for t in self.picture_sample(inputs, pred, target))
            if padding_mask is not None:  # leave out the repeats the sampler added to even out the ranks
                real = padding_mask(seen, len(inputs)).to(device)
                seen += len(inputs)
                inputs, pred, target = inputs[real], pred[real], target[real]
            if len(inputs):
                self.update(accumulators, inputs, pred, target)
        model.train(was_training)
        if accumulators is None:
            raise DataError("the validation split yielded no samples: check valid_split and val_samples")
        return Evaluation({key: acc.compute(all_reduce) for key, acc in accumulators.items()}, sample)

    def _on_cpu(self, field: torch.Tensor) -> torch.Tensor:
        """(C, H, W) on the CPU: the whole field on the first band's rank when the field is split into bands."""
        return field.cpu() if self.bands is None else gather_bands(field, 1, self.bands)


class SuperResolution(Task):
    """Part I: (low-res, high-res) pairs; the baseline is bicubic interpolation."""

    name = "sr"

    def __init__(self, channel_names: list[str], key_channels: list[str], upscale: int, bands=None):
        super().__init__(channel_names, key_channels)
        self.upscale, self.bands = upscale, bands

    def _bicubic(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.bands is None:
            return bicubic_upsample(inputs, self.upscale, size=target.shape[-2:])
        # A band's bicubic reads the neighbours' nearest rows; at the field's edges it clamps, as on one device.
        above = 0 if self.bands.first else BICUBIC_REACH
        extended = halo(inputs, BICUBIC_REACH, 2, self.bands, zeros_at_edges=False)
        return bicubic_upsample(extended, self.upscale).narrow(2, above * self.upscale, target.shape[2])

    def new_accumulators(self, channels: int, device: torch.device) -> dict:
        return {"rmse": RMSEAccumulator(channels, device), "bicubic_rmse": RMSEAccumulator(channels, device)}

    def update(self, accumulators, inputs, pred, target) -> None:
        accumulators["rmse"].update(pred, target)
        accumulators["bicubic_rmse"].update(self._bicubic(inputs, target), target)

    def picture_sample(self, inputs, pred, target) -> tuple:
        return inputs, self._bicubic(inputs, target), pred, target

    def save_picture(self, path, evaluation: Evaluation) -> None:
        save_sample_png(path, *evaluation.sample, self.channel_names)


class Forecast(Task):
    """Part II: (state t, state t + lead) pairs of whole fields; baselines persistence and climatology."""

    name = "forecast"

    def __init__(self, channel_names: list[str], key_channels: list[str], climatology: torch.Tensor,
                 row_weights: torch.Tensor):
        super().__init__(channel_names, key_channels)
        self.climatology = climatology  # (C, H, W), physical units
        self.row_weights = row_weights  # (H,), mean 1

    def new_accumulators(self, channels: int, device: torch.device) -> dict:
        if channels != self.climatology.shape[0]:
            raise DataError(f"the validation data has {channels} channels, the climatology {self.climatology.shape[0]}")
        rmse = lambda: RMSEAccumulator(channels, device, self.row_weights)  # noqa: E731
        acc = lambda: ACCAccumulator(self.climatology, self.row_weights, device)  # noqa: E731
        return {"rmse": rmse(), "acc": acc(), "persistence_rmse": rmse(), "persistence_acc": acc(),
                "climatology_rmse": rmse(), "climatology_acc": acc()}

    def update(self, accumulators, inputs, pred, target) -> None:
        climatology = self.climatology.to(target.device).expand_as(target)
        for prefix, forecast in (("", pred), ("persistence_", inputs), ("climatology_", climatology)):
            accumulators[f"{prefix}rmse"].update(forecast, target)
            accumulators[f"{prefix}acc"].update(forecast, target)

    def picture_sample(self, inputs, pred, target) -> tuple:
        return inputs, target, pred

    def save_picture(self, path, evaluation: Evaluation) -> None:
        shown = [self.channel_names.index(name) for name in self.key_channels[:2]] or None
        save_forecast_png(path, *evaluation.sample, self.channel_names, channels=shown)


class Diagnostic(Task):
    """Part IV: (input channels, target channels) of one time; baselines a linear regression and the climatology."""

    name = "diagnostic"
    other_outputs = True

    def __init__(self, channel_names: list[str], key_channels: list[str], climatology: torch.Tensor,
                 row_weights: torch.Tensor, linear: "LinearBaseline"):
        super().__init__(channel_names, key_channels)
        self.climatology, self.row_weights, self.linear = climatology, row_weights, linear  # targets' (C, H, W)

    def new_accumulators(self, channels: int, device: torch.device) -> dict:
        rmse = lambda: RMSEAccumulator(channels, device, self.row_weights)  # noqa: E731
        return {"rmse": rmse(), "linear_rmse": rmse(), "climatology_rmse": rmse()}

    def update(self, accumulators, inputs, pred, target) -> None:
        accumulators["rmse"].update(pred, target)
        accumulators["linear_rmse"].update(self.linear(inputs), target)
        accumulators["climatology_rmse"].update(self.climatology.to(target.device).expand_as(target), target)

    def picture_sample(self, inputs, pred, target) -> tuple:
        return self.linear(inputs), target, pred

    def save_picture(self, path, evaluation: Evaluation) -> None:
        shown = [self.channel_names.index(name) for name in self.key_channels[:2]] or None
        save_diagnostic_png(path, *evaluation.sample, self.channel_names, channels=shown)


class LinearBaseline:
    """targets ≈ A (inputs - mean) / std + b per pixel, fitted by weighted least squares (the validation's latitude
    weights) to ``FIT_SAMPLES`` samples spread over the training split: what a diagnostic network must beat to have
    learned more than a weighted sum of its inputs. Hand-written: torch has no weighted regression over a data set
    too large for memory, but its normal equations are (inputs + 1)² numbers."""

    FIT_SAMPLES = 64

    def __init__(self, dataset, mean: list[float], std: list[float], row_weights: torch.Tensor):
        self.mean = torch.tensor(mean, dtype=torch.float64).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float64).view(1, -1, 1, 1)
        n = len(mean) + 1
        gram, moment = torch.zeros(n, n, dtype=torch.float64), None
        weights = row_weights.to(torch.float64).view(1, -1, 1)
        for x, y in evenly_spaced(dataset, self.FIT_SAMPLES):
            design = self._design(x[None])[0].flatten(1)  # (inputs + 1, H*W)
            w = weights.expand(1, *x.shape[-2:]).flatten(1)
            gram += (design * w) @ design.T
            term = (design * w) @ y.to(torch.float64).flatten(1).T  # (inputs + 1, targets)
            moment = term if moment is None else moment + term
        # A tiny ridge keeps a constant input channel (zero variance after standardising) from making it singular.
        ridge = 1e-9 * gram.diagonal().mean() * torch.eye(n, dtype=torch.float64)
        self.coefficients = torch.linalg.solve(gram + ridge, moment).T.contiguous()  # (targets, inputs + 1)

    def _design(self, x: torch.Tensor) -> torch.Tensor:
        standard = (x.to(torch.float64) - self.mean.to(x.device)) / self.std.to(x.device)
        return torch.cat([standard, torch.ones_like(standard[:, :1])], dim=1)

    def __call__(self, inputs: torch.Tensor) -> torch.Tensor:
        design = self._design(inputs)
        out = torch.einsum("oi,bihw->bohw", self.coefficients.to(inputs.device), design)
        return out.to(torch.float32)


class Volume(Task):
    """Part III: (input, target) crops of a simulation box; the baseline predicts each target channel's mean."""

    name = "volume"
    physical_units = False  # the stored fields are scaled already (SC22's preprocessing)

    def __init__(self, channel_names: list[str], key_channels: list[str], target_mean: torch.Tensor,
                 input_names: list[str]):
        super().__init__(channel_names, key_channels)
        self.target_mean = target_mean  # (C,), the training box's
        self.input_names = list(input_names)

    def new_accumulators(self, channels: int, device: torch.device) -> dict:
        return {"l1": L1Accumulator(channels, device), "mean_l1": L1Accumulator(channels, device)}

    def update(self, accumulators, inputs, pred, target) -> None:
        accumulators["l1"].update(pred, target)
        mean = self.target_mean.to(target.device, target.dtype).view(1, -1, *[1] * (target.dim() - 2))
        accumulators["mean_l1"].update(mean.expand_as(target), target)

    def picture_sample(self, inputs, pred, target) -> tuple:
        return inputs, pred, target

    def save_picture(self, path, evaluation: Evaluation) -> None:
        save_volume_png(path, *evaluation.sample, self.input_names, self.channel_names)


def build_task(cfg, device: Optional[torch.device] = None, bands=None) -> Task:
    """The task of ``cfg.data.task`` (or ``task_class``, a subclass of it), with what it needs from the data (call
    after build_loaders, which fills in the channel names); ``bands``: the loaders give this rank's band of each
    field (task sr)."""
    d = cfg.data
    if d.task == "sr":
        return task_class(cfg, SuperResolution)(d.channel_names, d.key_channels, cfg.model.upscale, bands)
    if d.task in ("forecast", "diagnostic"):
        first = scan_split(Path(d.data_dir) / d.valid_split)[0]
        rows = first.height - 1  # the dataset drops the last latitude row
        climatology = torch.from_numpy(read_climatology(d.data_dir, first.channels, rows, first.width))
        weights = latitude_weights(first.height, rows)
    if d.task == "forecast":
        return task_class(cfg, Forecast)(d.channel_names, d.key_channels, climatology.to(device or "cpu"), weights)
    if d.task == "diagnostic":
        inputs, targets = channel_sets(cfg, first)
        climatology = climatology[targets]
        fit = ERA5Dataset(Path(d.data_dir) / d.train_split, task="diagnostic", crop_size=0, train=False,
                          inputs=inputs, targets=targets)
        linear = LinearBaseline(fit, cfg.model.mean, cfg.model.std, weights)
        return task_class(cfg, Diagnostic)(d.channel_names, d.key_channels, climatology.to(device or "cpu"), weights,
                                           linear)
    if d.task == "volume":
        return task_class(cfg, Volume)(d.channel_names, d.key_channels, torch.tensor(target_mean(cfg)),
                                       input_names(cfg))
    raise ValueError(f"unknown task {d.task!r}")


def task_class(cfg, built_in: type[Task]) -> type[Task]:
    """``built_in``, or the config's ``task_class``: a subclass of it from outside the repository (its own metrics,
    baselines and picture on the same data), found as model_class is found."""
    name = cfg.data.task_class
    if not name:
        return built_in
    chosen = load_model_class(name, cfg.model.model_path, key="task_class")
    if not (isinstance(chosen, type) and issubclass(chosen, built_in)):
        raise ConfigError(f"task_class {name} is not a subclass of {built_in.__module__}.{built_in.__name__}, the "
                          f"class of task {cfg.data.task}: subclass it and override what you change (new_accumulators, "
                          "update, save_picture; docs/part4-your-model.md)")
    return chosen
