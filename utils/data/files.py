"""The files of a split of the training layout, read without reading their fields: shape, channel names, the record
of time (step and gaps), and the one-line errors when a folder holds none or files that disagree. The ERA5 dataset
(era5.py), predict.py's inputs and evaluate.py's truth read splits through :func:`scan_split`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import h5py
import numpy as np

from utils.data.common import DataError, open_h5

FIELDS_KEY = "fields"
NAMES_ATTR = "channels"  # optional attribute of ``fields``: the channel names (the synthetic files have it)
# Optional attribute of ``fields``: the sample indices where a run of consecutive time steps starts (0 first).
# datasets/convert.py records it where the source has a gap in time; forecast pairs never span two runs.
SEGMENTS_ATTR = "segment_starts"
# Optional attributes of ``fields``: the time between consecutive samples in the data's own unit ("6 h", "1 month",
# datasets/convert.py), or in hours (the synthetic files); a forecast's lead is said in it.
STEP_ATTR, HOURS_ATTR = "time_step", "hours_per_step"

# The one recipe for a small stand-in (the Makefile's `data` target, datasets/README.md and the errors).
STAND_IN = ("python datasets/make_synthetic_era5.py --out {root}{layout} --samples-per-year 64 --height {height} "
            "--width {width} --seed 0 --train-years 2008 2010 --valid-years 2015")
HOW_TO_GET_DATA = ("see datasets/README.md for the real data, or generate a stand-in: `"
                   + STAND_IN.format(root="{root}", layout="", height=181, width=360) + "`")


@dataclass(frozen=True)
class YearFile:
    path: Path
    days: int  # samples in the file (days for SuperBench, 6-hourly steps for NERSC's data)
    height: int  # as stored (721 for ERA5), before dropping the last row
    width: int
    channels: int
    names: Optional[tuple[str, ...]] = None  # the file's channel names, if it records them
    segments: Optional[tuple[int, ...]] = None  # first sample of each run of consecutive times, if recorded
    step: Optional[str] = None  # the time between consecutive samples ("6 h", "1 month"), if recorded


def _describe(path: Path) -> YearFile:
    with open_h5(path) as f:
        if FIELDS_KEY not in f:
            found = ", ".join(sorted(f.keys())) or "nothing"
            raise DataError(
                f"{path}: no dataset '{FIELDS_KEY}' (found: {found}); ERA5 files here hold one "
                f"dataset '{FIELDS_KEY}' of shape (samples, channels, lat, lon): is this the right file?"
            )
        fields = f[FIELDS_KEY]
        if not isinstance(fields, h5py.Dataset):
            raise DataError(f"{path}: '{FIELDS_KEY}' is a group, not a dataset; expected an array (samples, channels, lat, lon)")
        shape, dtype = fields.shape, fields.dtype
        names = fields.attrs.get(NAMES_ATTR)
        segments = fields.attrs.get(SEGMENTS_ATTR)
        step, hours = fields.attrs.get(STEP_ATTR), fields.attrs.get(HOURS_ATTR)
    step = str(step.decode() if isinstance(step, bytes) else step) if step is not None else (
        f"{float(hours):g} h" if hours is not None else None)
    expected = "expected (samples, channels, lat, lon) as SuperBench's and NERSC's ERA5"
    if len(shape) != 4:
        raise DataError(f"{path}: '{FIELDS_KEY}' has shape {shape} ({len(shape)} dimensions); {expected}")
    if shape[0] < 1 or shape[1] < 1 or shape[2] < 2 or shape[3] < 1:
        raise DataError(f"{path}: '{FIELDS_KEY}' has shape {shape}, too small to hold a field; {expected}")
    if not np.issubdtype(dtype, np.number):
        raise DataError(f"{path}: '{FIELDS_KEY}' holds {dtype}, not numbers; {expected}, float32")
    if names is not None:
        names = tuple(n.decode() if isinstance(n, bytes) else str(n) for n in np.atleast_1d(names))
        if len(names) != shape[1]:
            names = None  # an attribute that does not describe the channels is ignored
    if segments is not None:
        segments = tuple(int(s) for s in np.atleast_1d(segments))
        if not segments or segments[0] != 0 or any(b <= a for a, b in zip(segments, segments[1:])) \
                or segments[-1] >= shape[0]:
            # A wrong record would let forecast pairs span a gap: refuse it rather than ignore it.
            raise DataError(f"{path}: attribute '{SEGMENTS_ATTR}' of '{FIELDS_KEY}' is {list(segments)}; expected "
                            f"increasing sample indices from 0, below {shape[0]}: convert the file again")
    return YearFile(path, shape[0], shape[2], shape[3], shape[1], names, segments, step)


def pair_starts(file: YearFile, lead: int) -> Optional[np.ndarray]:
    """The samples t of a file whose t + lead lies in the same run of consecutive times, or None when the file
    records no gap (then every t < samples - lead)."""
    if lead == 0 or not file.segments or len(file.segments) == 1:
        return None
    bounds = [*file.segments, file.days]
    runs = [np.arange(start, stop - lead) for start, stop in zip(bounds, bounds[1:]) if stop - start > lead]
    return np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)


ASSUMED_STEP_HOURS = 6.0  # NERSC's ERA5 records no step; its samples are 6 h apart


@dataclass(frozen=True)
class Step:
    """The time between consecutive samples as the data records it ("6 h", "1 month"): a lead time is a count of
    them, written in their unit. A month is a step of the calendar, not a duration: it has no hours. (The reader's
    side of datasets/convert.py's Step, which writes the record without importing torch.)"""

    count: float
    unit: str  # "h" or "month"
    assumed: bool = False  # the data records none: NERSC's 6 h assumed (said where it is used)

    def times(self, n: float) -> str:
        """n steps in the data's unit: 2 x "6 h" -> "12 h", 3 x "1 month" -> "3 months"."""
        count = self.count * n
        return f"{count:g} h" if self.unit == "h" else f"{count:g} month{'s' if count != 1 else ''}"

    def __str__(self) -> str:
        return self.times(1)

    @property
    def hours(self) -> Optional[float]:
        return self.count if self.unit == "h" else None


def parse_step(text: Optional[str], where: str = "the data") -> Step:
    """A recorded step ("6 h", "24 h", "1 month", "3 months"); None (no record) -> 6 h, assumed."""
    if text is None:
        return Step(ASSUMED_STEP_HOURS, "h", assumed=True)
    match = re.fullmatch(r"(\d+(?:\.\d+)?) ?(h|months?)", text.strip())
    if not match or float(match.group(1)) <= 0:
        raise DataError(f"{where}: its time step {text!r} is neither hours ('6 h') nor months ('1 month'), so no "
                        f"lead time can be said; fix attribute '{STEP_ATTR}' of '{FIELDS_KEY}' (datasets/convert.py "
                        "writes it)")
    return Step(float(match.group(1)), "h" if match.group(2) == "h" else "month")


def split_step(files: list[YearFile], where) -> Step:
    """The one step of a split's files: files that disagree have no lead time between them."""
    recorded = sorted({str(f.step) for f in files})
    if len(recorded) > 1:
        raise DataError(f"{where}: its files record different time steps ({', '.join(recorded)}); a forecast's "
                        "lead needs one: keep one spacing per split folder")
    return parse_step(files[0].step, str(where))


def lead_time(step: Optional[str], lead: int) -> str:
    """A forecast's lead in the data's own unit: ("6 h", 2) -> "12 h", ("1 month", 3) -> "3 months"; in steps
    where the files record none."""
    if step is None:
        return f"{lead} step{'s' if lead != 1 else ''}"
    return parse_step(step).times(lead)


def check_channels(file: YearFile, in_chans: int) -> None:
    """The data must have the channel count the model takes (the config's in_chans)."""
    if file.channels != in_chans:
        raise DataError(
            f"{file.path}: the data has {file.channels} channels but the config's in_chans is {in_chans}; "
            f"set --in_chans {file.channels} (with mean, std and channel_names to match) or use other data")


def scan_split(split_dir) -> list[YearFile]:
    """Every ``*.h5`` of a split folder, sorted by name, checked to share one grid."""
    split_dir = Path(split_dir)
    if not split_dir.is_dir():
        parent = split_dir.parent
        splits = sorted(p.name for p in parent.iterdir() if p.is_dir() and any(p.glob("*.h5"))) if parent.is_dir() else []
        hint = HOW_TO_GET_DATA.format(root=parent)
        if splits:  # a data root with other splits: probably a misspelt split name
            hint = f"split folders in {parent}: {', '.join(splits)}; or {hint}"
        what = "is not a directory" if split_dir.exists() else "no such directory"
        raise DataError(f"{split_dir}: {what}; {hint}")
    paths = sorted(split_dir.glob("*.h5"))
    if not paths:
        raise DataError(
            f"{split_dir}: no .h5 files; a split folder holds one <year>.h5 per year: "
            f"{HOW_TO_GET_DATA.format(root=split_dir.parent)}"
        )
    files = [_describe(p) for p in paths]
    first = files[0]
    for other in files[1:]:
        if (other.height, other.width) != (first.height, first.width):
            raise DataError(
                f"{split_dir}: files have different grids: {first.path.name} is {first.height}x{first.width}, "
                f"{other.path.name} is {other.height}x{other.width}; all years of a split must share one grid"
            )
        if other.channels != first.channels:
            raise DataError(
                f"{split_dir}: files have different channel counts: {first.path.name} has {first.channels}, "
                f"{other.path.name} has {other.channels}; all years of a split must hold the same fields"
            )
    return files
