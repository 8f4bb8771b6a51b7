"""What a forecast is judged against (evaluate.py): the truth at given times, and a climatology by day of year and
hour of day, both on the forecast's grid and levels.

- :class:`FolderTruth`: a split of the training layout (``<split>/<year>.h5``), its times as predict.py reads them
  (utils/predict/inputs.py: the files' ``time`` record, else year and step) and its channels mapped to WeatherBench 2's
  variables by the names predict.py writes (``z500`` -> ``geopotential`` at level 500).
- :class:`StoreTruth`: a Zarr store or netCDF file in the forecast's own layout (``time``, variables by long name,
  optional ``level``, ``latitude``, ``longitude``): WeatherBench 2's ERA5, for instance.
- :class:`Climatology`: mean fields by (day of year, hour of day), computed from a split of the training layout (by
  calendar month where the split is monthly) or read from a file of WeatherBench 2's climatology layout (dims
  ``dayofyear`` 1..366, ``hour``, [``level``], ``latitude``, ``longitude``). A key the source lacks takes the
  nearest time of year it holds (counted).
- Monthly data (:func:`is_monthly`: stamps a month apart, at whatever day and hour) are matched by calendar month.

Grids are matched by value, never by position: latitude may run either way (the project writes north to south,
WeatherBench 2's ERA5 south to north), longitude is compared modulo 360.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from utils.data.common import DataError
from utils.predict.inputs import SplitFields
from utils.predict.store import variable_of, xarray

GRID_TOLERANCE_DEG = 1e-4
HOURS_OF_YEAR = 366 * 24


class Grid:
    """The forecast's variables and coordinates that every truth and climatology is aligned to."""

    def __init__(self, variables: dict[str, bool], levels: np.ndarray, latitude: np.ndarray, longitude: np.ndarray):
        self.variables = variables  # name -> whether it has the level axis
        self.levels, self.latitude, self.longitude = levels, latitude, longitude

    def shape(self, name: str, n: int) -> tuple[int, ...]:
        return (n, *((len(self.levels),) if self.variables[name] else ()), len(self.latitude), len(self.longitude))


def positions(want: np.ndarray, have: np.ndarray, what: str, where: str, modulo: Optional[float] = None) -> np.ndarray:
    """Index in ``have`` of each value of ``want`` (to GRID_TOLERANCE_DEG): the grids must hold the same points."""
    want, have = np.asarray(want, dtype=np.float64), np.asarray(have, dtype=np.float64)
    gap = np.abs(want[:, None] - have[None, :])
    if modulo:
        gap = np.minimum(gap % modulo, modulo - gap % modulo)
    found = gap.argmin(axis=1)
    missing = want[gap[np.arange(len(want)), found] > GRID_TOLERANCE_DEG]
    if len(missing):
        raise DataError(f"{where}: its {what} lacks {len(missing)} of the forecast's {len(want)} values (first: "
                        f"{missing[0]:g}); regrid one of the two to the other's grid")
    return found


