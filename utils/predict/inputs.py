"""What a prediction reads: items (times, or boxes of a volume), each the model's input and, where the data has it,
the truth; the coordinates of the output; which items to predict (``--times``).

- :class:`SplitFields`: a split of the training layout (``<split>/<year>.h5``, key ``fields``): every sample a time.
  Task sr: the input is the field downsampled as in training (bicubic by ``upscale``), the truth the field itself;
  task forecast: the input is the field, the truth at lead k the sample k x lead later in the same run of times.
  Times come from the file's ``time`` dataset (datasets/convert.py writes it), else from the file's year and its
  step (``time_step`` / ``hours_per_step``, hours or calendar months; 8760 h / samples when neither is recorded); the grid is the layout's:
  rows from 90N to 90S with both poles stored (the last row dropped, as the loader does), columns east from 0.
- :class:`CoarseFields`: coarse fields from netCDF / GRIB / Zarr of any centre, read by utils/data/foreign.py's
  rules (the caller opens them: an xarray DataArray (time, channel, lat, lon), rows north to south). Task sr only;
  no truth. The fine grid puts fine cell j at coarse index (j - (s - 1) / 2) / s, the geometry of the training
  pairs (bicubic downsampling, align_corners=False).
- :class:`Boxes`: volumes of SC22's layout (``Nbody`` inputs, ``Hydro`` truth when present), one item per file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from utils.data.common import DataError, open_h5
from utils.data.era5 import ERA5Dataset, bicubic_downsample
from utils.data.files import FIELDS_KEY, Step, YearFile, parse_step, split_step
from utils.data.volume import INPUT_KEY, TARGET_KEY, describe_volume

TIME_KEY = "time"  # datasets/convert.py's hours since 1970 beside ``fields``
EPOCH = np.datetime64("1970-01-01T00:00", "ns")


def hours_to_delta(hours) -> np.ndarray:
    return (np.asarray(hours, dtype=np.float64) * 3600e9).round().astype("timedelta64[ns]")


class Inputs:
    """Items the model predicts one by one (a time, a box), with their coordinate and the output's grid."""

    dim, plural = "time", "times"
    source: str  # what was read, for the output's attributes
    coords: np.ndarray  # one value per item: datetime64, or the item's index
    notes: list[str]  # what had to be assumed, said in the output's attributes and on the console
    units: Optional[list] = None  # of the output's channels, where the data states them

    def __len__(self) -> int:
        return len(self.coords)

    def count(self, n: int) -> str:
        """"1 time", "8 times"."""
        return f"{n} {self.dim if n == 1 else self.plural}"

    def read(self, index: int) -> torch.Tensor:
        """The model's input for item ``index``: (channels, *spatial), float32."""
        raise NotImplementedError

    def truth(self, index: int, lead: int = 0) -> Optional[torch.Tensor]:
        """What the prediction of item ``index`` (``lead`` model steps ahead for a forecast) should be, if known."""
        return None

    def grid(self, scale: int, shape: Sequence[int]) -> dict[str, tuple[np.ndarray, dict]]:
        """The output's spatial coordinates {name: (values, CF attributes)} for an output of ``shape``."""
        raise NotImplementedError

    def earlier(self, index: int, steps: int) -> Optional[int]:
        """The item ``steps`` model steps before item ``index`` in the same run of times (a lagged ensemble's
        start), None where the data holds none."""
        return None


def _latitude_attrs(order: str) -> dict:
    return {"units": "degrees_north", "standard_name": "latitude", "long_name": "latitude", "axis": "Y",
            "order": order}


LONGITUDE_ATTRS = {"units": "degrees_east", "standard_name": "longitude", "long_name": "longitude", "axis": "X"}


