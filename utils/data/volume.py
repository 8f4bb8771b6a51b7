"""Part III's data: cubic crops of one simulation box, turned by the cube's 48 symmetries, on the host or on the device.

Layout (SC22's, see datasets/README.md): one HDF5 file per split, ``<data_dir>/<split>.h5``, holding two
float32 datasets over the same N x N x N grid: ``Nbody`` (input channels, N, N, N) and ``Hydro`` (target
channels, N, N, N), stored already scaled for the model (SC22: log-densities over 14, scaled velocities).
Optional attributes of each dataset: ``channels`` (names), ``vectors`` (triples of channel indices: the
components of a vector field along grid axes 0, 1, 2) and, on ``Hydro``, ``mean`` (per channel: the
baseline's constant prediction). SC22's own files have none of them.

``VolumeDataset`` returns ``(input, target)`` crops of ``crop_size``³ voxels, read as hyperslabs. Training
crops sit anywhere in the box, at a position drawn from (seed, epoch, index), as the SR crops are; so is
the symmetry each one is turned by: the same on any number of ranks or workers and after a resume.
Validation crops are fixed: drawn from (seed, index), or, with ``val_samples`` 0, the crops that tile the box.

The symmetries are the 48 of the cube: 6 orders of the three axes times 8 choices of axes to reflect
(the 24 rotations and their mirror images). One is applied to input and target alike, and to a vector
field's components as well as to its grid: turning a velocity field turns the velocities too
(SC22's loader moves the grid only). ``augment: host`` applies it in the loader (SC22's PyTorch loader:
in the worker processes, on the CPU); ``augment: device`` in the training process after the batch is
copied to the device (what SC22's DALI pipeline does on the GPU): the loader then hands out batches
already on the device, which the training scripts' ``.to(device)`` leaves as they are.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import h5py
import numpy as np
import torch
from torch.utils.data import Dataset

from utils.config import ConfigError
from utils.data.common import DataError, LazyH5, build_dataloader, h5_reason, open_h5, relative_note, stable_hash
from utils.data.device_pipeline import on_device

INPUT_KEY, TARGET_KEY = "Nbody", "Hydro"  # SC22's dataset names
NAMES_ATTR, VECTORS_ATTR, MEAN_ATTR = "channels", "vectors", "mean"
AUGMENT_MODES = ("none", "host", "device")
_TRAIN_STREAM, _VALID_STREAM = 11, 12  # crops of the volume, unrelated to ERA5's streams

STAND_IN = "python datasets/make_synthetic_volume.py --out {root} --train-side 96 --valid-side 64 --seed 0"
"""The one recipe for the quickstart's stand-in (the Makefile's `data-unet`, datasets/README.md, the errors)."""

# ---------------------------------------------------------------------------------------------------
# The 48 symmetries of the cube
# ---------------------------------------------------------------------------------------------------

AXIS_ORDERS = tuple(itertools.permutations(range(3)))
NUM_SYMMETRIES = len(AXIS_ORDERS) * 8


def symmetry(code: int) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """Symmetry ``code`` (0..47) as (order, reflected): new grid axis k is old axis order[k], then the new
    axes in ``reflected`` are reversed. Code 0 is the identity."""
    if not 0 <= code < NUM_SYMMETRIES:
        raise ValueError(f"symmetry code {code} is not in 0..{NUM_SYMMETRIES - 1}")
    order, bits = AXIS_ORDERS[code // 8], code % 8
    return order, tuple(axis for axis in range(3) if bits >> axis & 1)


def apply_symmetry(volume: torch.Tensor, code: int, vectors: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """``volume`` (C, D, H, W) turned by symmetry ``code``; a new contiguous tensor.

    A point's new coordinate k is its old coordinate order[k], reversed where axis k is reflected. A
    vector field's components transform the same way: new component k = old component order[k], negated
    where axis k is reflected (``vectors``: triples of channel indices, components along axes 0, 1, 2).
    """
    order, reflected = symmetry(code)
    out = volume.permute(0, *(1 + axis for axis in order))
    out = out.flip([1 + axis for axis in reflected]).contiguous() if reflected else out.contiguous()
    out = out.clone() if out.data_ptr() == volume.data_ptr() else out  # the identity: still a new tensor
    for components in vectors:
        old = out[list(components)]  # a copy: the assignment below must not read what it writes
        for k in range(3):
            out[components[k]] = -old[order[k]] if k in reflected else old[order[k]]
    return out


def apply_symmetries(batch: torch.Tensor, codes: Sequence[int], vectors: Sequence[Sequence[int]] = ()) -> torch.Tensor:
    """Sample i of ``batch`` (B, C, D, H, W) turned by ``codes[i]``: a few kernels per sample on its device."""
    out = torch.empty_like(batch, memory_format=torch.contiguous_format)
    for i, code in enumerate(codes):
        out[i] = apply_symmetry(batch[i], code, vectors)
    return out


# ---------------------------------------------------------------------------------------------------
# The file
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VolumeFile:
    path: Path
    side: int
    channels: dict  # {INPUT_KEY: count, TARGET_KEY: count}
    names: dict  # {key: tuple of names, or None}
    vectors: dict  # {key: tuple of index triples}
    target_mean: Optional[tuple[float, ...]]


def _names(attrs, count: int) -> Optional[tuple[str, ...]]:
    names = attrs.get(NAMES_ATTR)
    if names is None:
        return None
    names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in np.atleast_1d(names))
    return names if len(names) == count else None  # an attribute that does not describe the channels is ignored


def _vectors(path: Path, key: str, attrs, count: int) -> tuple[tuple[int, int, int], ...]:
    raw = attrs.get(VECTORS_ATTR)
    if raw is None:
        return ()
    triples = np.asarray(raw, dtype=np.int64).reshape(-1, 3) if np.size(raw) % 3 == 0 else None
    flat = [] if triples is None else triples.reshape(-1).tolist()
    if triples is None or not all(0 <= c < count for c in flat) or len(set(flat)) != len(flat):
        raise DataError(f"{path}: {key}.attrs['{VECTORS_ATTR}'] = {np.asarray(raw).tolist()} is not a list of triples "
                        f"of distinct channel indices below {count}; fix or delete the attribute")
    return tuple(tuple(t) for t in triples.tolist())


def describe_volume(path) -> VolumeFile:
    """Check one split's file and read its shape and attributes (one-line DataError on anything amiss)."""
    path = Path(path)
    expected = (f"expected datasets '{INPUT_KEY}' (input channels, N, N, N) and '{TARGET_KEY}' (target channels, "
                "N, N, N) over one grid, as SC22's files")
    with open_h5(path) as f:
        missing = [key for key in (INPUT_KEY, TARGET_KEY) if not isinstance(f.get(key), h5py.Dataset)]
        if missing:
            found = ", ".join(sorted(f.keys())) or "nothing"
            raise DataError(f"{path}: no dataset {', '.join(repr(k) for k in missing)} (found: {found}); {expected}")
        shapes = {key: f[key].shape for key in (INPUT_KEY, TARGET_KEY)}
        for key, shape in shapes.items():
            if len(shape) != 4 or not shape[1] == shape[2] == shape[3] or min(shape) < 1:
                raise DataError(f"{path}: '{key}' has shape {shape}; {expected}")
            if not np.issubdtype(f[key].dtype, np.number):
                raise DataError(f"{path}: '{key}' holds {f[key].dtype}, not numbers; {expected}, float32")
        if shapes[INPUT_KEY][1:] != shapes[TARGET_KEY][1:]:
            raise DataError(f"{path}: '{INPUT_KEY}' is {shapes[INPUT_KEY][1:]} and '{TARGET_KEY}' "
                            f"{shapes[TARGET_KEY][1:]}; {expected}")
        channels = {key: shape[0] for key, shape in shapes.items()}
        names = {key: _names(f[key].attrs, channels[key]) for key in channels}
        vectors = {key: _vectors(path, key, f[key].attrs, channels[key]) for key in channels}
        mean = f[TARGET_KEY].attrs.get(MEAN_ATTR)
        mean = tuple(float(v) for v in np.atleast_1d(mean)) if mean is not None and np.size(mean) == channels[TARGET_KEY] else None
    return VolumeFile(path, shapes[INPUT_KEY][1], channels, names, vectors, mean)


