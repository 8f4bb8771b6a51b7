"""ERA5 served as it is on disk: dataset, resumable distributed sampler, loaders, and what the
config takes from the data (channel names, normalisation statistics).

Layout (see datasets/README.md): ``<data_dir>/<split>/<year>.h5``, one dataset ``fields`` per
file, shape ``(samples, C, H, W)``, float32, physical units, row 0 at 90N and the last row at 90S.
SuperBench's ERA5 (Part I) is C = 3, daily, 721 x 1440; NERSC's (Part II) C = 20, 6-hourly,
361 x 720, with ``<data_dir>/stats/{global_means,global_stds,time_means}.npy``. The last latitude
row is dropped (721 -> 720, 361 -> 360), as SuperBench and NERSC do, so whole fields divide by 2, 4 and 8.

``ERA5Dataset`` returns float32 tensors in physical units (the model normalises):

- task "sr": ``(lr, hr)``; hr is a ``crop_size`` crop (or the whole 720 x W field when
  ``crop_size`` is 0) and lr its bicubic downsampling by ``upscale`` (antialias off, as SuperBench).
- task "forecast": ``(x_t, x_t+lead)``, the same crop of two samples ``lead`` steps apart in one file and in one
  run of consecutive times (a file may record gaps in time: attribute ``segment_starts``, datasets/convert.py).
- task "diagnostic": ``(x_t[inputs], x_t[targets])``, two sets of channels of one sample (the config's
  ``input_channels`` and ``target_channels``, by name).

A crop reads only its own hyperslab from disk (3 x 128 x 128 floats, 196 KB) instead of the whole
day (3 x 721 x 1440, 12.5 MB) that SuperBench reads and then crops. Crop positions are a hash of
(seed, epoch, index) for training and of (seed, index) for validation: random-looking, new every
epoch, yet identical for a resumed run and for any number of ranks or workers.

HDF5 files are opened lazily in the process that reads them (each DataLoader worker opens its
own handles, never sharing one across fork), and closed by ``close()`` or when the dataset dies.
"""

from __future__ import annotations

import bisect
import itertools
import math
from pathlib import Path
from typing import Optional, Sequence

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from models import fixed_input_size  # the one fact about models the data layer needs
from utils.config import ConfigError
from utils.data.common import (DataError, LazyH5, SubsetWithEpoch, build_dataloader, evenly_spaced, h5_reason,
                               relative_note, splitmix64, stable_hash)
from utils.data.device_pipeline import on_device
from utils.data.files import FIELDS_KEY, STAND_IN, YearFile, check_channels, lead_time, pair_starts, scan_split
from utils.parallel.distributed import read_dist_env
from utils.parallel.domain_parallel import BICUBIC_REACH

SUPERBENCH_MEAN = (6.3024, 278.3945, 18.4262)
SUPERBENCH_STD = (3.7376, 21.0588, 16.4687)
CHANNEL_NAMES = ("kinetic energy 10 m", "temperature 2 m", "total column water vapour")  # SuperBench's
CHANNEL_UNITS = ("m2 s-2", "K", "kg m-2")
STATS_DIR = "stats"  # NERSC's layout: <data_dir>/stats/global_means.npy, global_stds.npy, time_means.npy
STATS_COMMAND = "python datasets/compute_stats.py --data_dir {root}"
TASKS = ("sr", "forecast", "diagnostic")
READ_MODES = ("hyperslab", "whole")

_TRAIN_STREAM, _VALID_STREAM = 1, 2  # crops of the training and validation sets (STEP_STREAM is 3)


# ----------------------------------------------------------------------------------------------
# Low resolution and crop positions
# ----------------------------------------------------------------------------------------------