class SplitFields(Inputs):
    """A split of the training layout; see the module docstring."""

    def __init__(self, split_dir, channels: int, upscale: int, lead: int = 1,
                 channel_sets: Optional[tuple[Sequence[int], Sequence[int]]] = None):
        """``channel_sets`` (task diagnostic): the channel indices of the inputs and of the truth."""
        self.upscale, self.lead = upscale, lead  # upscale 1: the fields themselves are the input
        self.inputs, self.targets = channel_sets or (slice(None), slice(None))
        self.dataset = ERA5Dataset(split_dir, task="sr", upscale=upscale, crop_size=0, train=False,
                                   channels=None if channel_sets else channels)
        self.source = str(split_dir)
        self.files = self.dataset.files
        self.places = [(f, day) for f, file in enumerate(self.files) for day in range(file.days)]
        self.notes = []
        self.coords = self._times()
        with open_h5(self.files[0].path) as f:
            units = f[FIELDS_KEY].attrs.get("units")
        self.units = None if units is None or len(units) != self.files[0].channels else list(np.asarray([
            u.decode() if isinstance(u, bytes) else str(u) for u in units])[self.targets])  # the outputs' units

    def _times(self) -> np.ndarray:
        per_file = [self._file_times(file) for file in self.files]
        if any(t is None for t in per_file):
            self.notes.append("time: sample index over the split's files in name order (the files record no dates)")
            return np.arange(len(self.places))
        return np.concatenate(per_file)

    def _file_times(self, file: YearFile) -> Optional[np.ndarray]:
        with open_h5(file.path) as f:
            if TIME_KEY in f and f[TIME_KEY].shape == (file.days,):
                return EPOCH + hours_to_delta(f[TIME_KEY][:])
        if not re.fullmatch(r"\d{4}", file.path.stem):
            return None
        start = np.datetime64(f"{file.path.stem}-01-01T00:00", "ns")
        if file.step is None:
            hours = round(8760 / file.days)
            note = f"times: {hours} h apart from 1 January of each file's year (the files record no step)"
            self.notes += [] if note in self.notes else [note]
            return start + hours_to_delta(np.arange(file.days) * hours)
        step = parse_step(file.step, str(file.path))
        if step.unit == "month":
            months = np.datetime64(file.path.stem, "M") + (np.arange(file.days) * step.count).astype(int)
            return months.astype("datetime64[ns]")
        return start + hours_to_delta(np.arange(file.days) * step.count)

    def read(self, index: int) -> torch.Tensor:
        field = self.dataset.read_field(*self.places[index])[self.inputs]
        return bicubic_downsample(field, self.upscale) if self.upscale > 1 else field

    def _shifted(self, index: int, lead: int) -> Optional[int]:
        """The item ``lead`` model steps after item ``index`` (before it where negative) in the same file and run of
        consecutive times; None beyond the file or across a gap in time."""
        file, day = self.places[index]
        later = day + lead * self.lead
        segments = self.files[file].segments or (0,)
        if not 0 <= later < self.files[file].days or sum(s <= day for s in segments) != sum(s <= later for s in
                                                                                            segments):
            return None
        return index + later - day

    def truth(self, index: int, lead: int = 0) -> Optional[torch.Tensor]:
        at = self._shifted(index, lead)
        return None if at is None else self.dataset.read_field(*self.places[at])[self.targets]

    def earlier(self, index: int, steps: int) -> Optional[int]:
        return self._shifted(index, -steps)

    def step(self) -> Step:
        """The spacing of the split's samples, from its record (6 h assumed where it records none)."""
        return split_step(self.files, self.dataset.split_dir)

    def grid(self, scale: int, shape: Sequence[int]) -> dict[str, tuple[np.ndarray, dict]]:
        stored, width = self.files[0].height, self.files[0].width
        rows = stored - 1  # the loader drops the last latitude row
        if tuple(shape) != (rows, width):
            raise DataError(f"{self.dataset.split_dir}: the model maps its {rows // self.upscale}x"
                            f"{width // self.upscale} inputs to {shape[0]}x{shape[1]}, not to the {rows}x{width} "
                            "fields of the data: is this the data the checkpoint was trained on?")
        return {"latitude": (90.0 - np.arange(rows) * 180.0 / (stored - 1),
                             _latitude_attrs("descending: row 0 is 90N, as stored (the 90S row is dropped)")),
                "longitude": (np.arange(width) * 360.0 / width, LONGITUDE_ATTRS)}


class CoarseFields(Inputs):
    """Coarse fields of another centre (an xarray DataArray from utils/data/foreign.py's ``open_fields``)."""

    def __init__(self, fields, sources: Sequence[str]):
        self.fields, self.source = fields, ", ".join(map(str, sources))
        self.coords = np.asarray(fields["time"].values)
        self.notes = []
        self.units = list(fields.attrs.get("units") or []) or None

    def read(self, index: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.fields[index].values, dtype=np.float32))

    def grid(self, scale: int, shape: Sequence[int]) -> dict[str, tuple[np.ndarray, dict]]:
        lat, lon = (np.asarray(self.fields[name].values, dtype=np.float64) for name in ("lat", "lon"))
        fine = {}
        for name, coarse, cells in (("latitude", lat, shape[0]), ("longitude", lon, shape[1])):
            spacing = coarse[1] - coarse[0] if len(coarse) > 1 else 0.0
            fine[name] = coarse[0] + (np.arange(cells) - (scale - 1) / 2) * spacing / scale
        geometry = (f"fine cell j lies at coarse index (j - {(scale - 1) / 2:g}) / {scale}, as in the training pairs "
                    "(bicubic downsampling, align_corners=False)")
        return {"latitude": (fine["latitude"], {**_latitude_attrs("descending: row 0 is the northernmost"),
                                                "comment": geometry}),
                "longitude": (np.mod(fine["longitude"], 360.0), {**LONGITUDE_ATTRS, "comment": geometry})}