def split_path(data_dir, split: str) -> Path:
    return Path(data_dir) / f"{split}.h5"


def check_channels(file: VolumeFile, in_chans: int, out_chans: int) -> None:
    """The file must hold the channels the model takes and makes."""
    for key, config_key, wanted in ((INPUT_KEY, "in_chans", in_chans), (TARGET_KEY, "out_chans", out_chans)):
        if file.channels[key] != wanted:
            raise DataError(f"{file.path}: '{key}' has {file.channels[key]} channels but the config's {config_key} is "
                            f"{wanted}; set --{config_key} {file.channels[key]} or use other data")


# ---------------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------------


class VolumeDataset(LazyH5, Dataset):
    """Cubic (input, target) crops of one box; see the module docstring.

    Length: ``samples`` crops, or with 0 the ``(side // crop_size)³`` crops that tile the box (validation
    then reads exactly those, every voxel once). ``augment``: "none", "host" (the symmetry is applied
    here) or "device" (items are ``(input, target, code)``: the training loader's
    device-side transform applies it: utils/data/device_pipeline.py).
    Validation (``train=False``) never augments.
    """

    def __init__(self, path, crop_size: int, samples: int = 0, seed: int = 0, train: bool = True,
                 augment: str = "host", in_chans: Optional[int] = None, out_chans: Optional[int] = None):
        if augment not in AUGMENT_MODES:
            raise DataError(f"augment {augment!r} is not one of {', '.join(AUGMENT_MODES)}")
        self.file = describe_volume(path)
        if in_chans is not None:
            check_channels(self.file, in_chans, out_chans if out_chans is not None else self.file.channels[TARGET_KEY])
        if not 0 < crop_size <= self.file.side:
            raise DataError(f"{self.file.path}: crop_size {crop_size} does not fit the {self.file.side}³ box; use a "
                            f"crop_size of at most {self.file.side} (a multiple of the U-Net's 2**levels)")
        self.crop_size, self.seed, self.train = crop_size, seed, train
        self.augment = augment if train else "none"
        self.tiles = self.file.side // crop_size
        self.length = samples or self.tiles ** 3
        self.tiled = not samples
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()  # set_epoch reaches persistent workers

    def __len__(self) -> int:
        return self.length

    @property
    def epoch(self) -> int:
        return int(self._epoch.item())

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    def _draw(self, index: int) -> int:
        if self.train:
            return stable_hash(self.seed, _TRAIN_STREAM, self.epoch, index)
        return stable_hash(self.seed, _VALID_STREAM, index)

    def crop_origin(self, index: int) -> tuple[int, int, int]:
        """Corner of crop ``index``: a tile of the box, or anywhere the crop fits."""
        if self.tiled and not self.train:
            t = self.tiles
            return tuple(self.crop_size * c for c in (index // (t * t), index // t % t, index % t))
        positions = self.file.side - self.crop_size + 1
        draw = self._draw(index)
        return tuple(stable_hash(draw, axis) % positions for axis in range(3))

    def symmetry_code(self, index: int) -> int:
        """The symmetry crop ``index`` is turned by this epoch (0, the identity, without augmentation)."""
        return stable_hash(self._draw(index), 3) % NUM_SYMMETRIES if self.augment != "none" else 0

    def _read(self, key: str, origin: tuple[int, int, int]) -> torch.Tensor:
        z, y, x = origin
        s = self.crop_size
        try:
            block = self.h5_dataset(key, self.file.path, key)[:, z:z + s, y:y + s, x:x + s]  # only this hyperslab
        except (OSError, RuntimeError) as e:
            raise DataError(f"{self.file.path}: cannot read '{key}' ({h5_reason(e)}); the file is truncated or "
                            "corrupt: download or generate it again") from None
        return torch.from_numpy(np.ascontiguousarray(block, dtype=np.float32))

    def __getitem__(self, index: int):
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} crops")
        origin = self.crop_origin(index)
        inputs, target = self._read(INPUT_KEY, origin), self._read(TARGET_KEY, origin)
        code = self.symmetry_code(index)
        if self.augment == "device":
            return inputs, target, code
        if code:
            inputs = apply_symmetry(inputs, code, self.file.vectors[INPUT_KEY])
            target = apply_symmetry(target, code, self.file.vectors[TARGET_KEY])
        return inputs, target

    def __repr__(self) -> str:
        where = "tiling the box" if self.tiled and not self.train else "anywhere"
        return (f"VolumeDataset({self.file.path}, {self.file.side}³ box, {len(self)} crops of {self.crop_size}³ "
                f"{where}, augment {self.augment})")


# ---------------------------------------------------------------------------------------------------
# What the config takes from the data, and the loaders
# ---------------------------------------------------------------------------------------------------


def resolve_volume(cfg) -> VolumeFile:
    """Check the config against both split files and fill in ``channel_names`` (the targets'); returns the
    training file."""

    d, m = cfg.data, cfg.model
    files = []
    for split in (d.train_split, d.valid_split):
        path = split_path(d.data_dir, split)
        if not path.is_file():
            raise DataError(f"{path} does not exist{relative_note(path)}: see datasets/README.md for SC22's data, or "
                            f"generate a stand-in: `{STAND_IN.format(root=d.data_dir)}`")
        files.append(describe_volume(path))
        check_channels(files[-1], m.in_chans, m.out_chans)
    train = files[0]
    if not d.channel_names:
        d.channel_names = list(train.names[TARGET_KEY] or (f"channel {c}" for c in range(m.out_chans)))
    missing = [name for name in d.key_channels if name not in d.channel_names]
    if missing:
        raise ConfigError(f"key_channels {missing} are not target channels of the data; channel_names: {d.channel_names}")
    return train


def input_names(cfg) -> list[str]:
    """Names of the input channels, from the training file (else "input i")."""
    file = describe_volume(split_path(cfg.data.data_dir, cfg.data.train_split))
    return list(file.names[INPUT_KEY] or (f"input {c}" for c in range(file.channels[INPUT_KEY])))


def target_mean(cfg, tiles: int = 8) -> list[float]:
    """Per target channel, the training box's mean: the file's ``mean`` attribute, else estimated from
    ``tiles`` crops spread over the box (SC22's 1024³ box is 20 GB of targets: too much to read for a baseline)."""
    file = describe_volume(split_path(cfg.data.data_dir, cfg.data.train_split))
    if file.target_mean is not None:
        return list(file.target_mean)
    dataset = VolumeDataset(file.path, cfg.data.crop_size, train=False)
    picks = np.linspace(0, len(dataset) - 1, min(tiles, len(dataset))).round().astype(int)
    sums = sum(dataset[int(i)][1].double().mean(dim=(1, 2, 3)) for i in picks)
    dataset.close()
    return (sums / len(picks)).tolist()


def build_volume_loaders(cfg, rank: int = 0, world_size: int = 1):
    """(train, validation) loaders of this rank for task volume (utils.data.build_loaders' contract)."""
    d, seed, global_batch = cfg.data, cfg.train.seed, cfg.train.batch_size
    train_file = resolve_volume(cfg)
    if global_batch % world_size:
        raise DataError(f"batch_size {global_batch} is the global batch and must be divisible by the {world_size} "
                        f"ranks; use a multiple of {world_size}")
    per_rank = global_batch // world_size
    channels = dict(in_chans=cfg.model.in_chans, out_chans=cfg.model.out_chans)
    augment = "device" if d.device_transforms and d.augment == "host" else d.augment
    train_set = VolumeDataset(train_file.path, d.crop_size, d.train_samples, seed, True, augment, **channels)
    valid_set = VolumeDataset(split_path(d.data_dir, d.valid_split), d.crop_size, d.val_samples, seed, False, **channels)
    workers = dict(num_workers=d.num_workers, pin_memory=d.pin_memory, persistent_workers=d.persistent_workers,
                   prefetch_factor=d.prefetch_factor)
    train_loader = build_dataloader(train_set, per_rank, shuffle=True, seed=seed, rank=rank, world_size=world_size,
                                    drop_last=d.drop_last, **workers)
    if len(train_loader) == 0:
        raise DataError(f"{train_file.path}: {len(train_set)} training crops per epoch make no full batch of "
                        f"{global_batch} over {world_size} rank(s); raise train_samples or lower batch_size")
    def turn(moved, host):  # the codes stayed on the host: choosing the kernels needs no device synchronisation
        codes, vectors = host[0].tolist(), train_file.vectors
        return (apply_symmetries(moved[0], codes, vectors[INPUT_KEY]),
                apply_symmetries(moved[1], codes, vectors[TARGET_KEY]))

    on = augment == "device"
    train_loader = on_device(train_loader, cfg, turn if on else None, host_fields=1 if on else 0)
    valid_loader = build_dataloader(valid_set, d.val_batch_size or per_rank, shuffle=False, seed=seed, rank=rank,
                                    world_size=world_size, drop_last=False, **workers)
    return train_loader, valid_loader