def bicubic_downsample(hr: torch.Tensor, factor: int) -> torch.Tensor:
    """SuperBench's low-resolution input: bicubic resize by 1/factor, antialias off.

    Same as torchvision's ``Resize(..., BICUBIC, antialias=False)`` on a tensor and as
    ``F.interpolate(hr, scale_factor=1/factor, mode="bicubic", align_corners=False)``.
    Takes (C, H, W) or (N, C, H, W); H and W must be multiples of factor.
    """
    if factor == 1:
        return hr.clone()
    height, width = hr.shape[-2:]
    if height % factor or width % factor:
        raise ValueError(f"a {height}x{width} field cannot be downsampled by {factor} (not a multiple)")
    batched = hr if hr.dim() == 4 else hr.unsqueeze(0)
    lr = F.interpolate(batched, size=(height // factor, width // factor), mode="bicubic",
                       align_corners=False, antialias=False)
    return lr if hr.dim() == 4 else lr.squeeze(0)


# ----------------------------------------------------------------------------------------------
# Dataset
# ----------------------------------------------------------------------------------------------


class ERA5Dataset(LazyH5, Dataset):
    """SuperBench's ERA5 split folder as (input, target) pairs; see the module docstring.

    Length: ``days * n_patches`` with crops (SuperBench's arithmetic: 4 files x 365 days x 8 =
    11680), ``days`` for whole fields, where "days" counts pairs (samples - lead per file) for forecasting.
    Index i maps to file and day as SuperBench: day ``i // n_patches`` counted across the sorted files.
    ``channels``: the channel count the model expects (checked against the files when given).

    ``read="whole"`` reads the whole day and then crops, as SuperBench; only for benchmarks.
    ``bands`` (task "sr", domain parallelism: utils/parallel/domain_parallel.py): return only this rank's band of
    rows of each pair, reading only those rows and the two the bicubic downsampling reaches beyond them.
    ``highres_only`` (task "sr", device_transforms): items are ``(high-res,)``; the training loop's device makes
    the low-res input (utils/data/device_pipeline.py). ``inputs``, ``targets`` (task "diagnostic"): the channel
    indices of each side.
    """

    def __init__(self, split_dir, task: str = "sr", upscale: int = 2, crop_size: int = 128, n_patches: int = 8,
                 seed: int = 0, train: bool = True, read: str = "hyperslab", lead: int = 1,
                 channels: Optional[int] = None, bands=None, highres_only: bool = False,
                 inputs: Sequence[int] = (), targets: Sequence[int] = ()):
        if task not in TASKS:
            raise DataError(f"task {task!r} is not one of {', '.join(TASKS)}")
        if read not in READ_MODES:
            raise DataError(f"read {read!r} is not one of {', '.join(READ_MODES)}")
        if upscale < 1 or crop_size < 0 or n_patches < 1 or lead < 1:
            raise DataError(f"need upscale >= 1, crop_size >= 0, n_patches >= 1, lead >= 1; "
                            f"got {upscale}, {crop_size}, {n_patches}, {lead}")
        self.split_dir = Path(split_dir)
        self.files = scan_split(self.split_dir)
        self.channels = self.files[0].channels
        if channels is not None and task != "diagnostic":  # a diagnostic model reads some of them
            check_channels(self.files[0], channels)
        if (task == "diagnostic") != bool(inputs and targets):
            raise DataError(f"task {task}: inputs and targets (channel indices) are for task diagnostic, which needs both")
        if max((*inputs, *targets), default=0) >= self.channels:
            raise DataError(f"{self.split_dir}: channel indices {list(inputs)} -> {list(targets)} beyond its "
                            f"{self.channels} channels")
        self.inputs, self.targets = list(inputs), list(targets)
        self.task, self.upscale, self.crop_size, self.seed, self.train, self.read = task, upscale, crop_size, seed, train, read
        if bands is not None and task != "sr":
            raise DataError(f"bands of a field are for task 'sr' (SwinIR's domain parallelism), not {task!r}")
        self.bands = None if bands is None else bands.layout()  # picklable: no process group
        if highres_only and (task != "sr" or bands is not None):
            raise DataError("highres_only (device_transforms) is for task 'sr' on whole samples; bands of a field need "
                            "the rows beyond them for the downsampling: set device_transforms false with cp > 1")
        self.highres_only = highres_only
        self.height = self.files[0].height - 1  # SuperBench drops the last latitude row (721 -> 720)
        self.width = self.files[0].width
        self._check_geometry()
        if self.bands is not None:
            self.bands.bounds(self.sample_rows // upscale)  # a field too small for cp bands: say so now, not in a worker
        self.patches_per_day = n_patches if crop_size else 1
        self.lead = lead if task == "forecast" else 0  # a forecast pair needs sample t+lead in the same file
        self.lead_time = lead_time(self.files[0].step, lead) if task == "forecast" else None  # "6 h", "1 month"
        self._starts = [pair_starts(f, self.lead) for f in self.files]  # None: no gap recorded in that file
        counts = [max(f.days - self.lead, 0) if s is None else len(s) for f, s in zip(self.files, self._starts)]
        self._first_day = list(itertools.accumulate([0] + counts))
        self.days = self._first_day[-1]
        if self.days == 0:
            longest = max(f.days for f in self.files)
            gapped = any(s is not None for s in self._starts)
            gaps = " (and in one run of consecutive times: the files record gaps)" if gapped else ""
            raise DataError(f"{self.split_dir}: lead {lead} needs more than {lead} samples in a file{gaps}, the "
                            f"longest holds {longest}; use a smaller --lead or files with more samples")
        # Shared memory: set_epoch in the main process reaches the (persistent) worker processes.
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    def _check_geometry(self) -> None:
        field = f"{self.height}x{self.width} field (after dropping the last latitude row)"
        if self.crop_size:
            if self.crop_size > min(self.height, self.width):
                raise DataError(
                    f"{self.split_dir}: crop_size {self.crop_size} is larger than the {field}; "
                    f"use crop_size <= {min(self.height, self.width)}, or 0 for whole fields"
                )
            if self.task == "sr" and self.crop_size % self.upscale:
                raise DataError(
                    f"crop_size {self.crop_size} is not divisible by upscale {self.upscale}; "
                    f"use a multiple of {self.upscale} such as {self.crop_size // self.upscale * self.upscale or self.upscale}"
                )
        elif self.task == "sr" and (self.height % self.upscale or self.width % self.upscale):
            raise DataError(
                f"{self.split_dir}: the whole {field} cannot be downsampled by upscale {self.upscale} "
                "(not a multiple); set a crop_size or an upscale that divides both sides"
            )

    # -- sizes and positions ---------------------------------------------------------------

    def __len__(self) -> int:
        return self.days * self.patches_per_day

    @property
    def epoch(self) -> int:
        return int(self._epoch[0])

    def set_epoch(self, epoch: int) -> None:
        """New training crops for this epoch; call before iterating (the sampler's set_epoch does)."""
        self._epoch[0] = epoch

    def locate(self, index: int) -> tuple[int, int]:
        """(file number, day in that file) of a sample; the target of a forecast is day + lead."""
        day = index // self.patches_per_day
        file = bisect.bisect_right(self._first_day, day) - 1
        starts = self._starts[file]
        return file, day - self._first_day[file] if starts is None else int(starts[day - self._first_day[file]])

    def crop_origin(self, index: int) -> tuple[int, int]:
        """Top-left (row, column) of the sample's crop; (0, 0) for whole fields."""
        if not self.crop_size:
            return 0, 0
        key = stable_hash(self.seed, _TRAIN_STREAM, self.epoch, index) if self.train else stable_hash(self.seed, _VALID_STREAM, index)
        rows, cols = self.height - self.crop_size + 1, self.width - self.crop_size + 1
        return key % rows, splitmix64(key) % cols

    # -- reading ---------------------------------------------------------------------------

    def _fields(self, file: int) -> h5py.Dataset:
        """The file's ``fields``, opened on first use in this process."""
        return self.h5_dataset(file, self.files[file].path, FIELDS_KEY)

    @property
    def sample_rows(self) -> int:
        """Rows of a (high-resolution) sample: the crop's, or the whole field's."""
        return self.crop_size or self.height

    def read_field(self, file: int, day: int, row: int = 0, col: int = 0, height: Optional[int] = None) -> torch.Tensor:
        """(C, size, size) at (row, col), or the whole (C, H - 1, W) field when crop_size is 0; ``height``
        rows from ``row`` instead of the sample's (a band of it).

        Only the crop's hyperslab is read (for chunked files, the tiles it touches);
        read="whole" reads the whole day first, as SuperBench.
        """
        size_r = height or self.sample_rows
        size_c = self.crop_size or self.width
        rows, cols = slice(row, row + size_r), slice(col, col + size_c)
        fields = self._fields(file)
        try:
            if self.read == "whole":
                block = fields[day][:, rows, cols]  # SuperBench: 3 x 721 x 1440 from disk, then cut
            else:
                block = fields[day, :, rows, cols]  # HDF5 reads only this hyperslab
        except (OSError, RuntimeError) as e:
            raise DataError(
                f"{self.files[file].path}: cannot read day {day} ({h5_reason(e)}); the file is truncated "
                "or corrupt: download or generate it again"
            ) from None
        return torch.from_numpy(np.ascontiguousarray(block, dtype=np.float32))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        file, day = self.locate(index)
        row, col = self.crop_origin(index)
        if self.bands is not None:
            return self._band_pair(file, day, row, col)
        x = self.read_field(file, day, row, col)
        if self.highres_only:
            return (x,)
        if self.task == "forecast":
            return x, self.read_field(file, day + self.lead, row, col)
        if self.task == "diagnostic":
            return x[self.inputs].contiguous(), x[self.targets].contiguous()
        return bicubic_downsample(x, self.upscale), x

    def _band_pair(self, file: int, day: int, row: int, col: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(low-res band, high-res band) of this rank, equal to those rows of the whole pair."""

        s = self.upscale
        start, stop = self.bands.bounds(self.sample_rows // s)  # low-res rows
        reach = s * math.ceil(BICUBIC_REACH / s)  # the taps' reach, in whole low-res rows
        low, high = max(s * start - reach, 0), min(s * stop + reach, self.sample_rows)
        x = self.read_field(file, day, row + low, col, height=high - low)
        lr = bicubic_downsample(x, s)[:, start - low // s:stop - low // s]
        return lr.contiguous(), x[:, s * start - low:s * stop - low].contiguous()

    def __repr__(self) -> str:
        crop = f"{self.crop_size}x{self.crop_size} crops x {self.patches_per_day}/day" if self.crop_size else "whole fields"
        lead = f", lead {self.lead_time}" if self.lead_time else ""
        return (f"ERA5Dataset({self.split_dir}, task={self.task}{lead}, {len(self.files)} files, {self.days} days, "
                f"{self.channels} channels, {self.height}x{self.width}, {crop}, {len(self)} samples)")


# ----------------------------------------------------------------------------------------------
# Sampler and loaders
# ----------------------------------------------------------------------------------------------


def read_stats(root, channels: int) -> tuple[list[float], list[float]]:
    """Per-channel mean and std from ``<root>/stats/global_means.npy`` and ``global_stds.npy`` (NERSC's layout,
    any shape holding ``channels`` values, e.g. (1, C, 1, 1))."""
    folder = Path(root) / STATS_DIR
    values = []
    for name in ("global_means.npy", "global_stds.npy"):
        path = folder / name
        if not path.is_file():
            raise DataError(
                f"{path}: no such file, and the config sets no mean/std; set --mean and --std, or compute the "
                f"statistics of the training split once: `{STATS_COMMAND.format(root=root)}`")
        try:
            array = np.load(path).astype(np.float64).reshape(-1)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: cannot be read as a NumPy array ({e}); compute it again: "
                            f"`{STATS_COMMAND.format(root=root)}`") from None
        if array.size != channels:
            raise DataError(f"{path}: {array.size} values for {channels} channels; compute the statistics of "
                            f"this data again: `{STATS_COMMAND.format(root=root)}`")
        values.append(array)
    mean, std = values
    if not (np.isfinite(mean).all() and np.isfinite(std).all() and (std > 0).all()):
        raise DataError(f"{folder}: the statistics hold non-finite values or a std <= 0; compute them again: "
                        f"`{STATS_COMMAND.format(root=root)}`")
    return mean.tolist(), std.tolist()


def read_climatology(root, channels: int, height: int, width: int) -> np.ndarray:
    """The time-mean field per channel, ``<root>/stats/time_means.npy`` (1, C, H_stored, W), cut to (C, height, width)."""
    path = Path(root) / STATS_DIR / "time_means.npy"
    if not path.is_file():
        raise DataError(f"{path}: no such file; forecast validation needs the training split's climatology: "
                        f"`{STATS_COMMAND.format(root=root)}`")
    try:
        array = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot be read as a NumPy array ({e}); compute it again: "
                        f"`{STATS_COMMAND.format(root=root)}`") from None
    array = array.reshape(array.shape[-3:]) if array.ndim >= 3 and np.prod(array.shape[:-3]) == 1 else array
    if array.ndim != 3 or array.shape[0] != channels or array.shape[1] < height or array.shape[2] != width:
        raise DataError(f"{path}: shape {tuple(array.shape)} does not match the data ({channels} channels, "
                        f"{height}x{width}); compute it again: `{STATS_COMMAND.format(root=root)}`")
    return np.ascontiguousarray(array[:, :height, :width], dtype=np.float32)


def stand_in_command(cfg) -> str:
    """The generator command whose output this config reads: its channels, time step, grid and split names."""

    d, m = cfg.data, cfg.model
    channels = len({*d.input_channels, *d.target_channels}) if d.task == "diagnostic" else m.in_chans
    layout = {3: "", 20: " --channels nersc20"}.get(channels, f" --channels {channels}")
    if d.task in ("forecast", "diagnostic"):
        layout += " --hours-per-step 6"
    fixed = fixed_input_size(m)
    height, width = (fixed[0] + 1, fixed[1]) if fixed else (181, 360)  # + the row the loader drops
    command = STAND_IN.format(root=d.data_dir, layout=layout, height=height, width=width)
    if d.train_split != "train":
        command = command.replace("--train-years 2008 2010", f"--train-years --split {d.train_split}=2008,2010")
    if d.valid_split != "valid":
        command = command.replace("--valid-years 2015", f"--valid-years --split {d.valid_split}=2015")
    return command


def resolve_from_data(cfg) -> list[YearFile]:
    """Fill in what the config leaves to the data, and check what it states against the data.

    Sets ``channel_names`` (empty: the files' names, else "channel i") and ``mean``/``std`` (empty:
    ``<data_dir>/stats``), so the model, the logs and the checkpoint's config all agree with the data.
    Raises DataError/ConfigError (one line) when the data and the config disagree. Returns the training files.
    """

    d, m = cfg.data, cfg.model
    root = Path(d.data_dir)
    for folder in (root, root / d.train_split, root / d.valid_split):
        if not folder.is_dir():
            raise DataError(f"{folder} does not exist{relative_note(folder)}: see datasets/README.md for the real "
                            f"data, or generate a stand-in that this config reads: `{stand_in_command(cfg)}`")
    files = scan_split(root / d.train_split)
    first = files[0]
    if d.task == "diagnostic":
        took = _take_channel_sets(cfg, first, root)
    else:
        took = _take_channels(cfg, first, root)
        check_channels(first, m.in_chans)
    if not d.channel_names:
        d.channel_names = channel_names_of(first)
    missing = [name for name in d.key_channels if name not in d.channel_names]
    if missing:
        raise ConfigError(f"key_channels {missing} are not channels of the data; channel_names: {d.channel_names}")
    if not m.mean:
        m.mean, m.std = read_stats(root, first.channels)
    fixed = fixed_input_size(m)
    if fixed is not None:
        field = (first.height - 1, first.width)  # the dataset drops the last latitude row
        if d.crop_size:
            field = (d.crop_size, d.crop_size)
        if d.task == "sr":
            field = (field[0] // m.upscale, field[1] // m.upscale)
        if field != fixed and "img_size" not in cfg.stated:
            m.img_size = list(field)
            took.append(f"img_size [{field[0]}, {field[1]}] (the config's {fixed[0]}x{fixed[1]})")
        elif field != fixed:
            raise ConfigError(
                f"the {m.model} model takes {fixed[0]}x{fixed[1]} inputs (img_size) but the data in {root} gives "
                f"{field[0]}x{field[1]}; set --img_size [{field[0]}, {field[1]}]")
    if took and read_dist_env().rank == 0:
        print(f"data: {root} is not the data of config {cfg.name}; taken from it: {'; '.join(took)} (state a key on "
              "the command line to keep yours)", flush=True)
    return files


def channel_names_of(file: YearFile) -> list[str]:
    """The names of a file's channels: its own, else "channel i"."""
    return list(file.names or (f"channel {c}" for c in range(file.channels)))


def channel_sets(cfg, file: YearFile) -> tuple[list[int], list[int]]:
    """Task diagnostic: the indices of input_channels and target_channels among the data's channels."""
    names, d = channel_names_of(file), cfg.data
    unknown = [name for name in (*d.input_channels, *d.target_channels) if name not in names]
    if unknown:
        raise ConfigError(f"input_channels/target_channels {unknown} are not channels of {file.path.parent}; "
                          f"its channels: {names}")
    return [names.index(n) for n in d.input_channels], [names.index(n) for n in d.target_channels]


def _take_channel_sets(cfg, first: YearFile, root: Path) -> list[str]:
    """Task diagnostic: the channel sets checked against the data's channels, and the statistics of each side from
    the data's where the config leaves them empty (the counts and the metrics' channels follow the sets already:
    utils/config_checks.py's take_channel_sets); nothing taken to say."""
    m = cfg.model
    inputs, targets = channel_sets(cfg, first)
    if not m.mean or not m.out_mean:
        mean, std = read_stats(root, first.channels)
        if not m.mean:
            m.mean, m.std = [mean[i] for i in inputs], [std[i] for i in inputs]
        if not m.out_mean:
            m.out_mean, m.out_std = [mean[i] for i in targets], [std[i] for i in targets]
    return []


def _take_channels(cfg, first: YearFile, root: Path) -> list[str]:
    """A named config pointed at other data takes the data's channels — their count, names, statistics and which
    to plot — unless the command line states them; what it took, said once. Nothing when the counts agree."""
    d, m = cfg.data, cfg.model
    if first.channels == m.in_chans or "in_chans" in cfg.stated:
        return []  # check_channels then says what disagrees
    was, m.in_chans = m.in_chans, first.channels
    took = [f"in_chans {first.channels} (the config's {was})"]
    if "channel_names" not in cfg.stated:
        d.channel_names = channel_names_of(first)
        took.append(f"channel_names [{', '.join(d.channel_names)}]")
    if "key_channels" not in cfg.stated:
        kept = [name for name in d.key_channels if name in d.channel_names]
        d.key_channels = kept or d.channel_names[:3]
        took.append(f"key_channels [{', '.join(d.key_channels)}]")
    if "mean" not in cfg.stated and "std" not in cfg.stated:
        m.mean, m.std = read_stats(root, first.channels)
        took.append(f"mean and std from {root / STATS_DIR}")
    return took


def build_era5_loaders(cfg, rank: int = 0, world_size: int = 1, bands=None) -> tuple[DataLoader, DataLoader]:
    """(train, validation) loaders of this rank from a utils.config.Config; with ``bands``, of this rank's
    band of each sample (SwinIR's domain parallelism).

    First fills in and checks the config against the data (:func:`resolve_from_data`).
    ``cfg.train.batch_size`` is global (per rank: batch_size // world_size). Training uses
    ``train_samples`` and validation ``val_samples`` evenly spaced samples (0 = all), validation in
    order, with fixed crops.
    """
    d, seed, global_batch = cfg.data, cfg.train.seed, cfg.train.batch_size
    root = Path(d.data_dir)
    files = resolve_from_data(cfg)
    if global_batch % world_size:
        raise DataError(
            f"batch_size {global_batch} is the global batch and must be divisible by the {world_size} ranks; "
            f"use a multiple of {world_size}"
        )
    per_rank = global_batch // world_size
    inputs, targets = channel_sets(cfg, files[0]) if d.task == "diagnostic" else ((), ())
    common = dict(task=d.task, upscale=cfg.model.upscale, crop_size=d.crop_size, n_patches=d.n_patches, seed=seed,
                  lead=d.lead, channels=cfg.model.in_chans, bands=bands, inputs=inputs, targets=targets)

    # Else nothing to move (forecast: normalised in the model); bands with it: the dataset says what to do.
    highres_only = d.device_transforms and d.task == "sr"
    train_set = evenly_spaced(ERA5Dataset(root / d.train_split, train=True, highres_only=highres_only, **common),
                              d.train_samples, SubsetWithEpoch)
    valid_set = evenly_spaced(ERA5Dataset(root / d.valid_split, train=False, **common), d.val_samples)
    workers = dict(num_workers=d.num_workers, pin_memory=d.pin_memory, persistent_workers=d.persistent_workers,
                   prefetch_factor=d.prefetch_factor)
    train_loader = build_dataloader(train_set, per_rank, shuffle=True, seed=seed, rank=rank, world_size=world_size,
                                    drop_last=d.drop_last, **workers)
    if len(train_loader) == 0:
        raise DataError(
            f"{root / d.train_split}: {len(train_set)} training samples make no full batch of {global_batch} "
            f"over {world_size} rank(s); lower batch_size or add data"
        )
    valid_loader = build_dataloader(valid_set, d.val_batch_size or per_rank, shuffle=False, seed=seed, rank=rank,
                                    world_size=world_size, drop_last=False, **workers)
    upscale = cfg.model.upscale
    downsample = (lambda moved, host: (bicubic_downsample(moved[0], upscale), moved[0])) if highres_only else None
    return on_device(train_loader, cfg, downsample), valid_loader