class Boxes(Inputs):
    """Volumes of SC22's layout, one per file: the whole ``Nbody`` box in, ``Hydro`` as the truth if present."""

    dim, plural = "box", "boxes"

    def __init__(self, paths: Sequence[Path], in_chans: int):
        self.files = [describe_volume(p) for p in paths]
        sides = {f.side for f in self.files}
        if len(sides) > 1:
            raise DataError(f"boxes of different sides ({', '.join(map(str, sorted(sides)))}): predict each on its own")
        for file in self.files:
            if file.channels[INPUT_KEY] != in_chans:
                raise DataError(f"{file.path}: '{INPUT_KEY}' has {file.channels[INPUT_KEY]} channels, the model "
                                f"takes {in_chans}")
        self.source = ", ".join(str(f.path) for f in self.files)
        self.input_names = list(self.files[0].names[INPUT_KEY] or (f"input {c}" for c in range(in_chans)))
        self.coords = np.arange(len(self.files))
        self.notes = ["box: one per input file, in the order given; values scaled as the training data stores them"]
        self.units = ["1"] * self.files[0].channels[TARGET_KEY]

    def _read(self, index: int, key: str) -> torch.Tensor:
        with open_h5(self.files[index].path) as f:
            return torch.from_numpy(np.ascontiguousarray(f[key][...], dtype=np.float32))

    def read(self, index: int) -> torch.Tensor:
        return self._read(index, INPUT_KEY)

    def truth(self, index: int, lead: int = 0) -> Optional[torch.Tensor]:
        return self._read(index, TARGET_KEY)

    def grid(self, scale: int, shape: Sequence[int]) -> dict[str, tuple[np.ndarray, dict]]:
        return {axis: (np.arange(n), {"long_name": f"voxel index along grid axis {k}", "units": "1"})
                for k, (axis, n) in enumerate(zip(("z", "y", "x"), shape))}


# ----------------------------------------------------------------------------------------- --times


def select(coords: np.ndarray, spec: Optional[str]) -> list[int]:
    """Indices of the items ``spec`` chooses: comma-separated indices (``0,5,9``), index ranges ``A:B[:STEP]``
    (B excluded, as Python's), dates (``2015-01-03T06``) and date ranges ``FROM:TO`` (both included); all if None."""
    if not spec:
        return list(range(len(coords)))
    chosen: list[int] = []
    dated = np.issubdtype(coords.dtype, np.datetime64)
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if re.fullmatch(r"-?\d+(:-?\d*)?(:\d+)?|:-?\d*(:\d+)?", part):
            bounds = [int(b) if b else None for b in part.split(":")]
            if len(bounds) == 3 and bounds[2] == 0:  # Python's slice would raise, mid-way through a prediction's set-up
                raise DataError(f"--times {part}: a step of 0 moves nowhere: give a step of 1 or more, e.g. "
                                f"--times {part.rpartition(':')[0]}:1")
            picked = list(range(len(coords)))[slice(*bounds)] if ":" in part else [_index(bounds[0], coords, part)]
        elif dated:
            first, _, last = part.partition("/") if "/" in part else _split_dates(part)
            start, end = _date(first, part), _date(last or first, part)
            picked = [int(i) for i in np.flatnonzero((coords >= start) & (coords <= _day_end(last or first, end)))]
        else:
            raise DataError(f"--times {part}: the inputs record no dates (their items are numbered 0 to "
                            f"{len(coords) - 1}): give indices, e.g. --times 0:8 or --times 0,4")
        if not picked:
            raise DataError(f"--times {part}: chooses none of the {len(coords)} items (from {shown(coords[0])} to "
                            f"{shown(coords[-1])})")
        chosen += [i for i in picked if i not in chosen]
    return sorted(chosen)


def _index(value: int, coords: np.ndarray, part: str) -> int:
    if not -len(coords) <= value < len(coords):
        raise DataError(f"--times {part}: no item {value}; the inputs hold {len(coords)} (0 to {len(coords) - 1})")
    return value % len(coords)


def _split_dates(part: str) -> tuple[str, str, str]:
    # "2015-01-01:2015-01-05" and "2015-01-01T06:00" both hold colons: a range has a date on each side.
    match = re.fullmatch(r"(\d{4}-\d\d(?:-\d\d)?(?:T[\d:]+)?):(\d{4}-\d\d(?:-\d\d)?(?:T[\d:]+)?)", part)
    return (match.group(1), ":", match.group(2)) if match else (part, "", "")


def _date(text: str, part: str) -> np.datetime64:
    try:
        return np.datetime64(text, "ns")
    except ValueError:
        raise DataError(f"--times {part}: {text!r} is neither an index nor a date (2015-01-03 or 2015-01-03T06)") from None


def _day_end(text: str, end: np.datetime64) -> np.datetime64:
    """A date without an hour stands for its whole day (month: its whole month)."""
    if "T" in text:
        return end
    unit = "D" if text.count("-") == 2 else "M"
    return (np.datetime64(text, unit) + np.timedelta64(1, unit)).astype("datetime64[ns]") - np.timedelta64(1, "ns")


def shown(value) -> str:
    """An item's coordinate as said on the console: 2015-01-03T06:00, 2015-01-01, or the index."""
    return str(np.datetime64(value, "m")).replace("T00:00", "") if isinstance(value, np.datetime64) else str(value)
