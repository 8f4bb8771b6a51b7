"""Named YAML configs -> typed dataclasses, with any key overridable on the command line.

Every ``config/*.yaml`` holds named configs (``swinir.yaml``: Part I, ``vit.yaml``: Part II); names
are unique across the files, so ``--config NAME`` finds any of them. Each config is a flat mapping, but for
``model_args`` (the model's own arguments, its builder's), that may start from another one of its file with YAML's
merge key (``<<: *base``), as in NERSC's tutorials. A script does::

    cfg = parse_config(description=__doc__)            # --config NAME plus --any_key VALUE

and gets a :class:`Config` whose sections (``cfg.data``, ``cfg.model``, ``cfg.train``,
``cfg.dist``, ``cfg.profile``, ``cfg.ensemble``) are dataclasses with one documented field per key. Keys are
unique across sections, so the command line and the YAML stay flat: ``--batch_size 4``; a model's argument is
``--model_args.NAME VALUE``.
Unknown keys, unknown config names and values of the wrong type are errors that say what is valid.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import math
import re
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from utils.cli import OneLineParser
from utils.config_checks import built_in_flat_keys, take_channel_sets, validate
from utils.config_files import (CONFIG_DIR, BASE_KEY, ConfigError, fold_into_model_args, load_named_configs,
                                named_config, names_another_model)

# Where configs come from (utils/config_files.py) and their value checks (utils/config_checks.py), for importers:
__all__ = ["CONFIG_DIR", "ConfigError", "load_named_configs", "validate"]


@dataclass
class DataConfig:
    data_dir: str = "datasets/era5"
    """Root of the data: holds one folder per split with one HDF5 file per year."""
    train_split: str = "train"
    """Folder under data_dir with the training files."""
    valid_split: str = "valid_1"
    """Folder under data_dir with the validation files."""
    task: Literal["sr", "forecast", "diagnostic", "volume"] = "sr"
    """sr: (low-res, high-res) pairs; forecast: (sample t, sample t+lead) pairs of one file; diagnostic: (input_channels,
    target_channels) of one sample (Part IV); volume: cubic crops of (input, target) fields of one simulation box (Part
    III, utils/data/volume.py)."""
    lead: int = 1
    """forecast: steps between input and target (NERSC's 6-hourly data: 1 = six hours ahead)."""
    task_class: str = ""
    """Your task: a subclass of the built-in task's class (utils/tasks.py: SuperResolution, Forecast, Diagnostic,
    Volume) by import path module:Class, found as model_class is (model_path): its own metrics, baselines and picture
    on the task's data; empty: the built-in one."""
    input_channels: list[str] = field(default_factory=list)
    """diagnostic: the channels the model reads, by the data's names (e.g. all but tcwv); in_chans and mean/std
    follow (a base config's give way; one said beside them must agree)."""
    target_channels: list[str] = field(default_factory=list)
    """diagnostic: the channels it computes from them at the same time (e.g. [tcwv]); out_chans, out_mean/out_std,
    channel_names and key_channels follow, as in_chans does input_channels."""
    channel_names: list[str] = field(default_factory=list)
    """Names of the data's channels in order; empty = the files' 'channels' attribute, else channel 0, 1, ...
    diagnostic and volume: the targets' names (the channels the metrics are reported for)."""
    key_channels: list[str] = field(default_factory=list)
    """Channels the console line and the validation picture show (all are in metrics.jsonl and TensorBoard); empty = all on the console, the first two in forecast pictures."""
    crop_size: int = 128
    """High-resolution crop side in pixels; 0 trains on whole 720x1440 fields. volume: side of the cubic crops (SC22: 64)."""
    n_patches: int = 8
    """Random crops per day and epoch (SuperBench uses 8); ignored for whole fields."""
    num_workers: int = 4
    """DataLoader worker processes per rank (0 loads in the training process)."""
    pin_memory: bool = True
    """Page-locked host buffers for faster host-to-GPU copies (ignored on CPU)."""
    persistent_workers: bool = True
    """Keep workers (and their open HDF5 files) alive between epochs."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    drop_last: bool = True
    """Drop the last incomplete training batch so every step has the full global batch."""
    train_samples: int = 0
    """Training samples used, evenly spaced over the split (0 = all; NERSC's limit_nsamples). volume: random crops
    per epoch (SC22: 65,536; 0 = as many as tile the box)."""
    val_samples: int = 64
    """Validation samples evaluated at each validation, evenly spaced (0 = the whole split). volume: fixed random
    crops (0 = the crops that tile the box, every voxel once)."""
    val_batch_size: int = 0
    """Validation batch size per rank; 0 = the training batch size per rank."""
    device_transforms: bool = False
    """Move the input pipeline's work onto the training device (Step 0c): sr, the loader hands out high-res fields
    only and the low-res input is downsampled on the device, one batch at a time; volume, the host augmentation
    runs there (as augment device); forecast, nothing to move (the normalisation is inside the model already)."""
    prefetch_to_device: bool = False
    """Copy the next training batch to the GPU on a side CUDA stream while the current step computes (with
    pin_memory the copy overlaps the step); on a CPU the batches pass through unchanged."""
    augment: Literal["none", "host", "device"] = "host"
    """volume: each training crop turned by one of the cube's 48 rotations and reflections, the same for input and
    target, in the loader (host, SC22's PyTorch loader) or after the copy to the device (device, SC22's DALI)."""


@dataclass
class ModelConfig:
    model: str = "swinir"
    """The model's name: a built-in one (swinir: Part I, vit: Part II, unet3d: Part III), built from the keys below,
    or yours, with model_class (docs/part4-your-model.md)."""
    model_class: str = ""
    """Your model: the class (or function) to call, by import path module:Class, the module on PYTHONPATH or beside
    the config file; empty for a built-in model (its own path, models.vit:build, ...)."""
    model_path: str = ""
    """Folder that holds model_class's module, if it is not on PYTHONPATH (default: the folder of --config_file);
    kept in checkpoints, so that rollout.py and a resume find the model again."""
    model_args: dict[str, Any] = field(default_factory=dict)
    """The model's own arguments, a built-in model's (its builder's, e.g. models/swinir/network.py build) as
    yours: --model_args.NAME VALUE sets one; the config holds every one, its builder's defaults
    filled in. The data's (in_chans, out_chans, img_size, upscale, mean, std) come by name, not through here."""
    upscale: int = 2
    """SwinIR: super-resolution factor; the data's low-res input is the high-res field downsampled by it."""
    in_chans: int = 3
    """Input and output channels; must equal the data's (SuperBench: 3, NERSC's ERA5: 20). U-Net: input channels (SC22: 4);
    task diagnostic: len(input_channels) (set from them)."""
    out_chans: int = 5
    """U-Net: output channels, the target fields (SC22: 5); task diagnostic: len(target_channels) (set from them);
    SwinIR and the ViT otherwise output in_chans."""
    img_size: list[int] = field(default_factory=lambda: [64])
    """Input size [height, width] ([S] = SxS). ViT: sizes the position embedding, inputs must have it; SwinIR: the low-res size the original expects, any input works."""
    mean: list[float] = field(default_factory=list)
    """Per-channel mean subtracted inside the model; empty = <data_dir>/stats/global_means.npy (NERSC's layout)."""
    std: list[float] = field(default_factory=list)
    """Per-channel std divided inside the model; empty = <data_dir>/stats/global_stds.npy."""
    out_mean: list[float] = field(default_factory=list)
    """The outputs' per-channel mean, where they are other channels than the inputs (task diagnostic): the model
    de-normalises with it; empty = mean (or, for diagnostic, the target channels' from <data_dir>/stats)."""
    out_std: list[float] = field(default_factory=list)
    """The outputs' per-channel std (see out_mean)."""

    @property
    def img_hw(self) -> tuple[int, int]:
        """img_size as (height, width): [S] means S x S."""
        size = self.img_size
        return (size[0], size[0]) if len(size) == 1 else (size[0], size[1])


@dataclass
class TrainConfig:
    seed: int = 0
    """Seed for weights, data order and crops: same seed, same run."""
    batch_size: int = 16
    """Global batch size: summed over all ranks (each takes batch_size / world_size)."""
    epochs: int = 2
    """Passes over the training set (unless max_steps is set)."""
    max_steps: int = 0
    """Total optimizer steps; overrides epochs when > 0."""
    lr: float = 8e-4
    """AdamW learning rate for the global batch_size."""
    weight_decay: float = 1e-6
    """AdamW weight decay (0 makes it Adam)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """Adam(W) moment decay rates (NERSC's ViT: [0.9, 0.95])."""
    lr_schedule: Literal["exponential", "cosine"] = "exponential"
    """exponential: lr_gamma once per epoch; cosine: from lr to 0 over all steps, per step (after warm-up)."""
    lr_gamma: float = 0.97
    """exponential schedule: decay applied once per epoch."""
    loss: Literal["l1", "mse", "relative_l2", "crps"] = "l1"
    """Training loss; relative_l2 = batch mean of ||pred - target|| / ||target|| per sample (NERSC's ViT); crps: the
    (almost) fair CRPS of the ensemble members of each sample against its target, per cell (needs ensemble >= 2)."""
    ensemble: int = 1
    """Members trained together on each sample (loss crps; Part V), each with its own input noise (member_noise):
    train.py holds all of them, train_mp.py can spread them over --ens ranks. 1: one deterministic forecast."""
    crps_alpha: float = 1.0
    """loss crps: alpha of AIFS-CRPS's almost fair CRPS, alpha x fair CRPS + (1 - alpha) x the ensemble's plain CRPS
    (the spread term weighted by 1 - (1 - alpha) / M); 1: the fair CRPS; AIFS-CRPS trains with 0.95."""
    member_noise: float = 0.05
    """ensemble >= 2: standard deviation of the Gaussian noise added to each member's input, as a fraction of each
    input channel's std (the model's std); member k's noise depends on seed, step, sample and k only."""
    lambda_rho: float = 0.0
    """volume: weight of SC22's extra L1 on exp(14 x) of target channel 0 (the density, stored as log(rho) / 14)."""
    loss_space: Literal["physical", "normalized"] = "physical"
    """Units the loss is computed in: physical, or normalised per channel by mean/std (each channel counts alike)."""
    amp_dtype: Literal["none", "bf16", "fp16"] = "none"
    """Autocast dtype for mixed precision (fp16 adds a GradScaler)."""
    keep_fp32: bool = False
    """Under autocast (amp_dtype bf16 or fp16), run the model's precision-sensitive parts in fp32: the normalisations
    and output head its spec names (fp32_modules in models/<name>/spec.py), or the ones fp32_modules lists; false:
    autocast chooses per operation (utils/precision.py applies it; benchmarks/precision_skill.py measures it)."""
    fp32_modules: list[str] = field(default_factory=list)
    """With keep_fp32: the modules to keep, as patterns on their names in named_modules() (fnmatch's: "*norm*",
    head), each matching at least one; empty: the model's spec's (a model of your own: declare them in its spec, or
    list them here)."""
    ac: Literal["none", "block", "layer"] = "none"
    """Activation checkpointing per block (Swin or ViT block) or per SwinIR RSTB (layer)."""
    compile: bool = False
    """torch.compile each block (Swin or ViT block)."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend: inductor generates kernels; aot_eager and eager only trace (for debugging)."""
    fused_optimizer: bool = True
    """AdamW's fused implementation (one kernel for all parameters, on CUDA and CPU); false: torch's default
    (for-each kernels on CUDA, a loop over parameters on CPU)."""
    cuda_graphs: bool = False
    """With compile: torch.compile's reduce-overhead mode, which records each compiled block's kernels once as a
    CUDA graph and replays them, saving the per-kernel launch cost (CUDA only)."""
    tf32: bool = True
    """Allow TF32 matmuls/convolutions on CUDA (no effect on CPU)."""
    cudnn_benchmark: bool = False
    """cuDNN times its convolution algorithms on each new input shape and keeps the fastest (CUDA only). Worth it
    for convolutional models on fixed shapes (SC22's U-Net sets it); the choice may differ between runs, so two runs
    need not be bit-identical."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA if available, else CPU."""
    log_every: int = 10
    """Steps between training log records."""
    val_every: int = 0
    """Steps between validations; 0 = at the end of each epoch."""
    ckpt_every: int = 0
    """Steps between checkpoints; 0 = at the end of each epoch (and always at the end)."""
    ckpt_every_minutes: float = 0.0
    """Also checkpoint once this many minutes of wall time have passed since the last time-based one (0: off):
    a step count does not know the clock. Rank 0's clock decides, for every rank at the same step."""
    ckpt_async: bool = False
    """DCP checkpoints (train_fsdp/mp/pp.py): copy this step's shards to CPU memory and write them in the background
    while training goes on (dcp.async_save); the next save, or the run's end, waits for the write."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept on disk; 0 keeps every one."""
    run_dir: str = "runs/default"
    """Folder for metrics.jsonl, TensorBoard events, checkpoints, samples and profiles."""
    resume: typing.Union[bool, Literal["auto"]] = False
    """true: continue from the latest checkpoint in run_dir/checkpoints (there must be one); auto: continue if
    run_dir holds one, else start fresh (what requeued and restarted jobs use); false: start fresh."""
    progress: Literal["auto", "always", "never"] = "auto"
    """Progress bar: auto shows it when stdout is a terminal."""


@dataclass
class DistConfig:
    lr_scaling: Literal["none", "sqrt", "linear"] = "none"
    """Scale lr with k = batch_size / base_batch_size: linear x k (Goyal et al. 2017), sqrt x sqrt(k) (Krizhevsky 2014,
    Hoffer et al. 2017; NERSC's tutorials), none keeps lr as given (docs/performance.md, Large-batch convergence)."""
    base_batch_size: int = 16
    """Batch size that lr was tuned for (used by lr_scaling)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps: step i (from 0) uses (i + 1) / warmup_steps of the lr (0 = none)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    broadcast_buffers: bool = False
    """DDP: re-broadcast buffers from rank 0 every forward (the models' buffers are constants)."""
    gradient_as_bucket_view: bool = True
    """DDP: gradients are views into the communication buckets (saves one copy)."""
    static_graph: bool = False
    """DDP: the set of used parameters never changes between steps."""
    no_ddp: bool = False
    """Skip the gradient all-reduce (ranks drift apart): measures communication overhead only."""
    fsdp_unit: Literal["block", "layer"] = "block"
    """FSDP2: fully_shard each block, or each SwinIR RSTB (layer), then the root."""
    param_dtype: Literal["fp32", "bf16"] = "fp32"
    """FSDP2 MixedPrecisionPolicy parameter/compute dtype."""
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    """FSDP2 MixedPrecisionPolicy gradient reduce-scatter dtype."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3) or keep them (ZeRO-2)."""
    hsdp_replicas: int = 1
    """HSDP: >1 builds a 2-D mesh (replicas x shards): replicate across, shard within."""
    tp: int = 1
    """train_mp.py: tensor-parallel ranks per model replica (each holds whole heads, 1/tp of the MLP)."""
    cp: int = 1
    """train_mp.py: context-parallel ranks per model replica (each holds one latitude band of tokens; ViT)."""
    ens: int = 1
    """train_mp.py: ranks that share the ensemble members of the same samples (each holds ensemble / ens of them; the
    CRPS gathers the members' predictions over them, and gradients are averaged over ens x dp)."""
    parallel_order: str = "tp-cp-dp"
    """train_mp.py: mesh dimensions from the fastest-varying rank to the slowest (NERSC's --parallel_order): tp-cp-dp
    puts a tensor-parallel group on consecutive ranks, i.e. inside a node; ens sits before dp unless named."""
    pp: int = 1
    """train_pp.py: pipeline stages per model replica, one rank each (two each for interleaved_1f1b and zbv)."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"] = "1f1b"
    """train_pp.py: order of the microbatches' forwards and backwards (zbv: zero-bubble, V-shaped stages)."""
    pp_microbatches: int = 4
    """train_pp.py: microbatches per step; must divide the per-replica batch (best >= 2 x stages)."""
    pp_split: list[int] = field(default_factory=list)
    """train_pp.py: units (SwinIR RSTBs, ViT blocks) per stage, e.g. [3, 3]; empty = balanced by parameters."""
    pp_dp: Literal["fsdp", "ddp"] = "fsdp"
    """train_pp.py: how pipelines are data-parallel: FSDP2 (kept gathered during the step) or DDP."""
    dist_timeout_s: float = 300.0
    """Seconds a rank waits for the others (more than a step and a checkpoint write take): a collective that
    outlives it fails, and a step that lasts 1.5 times as long ends its rank whatever it waits for."""


@dataclass
class ProfileConfig:
    profile: bool = False
    """Record a torch.profiler trace of a few steps (train_with_profiling.py: on unless --profile false)."""
    profile_wait: int = 1
    """Profiler schedule: steps skipped before warm-up."""
    profile_warmup: int = 1
    """Profiler schedule: steps recorded but discarded."""
    profile_active: int = 3
    """Profiler schedule: steps recorded and exported."""
    memory_timeline: bool = True
    """With profile: also export the memory timeline by category (HTML)."""
    memory_snapshot: bool = False
    """Record CUDA memory history and dump a snapshot for pytorch.org/memory_viz (CUDA only)."""
    memory_snapshot_entries: int = 100000
    """Allocation events kept by the CUDA memory history."""
    nsys: bool = False
    """Emit NVTX ranges and cudaProfilerStart/Stop around the profiled steps (run under nsys)."""
    breakdown_steps: int = 10
    """With profile: timed steps per phase of the IO / SYNTHETIC / FULL throughput breakdown after training (0 = skip)."""


@dataclass
class EnsembleConfig:
    """How predict.py --members M perturbs each member's initial state (utils/predict/ensemble.py; Part V). The
    training scripts apply none of these keys but record them in each checkpoint, where predict.py reads them: a
    named config states how its model's ensembles are made (not in APPLIED_BY, which would refuse them there)."""
    perturbation: Literal["gaussian", "spherical", "bred", "lagged"] = "gaussian"
    """gaussian: independent noise per cell, noise_scale times each channel's std (the model's std); spherical:
    the same noise smoothed on the sphere over correlation_km (latitude-aware: circles of latitude shrink toward the
    poles); bred: bred vectors, the growing difference of bred_cycles model steps from noise, rescaled to the same
    size; lagged: member k starts k model steps earlier (no noise), rolled on to the same verifying times."""
    noise_scale: float = 0.05
    """Size of a perturbation per channel, as a fraction of the channel's std (gaussian, spherical: the noise's
    standard deviation; bred: the bred vector's RMS over the grid)."""
    correlation_km: float = 500.0
    """spherical: the Gaussian correlation length of the noise on the Earth's surface, in km."""
    bred_cycles: int = 3
    """bred: model steps of breeding: the perturbation grown by one step and rescaled, this many times."""
    ensemble_seed: int = 0
    """Seed of the members' noise: member k's noise for an initial time depends on it, k and the time only (not on
    the ranks or the order of the work)."""


SECTIONS = {"data": DataConfig, "model": ModelConfig, "train": TrainConfig, "dist": DistConfig, "profile": ProfileConfig,
            "ensemble": EnsembleConfig}


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    ensemble: EnsembleConfig = field(default_factory=EnsembleConfig)
    name: str = "default"
    stated: frozenset = frozenset()
    """Keys set on the command line: what the data may not replace (utils/data/era5.py's resolve_from_data)."""
    moved: frozenset = frozenset()
    """Model arguments given by their old flat keys (:func:`fold_old_keys`): a model that does not take one drops
    it, as every model but the built-in ones ignored those keys."""

    @property
    def target_chans(self) -> int:
        """Channels of a target: out_chans where the task maps to other channels (volume, diagnostic), else in_chans
        (a super-resolved or forecast field has its input's channels)."""
        return self.model.out_chans if self.data.task in ("volume", "diagnostic") else self.model.in_chans

    def to_dict(self) -> dict[str, Any]:
        """Flat {key: value}, the form of the YAML and the command line."""
        flat: dict[str, Any] = {"config": self.name}
        for section in SECTIONS:
            flat.update(dataclasses.asdict(getattr(self, section)))
        return flat


def _key_index() -> dict[str, tuple[str, dataclasses.Field]]:
    index: dict[str, tuple[str, dataclasses.Field]] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in index, f"config key {f.name} appears in two sections"
            index[f.name] = (section, f)
    return index


KEYS = _key_index()


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each dataclass field (used for --help)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Check/convert one value against its field type; raise ConfigError with the valid choices."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(repr(a) for a in args)}")
        return value
    if origin is typing.Union and any(typing.get_origin(a) is Literal for a in args):  # e.g. bool or "auto"
        choices = next(a for a in args if typing.get_origin(a) is Literal)
        if value in typing.get_args(choices):
            return value
        try:
            return _coerce(key, value, next(a for a in args if typing.get_origin(a) is not Literal))
        except ConfigError:
            raise ConfigError(f"{key}: expected true, false or {' or '.join(typing.get_args(choices))}, "
                              f"got {value!r}") from None
    if origin is typing.Union and type(None) in args:
        return None if value is None else _coerce(key, value, next(a for a in args if a is not type(None)))
    if origin is list:
        if isinstance(value, str):
            parsed = _parse_value(value)
            value = parsed if isinstance(parsed, list) else value.replace(",", " ").split()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # img_size: 64 means [64]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, args[0]) for v in value]
    if origin is dict:
        value = _parse_value(value) if isinstance(value, str) else value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping {{name: value, ...}}, got {value!r}")
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.lstrip("-").isdigit())):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return int(value)
    if annotation is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if annotation is str:
        return str(value)
    raise AssertionError(f"unsupported config type {annotation} for {key}")


def _resolved_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_values(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` of keys of one section, typed as build_config types them (ConfigError: the first that is not)."""
    hints = _resolved_types(SECTIONS[section])
    return {key: _coerce(key, value, hints[key]) for key, value in values.items()}


def build_config(name: str, overrides: Optional[dict[str, Any]] = None, path: Optional[Path] = None,
                 script_defaults: Optional[dict[str, Any]] = None) -> Config:
    """The named config (from ``path``, or any config/*.yaml) with overrides applied, validated.

    ``script_defaults`` replace the dataclass defaults for one script (train_with_profiling.py
    profiles unless told not to); the named config and the overrides still win over them.
    """
    moved: set[str] = set()  # the model arguments given by their old flat keys
    origin: dict[str, int] = {}  # where each key was said: deeper is later (named_config), the command line last
    values = {**(script_defaults or {}),
              **named_config(name, path, functools.partial(fold_old_keys, moved=moved), origin)}
    overrides = dict(overrides or {})
    if isinstance(overrides.get("model_args"), str):  # a command line's mapping, as text
        overrides["model_args"] = _parse_value(overrides["model_args"])
    overrides = fold_old_keys(overrides, moved)
    args = [values.get("model_args") or {} if not names_another_model(values, overrides) else {},
            overrides.pop("model_args", None) or {}]  # another model named here: its own arguments only
    if not all(isinstance(a, dict) for a in args):
        raise ConfigError(f"model_args must map your model's argument names to values, got {args}")
    args = {**args[0], **args[1]}  # merged name by name, as --model_args.NAME VALUE is
    for key in [k for k in overrides if k.startswith("model_args.")]:
        args[key[len("model_args."):]] = overrides.pop(key)
    stated = frozenset(overrides) | (frozenset({"model_args"}) if args else frozenset())
    origin.update(dict.fromkeys(overrides, max(origin.values(), default=0) + 1))
    values.update(overrides, model_args=args)
    if path is not None and (values.get("model_class") or values.get("task_class")) and not values.get("model_path"):
        values["model_path"] = str(path.resolve().parent)  # your model's (or task's) module beside your config
    sections: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    unknown = [k for k in values if k not in KEYS]
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(KEYS))}"
        )
    for key, value in values.items():
        section, _ = KEYS[key]
        hint = _resolved_types(SECTIONS[section])[key]
        sections[section][key] = _coerce(key, value, hint)
    cfg = Config(**{s: SECTIONS[s](**kv) for s, kv in sections.items()}, name=name, stated=stated, moved=frozenset(moved))
    take_channel_sets(cfg, origin)
    validate(cfg)
    return cfg


def fold_old_keys(values: dict[str, Any], moved: Optional[set[str]] = None) -> dict[str, Any]:
    """``values`` (a config's own keys, overrides, an older checkpoint's config) with the old flat keys of a built-in
    model's arguments moved under model_args, said once (utils/config_files.py: fold_into_model_args); each model's
    spec names its own (models/spec.py: ``flat_keys``), read only when a key is no config key. ``moved`` collects
    them."""
    strangers = [k for k in values if k not in KEYS and k not in ("config", BASE_KEY) and not k.startswith("model_args.")]
    names = [k for k in strangers if k in built_in_flat_keys()] if strangers else []
    if moved is not None:
        moved.update(names)
    return fold_into_model_args(values, names)


# Keys that only some scripts apply: any other script refuses them set away from their defaults, since a user who asks
# train.py for --tp 2 would otherwise get one device without a sign. Each technique declares its own beside it, in its
# file (utils/parallel/*.py, utils/precision.py, utils/checkpoint/sharded.py: APPLIED_BY), read here as a literal from
# the file's text: the ground floor imports none of them (the layers), and importing them all would cost every script
# 1.5 s. Every key not listed is applied by every script that reads a config; scripts not in CHECKED_SCRIPTS
# (benchmarks) pass keys on to these.
CHECKED_SCRIPTS = {"train.py", "train_with_profiling.py", "train_ddp.py", "train_fsdp.py", "train_mp.py", "train_pp.py",
                   "estimate_memory.py"}


def _declared_keys() -> dict[str, tuple[str, ...]]:
    """{key: the scripts that apply it}: every file of utils/ that declares APPLIED_BY, a dict literal whose keys are a
    key or a tuple of keys; and the profile section, which train_with_profiling.py alone applies."""
    applied: dict[str, tuple[str, ...]] = {}
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        text = path.read_text()
        start = text.find("\nAPPLIED_BY = {")
        if start < 0:
            continue
        literal = text[start + len("\nAPPLIED_BY = "):text.index("\n}\n", start) + 2]  # the dict, to its closing line
        for keys, scripts in ast.literal_eval(literal).items():
            for key in (keys,) if isinstance(keys, str) else keys:
                applied[key] = tuple(dict.fromkeys(applied.get(key, ()) + scripts))  # a key two files declare
    return {**applied, **dict.fromkeys([f.name for f in dataclasses.fields(ProfileConfig)], ("train_with_profiling.py",))}


APPLIED_BY = _declared_keys()


def refuse_unapplied(cfg: Config, script: str) -> None:
    """ConfigError for the first key that ``script`` would ignore although it is set away from its default."""
    values, defaults = cfg.to_dict(), Config().to_dict()
    for key, scripts in APPLIED_BY.items():
        if script in CHECKED_SCRIPTS and script not in scripts and values[key] != defaults[key]:
            shown = json.dumps(values[key]) if isinstance(values[key], (bool, list)) else values[key]
            if script == "estimate_memory.py":
                raise ConfigError(f"{script} does not model --{key} {shown} ({scripts[0]} applies it): estimate "
                                  "without it")
            raise ConfigError(f"--{key} {shown} is applied by {' and '.join(scripts)} only; {script} would ignore "
                              f"it: drop it, or run {scripts[0]}")


def lr_scale(rule: str, batch_size: int, base_batch_size: int) -> float:
    """The factor lr_scaling ``rule`` applies to lr at global ``batch_size`` (pure: benchmarks and tests call it)."""
    ratio = batch_size / base_batch_size
    return {"none": 1.0, "sqrt": math.sqrt(ratio), "linear": ratio}[rule]


def _parse_value(text: str) -> Any:
    """Command-line values use YAML syntax: 4, 1e-3, true, [6,6], bf16."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """--config NAME, --config_file PATH, and one --key per config field (documented in --help)."""
    parser.add_argument("--config", default="quickstart", help="named config in the config file")
    parser.add_argument("--config_file", default=None, help="YAML file with named configs; none: every config/*.yaml")
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(f"{section} (override any key of the named config)")
        docs = field_docs(cls)
        hints = _resolved_types(cls)
        for f in dataclasses.fields(cls):
            # A bare boolean flag means true: --resume == --resume true.
            flag = {"nargs": "?", "const": True} if bool in (hints[f.name], *typing.get_args(hints[f.name])) else {}
            group.add_argument(f"--{f.name}", dest=f"cfg__{f.name}", metavar="V", default=argparse.SUPPRESS,
                               type=_parse_value, help=docs.get(f.name, ""), **flag)


def config_from_args(args: argparse.Namespace, script_defaults: Optional[dict[str, Any]] = None) -> Config:
    overrides = {k[len("cfg__"):]: v for k, v in vars(args).items() if k.startswith("cfg__")}
    return build_config(args.config, overrides, Path(args.config_file) if args.config_file else None, script_defaults)


_NEGATIVE = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class _TrainingParser(OneLineParser):
    def explain(self, message: str) -> str:
        if "unrecognized arguments" in message:
            return f"{message}; valid keys: {', '.join(sorted(KEYS))} (see --help)"
        return message


def _join_negative_values(argv: list[str]) -> list[str]:
    """--lr -1e-3 -> --lr=-1e-3: argparse takes a value that starts with '-' for an option unless it looks like
    -1 or -.5, so the exponent form would fail with 'expected one argument'."""
    joined: list[str] = []
    for token in argv:
        if joined and joined[-1].startswith("--") and "=" not in joined[-1] and _NEGATIVE.fullmatch(token):
            joined[-1] += f"={token}"
        else:
            joined.append(token)
    return joined


def parse_config(description: str = "", argv: Optional[list[str]] = None, extra_args=None,
                 script_defaults: Optional[dict[str, Any]] = None) -> Config | tuple[Config, argparse.Namespace]:
    """Parse ``--config NAME --key value ...``; exit with a one-line error on bad input.

    ``extra_args(parser)`` may add script-specific options; then (cfg, args) is returned.
    ``script_defaults``: this script's own defaults for some keys (see build_config).
    """
    first_line = (description or "").strip().splitlines()[0] if description else None
    parser = _TrainingParser(description=first_line, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    if extra_args is not None:
        extra_args(parser)
    add_config_args(parser)
    args, rest = parser.parse_known_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
    while rest[:1] and rest[0].startswith("--model_args."):  # one argument of your model: --model_args.NAME VALUE
        name, _, value = rest.pop(0).partition("=")
        if not value and (not rest or rest[0].startswith("--")):
            parser.error(f"{name} needs a value")
        setattr(args, f"cfg__{name[2:]}", _parse_value(value or rest.pop(0)))
    if rest:
        old = rest[0][2:].partition("=")[0] if rest[0].startswith("--") else ""
        if old and old not in KEYS and old in built_in_flat_keys():  # the flag of an older version
            parser.error(f"--{old} is a model argument now: write --model_args.{old} VALUE (in a config: model_args: "
                         f"{{{old}: VALUE}})")
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        cfg = config_from_args(args, script_defaults)
        refuse_unapplied(cfg, parser.prog)
    except ConfigError as e:
        parser.error(str(e))
    return (cfg, args) if extra_args is not None else cfg


if __name__ == "__main__":  # python -m utils.config --config NAME [overrides]: print the merged config
    print(yaml.safe_dump(parse_config(sys.modules[__name__].__doc__).to_dict(), sort_keys=False))