class Fields:
    """A source of fields by index, each channel one (variable, level), aligned to a :class:`Grid`."""

    where: str
    times: np.ndarray  # datetime64[ns], one per index

    def __init__(self, grid: Grid):
        self.grid = grid

    def read(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        raise NotImplementedError


class FolderTruth(Fields):
    """A split of the training layout (module docstring)."""

    def __init__(self, split_dir: Path, grid: Grid):
        super().__init__(grid)
        self.split = SplitFields(split_dir, None, upscale=1)
        self.where = str(split_dir)
        self.times = np.asarray(self.split.coords)
        if not np.issubdtype(self.times.dtype, np.datetime64):
            raise DataError(f"{split_dir}: its files record no dates (no 'time', no year in their names), so no "
                            "forecast's verifying time can be found in them")
        names = self.split.files[0].names
        if not names:
            raise DataError(f"{split_dir}: its files record no channel names (attribute 'channels' of 'fields'), so "
                            "no forecast variable can be matched to them")
        channels = {variable_of(name): c for c, name in enumerate(names)}
        self.channels = {}  # variable -> one channel per level (None: the truth lacks that level)
        for name, leveled in grid.variables.items():
            wanted = [(name, float(level)) for level in grid.levels] if leveled else [(name, None)]
            self.channels[name] = [channels.get(key) for key in wanted]
            if all(c is None for c in self.channels[name]):
                raise DataError(f"{split_dir}: no channel of forecast variable {name} (its channels: "
                                f"{', '.join(names)})")
        stored, width = self.split.files[0].height, self.split.files[0].width
        coords = self.split.grid(1, (stored - 1, width))  # the grid predict.py writes: the 90S row dropped
        self.rows = positions(grid.latitude, coords["latitude"][0], "latitude", self.where)
        self.columns = positions(grid.longitude, coords["longitude"][0], "longitude", self.where, 360.0)

    def read(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        fields = np.stack([self.split.read(i).numpy() for i in indices]) if len(indices) else np.zeros(
            (0, self.split.files[0].channels, len(self.rows), len(self.columns)), np.float32)
        fields = fields[:, :, self.rows][..., self.columns]
        out = {}
        for name, channels in self.channels.items():
            data = np.full((len(indices), len(channels), *fields.shape[2:]), np.nan, dtype=np.float32)
            for k, channel in enumerate(channels):
                if channel is not None:
                    data[:, k] = fields[:, channel]
            out[name] = data if self.grid.variables[name] else data[:, 0]
        return out


def open_store(path: Path):
    xr = xarray()
    if not path.exists():
        raise DataError(f"{path}: no such file or store")
    try:
        return xr.open_zarr(path, chunks=None) if path.suffix == ".zarr" or path.is_dir() else xr.open_dataset(path)
    except (OSError, ValueError, KeyError) as error:
        raise DataError(f"{path}: not a Zarr store or netCDF file xarray can open ({error})") from None


class StoreTruth(Fields):
    """A Zarr store or netCDF file in the forecast's layout (module docstring)."""

    def __init__(self, path: Path, grid: Grid):
        super().__init__(grid)
        self.where, self.ds = str(path), open_store(path)
        if "time" not in self.ds.coords or "prediction_timedelta" in self.ds.dims:
            raise DataError(f"{path}: the truth needs a 'time' coordinate and no 'prediction_timedelta' (is this a "
                            "forecast?)")
        self.times = np.asarray(self.ds["time"].values).astype("datetime64[ns]")
        lacking = [name for name in grid.variables if name not in self.ds.data_vars]
        if lacking:
            raise DataError(f"{path}: no variable {', '.join(lacking)} (it holds: {', '.join(self.ds.data_vars)})")
        self.rows = positions(grid.latitude, self.ds["latitude"].values, "latitude", self.where)
        self.columns = positions(grid.longitude, self.ds["longitude"].values, "longitude", self.where, 360.0)

    def read(self, indices: Sequence[int]) -> dict[str, np.ndarray]:
        return {name: self._variable(name, list(indices)) for name in self.grid.variables}

    def _variable(self, name: str, indices: list[int]) -> np.ndarray:
        var = self.ds[name]
        leveled = self.grid.variables[name]
        order = ("time", *(("level",) if leveled else ()), "latitude", "longitude")
        if set(var.dims) != set(order):
            raise DataError(f"{self.where}: variable {name} has dims {var.dims}, expected {order}")
        values = np.asarray(var.transpose(*order).isel(time=indices, latitude=self.rows, longitude=self.columns).values,
                            dtype=np.float32)
        if not leveled:
            return values
        return _levels_of(values, self.ds["level"].values, self.grid.levels, axis=1)


def _levels_of(values: np.ndarray, have: np.ndarray, want: np.ndarray, axis: int) -> np.ndarray:
    """``values`` at levels ``have`` -> at levels ``want`` along ``axis``, NaN where a level is absent."""
    shape = list(values.shape)
    shape[axis] = len(want)
    out = np.full(shape, np.nan, dtype=np.float32)
    for k, level in enumerate(want):
        match = np.flatnonzero(np.isclose(np.asarray(have, dtype=np.float64), level))
        if len(match):
            out[(slice(None),) * axis + (k,)] = np.take(values, match[0], axis=axis)
    return out


# ----------------------------------------------------------------------------------------- times


def months_of(times: np.ndarray) -> np.ndarray:
    """Each time's calendar month as one integer (months since January 1970), whatever its day and hour."""
    return np.asarray(times).astype("datetime64[ns]").astype("datetime64[M]").astype(np.int64)


def is_monthly(times: np.ndarray) -> bool:
    """Whether stamps come one a month: never two in a calendar month, 28 to 31 days (give or take a day) per month
    between consecutive ones (a missing month is a gap of two). Archives stamp each month at its centre, at hours
    that wander, so "initial time + n months" is not the stamp of the month reached: such data is matched by month."""
    stamps = np.unique(np.asarray(times).astype("datetime64[ns]"))
    if len(stamps) < 2:
        return False
    steps, days = np.diff(months_of(stamps)), np.diff(stamps) / np.timedelta64(1, "D")
    return bool((steps >= 1).all() and ((days >= 27 * steps) & (days <= 32 * steps)).all())


# ----------------------------------------------------------------------------------------- climatology


def time_keys(times: np.ndarray, by_month: bool = False) -> np.ndarray:
    """(day of year 1..366, hour of day) of each time, as WeatherBench 2 keys its climatology; monthly data:
    (month 1..12, 0), since their stamps' days and hours wander from year to year."""
    import pandas as pd  # xarray's own dependency

    index = pd.DatetimeIndex(np.asarray(times).astype("datetime64[ns]"))
    if by_month:
        return np.stack([index.month.to_numpy(), np.zeros(len(index), dtype=np.int64)], axis=1)
    return np.stack([index.day_of_year.to_numpy(), index.hour.to_numpy()], axis=1)


def nearest_keys(wanted: np.ndarray, available: np.ndarray, by_month: bool = False) -> np.ndarray:
    """For each wanted key, the available key nearest in time of year (circular over a 366-day year, or 12 months)."""
    at = lambda keys: keys[:, 0].astype(np.int64) * (1 if by_month else 24) + keys[:, 1]
    period = 12 if by_month else HOURS_OF_YEAR
    gap = np.abs(at(wanted)[:, None] - at(available)[None, :]) % period
    gap = np.minimum(gap, period - gap)
    return available[gap.argmin(axis=1)]


class Climatology:
    """Mean fields by (day of year, hour of day), or by calendar month (``by_month``), for the keys asked for once
    (:meth:`prepare`), then looked up."""

    def __init__(self, source: str, available: np.ndarray, load, by_month: bool = False):
        self.source, self.available, self._load, self.by_month = source, available, load, by_month
        self.keys = "(month)" if by_month else "(day of year, hour)"
        self.table: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self.substituted = 0  # wanted keys the source lacks, served by the nearest it holds

    @classmethod
    def from_split(cls, truth: FolderTruth) -> "Climatology":
        """Averages of a split's samples (the training split: no forecast's verifying time among them); of monthly
        data, by calendar month."""
        by_month = is_monthly(truth.times)
        keys = time_keys(truth.times, by_month)

        def load(wanted: np.ndarray) -> dict:
            sums, counts, wanted = {}, {}, {tuple(map(int, k)) for k in wanted}
            for index, key in enumerate(tuple(map(int, k)) for k in keys):
                if key not in wanted:
                    continue
                fields = truth.read([index])
                if key not in sums:
                    sums[key], counts[key] = {n: np.zeros_like(v[0], dtype=np.float64) for n, v in fields.items()}, 0
                for name, values in fields.items():
                    sums[key][name] += values[0]
                counts[key] += 1
            return {k: {n: (v / counts[k]).astype(np.float32) for n, v in s.items()} for k, s in sums.items()}

        kind = "calendar month" if by_month else "day of year and hour of day"
        return cls(f"mean by {kind} of {truth.where} ({len(keys)} samples)", np.unique(keys, axis=0), load, by_month)

    @classmethod
    def from_file(cls, path: Path, grid: Grid) -> "Climatology":
        """A file of WeatherBench 2's climatology layout (module docstring)."""
        ds = open_store(path)
        if "dayofyear" not in ds.dims:
            raise DataError(f"{path}: a climatology needs a 'dayofyear' dimension (WeatherBench 2's layout: "
                            "dayofyear, hour, [level], latitude, longitude)")
        lacking = [name for name in grid.variables if name not in ds.data_vars]
        if lacking:
            raise DataError(f"{path}: no variable {', '.join(lacking)} (it holds: {', '.join(ds.data_vars)})")
        rows = positions(grid.latitude, ds["latitude"].values, "latitude", str(path))
        columns = positions(grid.longitude, ds["longitude"].values, "longitude", str(path), 360.0)
        days = np.asarray(ds["dayofyear"].values, dtype=np.int64)
        hours = np.asarray(ds["hour"].values, dtype=np.int64) if "hour" in ds.dims else np.array([0])
        available = np.array([(d, h) for d in days for h in hours])

        def field(name: str, day: int, hour: int) -> np.ndarray:
            var = ds[name].sel(dayofyear=day, **({"hour": hour} if "hour" in ds.dims else {}))
            order = (*(("level",) if grid.variables[name] else ()), "latitude", "longitude")
            values = np.asarray(var.transpose(*order).isel(latitude=rows, longitude=columns).values, np.float32)
            return _levels_of(values, ds["level"].values, grid.levels, axis=0) if grid.variables[name] else values

        def load(wanted: np.ndarray) -> dict:
            return {(int(d), int(h)): {n: field(n, d, h) for n in grid.variables} for d, h in wanted}

        return cls(f"{path}", available, load)

    def prepare(self, times: np.ndarray) -> None:
        """Load the keys of every time to be looked up, in one pass over the source."""
        wanted = np.unique(time_keys(times, self.by_month), axis=0)
        served = nearest_keys(wanted, self.available, self.by_month)
        self.substituted = int((served != wanted).any(axis=1).sum())
        self._serve = {tuple(map(int, w)): tuple(map(int, s)) for w, s in zip(wanted, served)}
        self.table = self._load(np.unique(served, axis=0))

    def at(self, times: np.ndarray) -> dict[str, np.ndarray]:
        rows = [self.table[self._serve[tuple(map(int, key))]] for key in time_keys(times, self.by_month)]
        return {name: np.stack([row[name] for row in rows]) for name in rows[0]} if rows else {}
