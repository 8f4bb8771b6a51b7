"""The output: a Zarr store (or a netCDF file made from one) that xarray opens with nothing of this project, written
by any number of ranks, resumable after a kill.

Layout (WeatherBench 2's for forecasts): one data variable per physical variable, its WeatherBench 2 long name
where the channel maps to one (``t2m`` -> ``2m_temperature``; ``z500`` -> ``geopotential`` at ``level`` 500,
with the levels of every such variable on one ``level`` axis, NaN where a variable lacks a level), else the
channel's name (spaces as underscores, the name itself in ``long_name``); CF ``units`` per variable. Dimensions:
``realization`` first for an ensemble (predict.py --members), ``time`` (a forecast's initial time) or ``box``, then ``prediction_timedelta`` for forecasts, ``level`` where
needed, and the grid (``latitude``, ``longitude`` with CF attributes; ``z``, ``y``, ``x`` for boxes). Chunks:
a batch of items (times or boxes; of one member), so that a region of items is whole chunks.

Writing: rank 0 creates the store under a temporary name beside the output (``.<name>.partial``): its metadata
and coordinates, every data chunk unwritten (zarr stores no chunk that holds only the fill value: what xarray's
``compute=False`` does with dask, which this project does not need). Then each rank writes its own units (a batch
of consecutive items) as regions of whole chunks (:meth:`Store.write`), and after each records the unit as done in
``.<name>.progress/`` beside it (a unit killed half-way is not recorded, and is written again, whole, by the next run). A run
started again with the same request continues with the units not done; one with another request is refused.
When every unit is done rank 0 renames the store to the output's name (a netCDF output is written from the store
under a temporary name first): nothing half-written ever has the final name.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch.distributed as dist

from utils.checkpoint.files import replaced_atomically
from utils.data.common import DataError
from utils.data.foreign import ALIASES, DERIVED, INSTALL_BASE, LONG_NAMES, UNITS

SHORT_TO_LONG = {short: long for long, short in LONG_NAMES.items()}
REQUEST = "request.json"
FORMATS = {".zarr": "zarr", ".nc": "netcdf", ".nc4": "netcdf"}
MONTHS = "calendar months"  # the unit of monthly leads in prediction_timedelta (evaluate.py reads it)
# What predict.py and evaluate.py read and write with (requirements.txt). Each is imported here, not only xarray:
# xarray imports zarr and netCDF4 when a store or a file is opened, and then their absence is a traceback.
READERS = ("xarray", "zarr", "netCDF4")


def xarray():
    """xarray, once every one of READERS imports, or one line that names the one missing and the install that brings
    it (imported on use: xarray brings pandas, about a second, which the training scripts never need)."""
    for name in READERS:
        try:
            importlib.import_module(name)
        except ImportError:
            raise DataError(f"reading and writing netCDF and Zarr needs {', '.join(READERS)}; {name} is not "
                            f"installed: {INSTALL_BASE}") from None
    return sys.modules["xarray"]


def zarr_module():
    xarray()  # the same requirement, said the same way
    return sys.modules["zarr"]


# ----------------------------------------------------------------------------------------- names


def variable_of(channel: str) -> tuple[str, Optional[float]]:
    """(variable name, pressure level in hPa or None) a channel is written as (module docstring)."""
    short = ALIASES.get(channel, channel)
    if short in SHORT_TO_LONG:
        return SHORT_TO_LONG[short], None
    match = re.fullmatch(r"([a-z]+)(\d+(?:\.\d+)?)", short)
    if match and match.group(1) in SHORT_TO_LONG:
        return SHORT_TO_LONG[match.group(1)], float(match.group(2))
    return re.sub(r"[^\w.+-]+", "_", channel).strip("_") or "channel", None


def channel_units(channel: str, stated: Optional[str]) -> Optional[str]:
    """The channel's units: as the data states them, else the known unit of its variable."""
    if stated:
        return stated
    if channel in DERIVED:
        return DERIVED[channel][2]
    short = ALIASES.get(channel, channel)
    match = re.fullmatch(r"([a-z]+)\d+(?:\.\d+)?", short)
    return UNITS.get(short) or (UNITS.get(match.group(1)) if match else None)


class Layout:
    """Channels -> data variables (with levels), and the template and regions of the store."""

    def __init__(self, channels: Sequence[str], units: Sequence[Optional[str]], item_dim: str,
                 grid: dict[str, tuple[np.ndarray, dict]], leads: Optional[np.ndarray] = None,
                 lead_text: Optional[str] = None, members: Optional[int] = None):
        """``leads``: timedelta64 for steps of hours, counts of months for monthly data (``lead_text``: one
        forecast step in the data's unit, "6 h", "1 month"); ``members``: an ensemble's, on a first dimension
        ``realization`` (WeatherBench 2's name for it)."""
        self.channels, self.item_dim, self.grid, self.leads = list(channels), item_dim, grid, leads
        self.members = members
        self.lead_text = lead_text
        self.variables: dict[str, list[tuple[int, Optional[float]]]] = {}
        self.units: dict[str, Optional[str]] = {}
        for index, (channel, unit) in enumerate(zip(channels, units)):
            name, level = variable_of(channel)
            self.variables.setdefault(name, []).append((index, level))
            self.units.setdefault(name, channel_units(channel, unit))
        levels = {lv for entries in self.variables.values() for _, lv in entries if lv is not None}
        self.levels = np.array(sorted(levels), dtype=np.float64)
        for name, entries in self.variables.items():
            if len({lv is None for _, lv in entries}) > 1 or len({lv for _, lv in entries}) != len(entries):
                raise DataError(f"channels {', '.join(channels[i] for i, _ in entries)} would all be variable {name}: "
                                "rename one (a level may appear once, and not beside the variable without a level)")

    def dims(self, name: str) -> tuple[str, ...]:
        leveled = self.variables[name][0][1] is not None
        return (*(("realization",) if self.members else ()), self.item_dim, *(("prediction_timedelta",) if self.leads is not None else ()),
                *(("level",) if leveled else ()), *self.grid)

    def _shape(self, name: str, items: int) -> tuple[int, ...]:
        sizes = {"realization": self.members or 0, self.item_dim: items, "prediction_timedelta": len(self.leads) if self.leads is not None else 0,
                 "level": len(self.levels), **{k: len(v[0]) for k, v in self.grid.items()}}
        return tuple(sizes[d] for d in self.dims(name))

    def template(self, coords: np.ndarray, attrs: dict, item_attrs: dict, chunk: int = 1):
        """The whole store's Dataset, every data value the fill value (a broadcast: no memory), and its encoding:
        ``chunk`` items a chunk, a batch's (each batch one whole chunk of each variable: its rank alone writes it,
        and a chunk's fixed cost is paid once a batch)."""
        xr = xarray()
        names = {self.item_dim: (coords, item_attrs), **self.grid}
        if self.members:
            names["realization"] = (np.arange(self.members), {"long_name": "ensemble member", "units": "1"})
        monthly = self.leads is not None and not np.issubdtype(self.leads.dtype, np.timedelta64)
        if self.leads is not None:
            names["prediction_timedelta"] = (self.leads, {"long_name": "lead time of the forecast", **(
                {"units": MONTHS, "comment": "monthly data: the verifying time is the initial time plus "
                 "this many calendar months, no fixed duration"} if monthly else {})})
        if len(self.levels):
            names["level"] = (self.levels, {"units": "hPa", "long_name": "pressure level", "positive": "down",
                                            "standard_name": "air_pressure"})
        variables, encoding = {}, {}
        for name, entries in self.variables.items():
            channels = [self.channels[i] for i, _ in entries]
            var_attrs = {"long_name": channels[0] if len(entries) == 1 else name,
                         "channels": ", ".join(channels)}
            if self.units[name]:
                var_attrs["units"] = self.units[name]
            shape = self._shape(name, len(coords))
            variables[name] = xr.Variable(self.dims(name), np.broadcast_to(np.float32(np.nan), shape), var_attrs)
            # An ensemble's chunk is one member's batch: its rank alone writes it, as a batch of items.
            chunks = (1, chunk, *shape[2:]) if self.members else (chunk, *shape[1:])
            encoding[name] = {"chunks": chunks, "dtype": "float32", "_FillValue": np.float32(np.nan)}
        ds = xr.Dataset(variables, coords={k: xr.Variable((k,), v, a) for k, (v, a) in names.items()}, attrs=attrs)
        if np.issubdtype(np.asarray(coords).dtype, np.datetime64):
            encoding[self.item_dim] = {"units": "hours since 1970-01-01", "calendar": "proleptic_gregorian",
                                       "dtype": "float64"}
        if self.leads is not None and not monthly:
            encoding["prediction_timedelta"] = {"units": "hours", "dtype": "float64"}
        return ds, encoding

    def region(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """Each data variable's values for items given as ``values`` (items, [leads], channels, *grid)."""
        channel_axis = 2 if self.leads is not None else 1
        variables = {}
        for name, entries in self.variables.items():
            if entries[0][1] is None:
                variables[name] = np.take(values, entries[0][0], axis=channel_axis)
                continue
            shape = list(values.shape)
            shape[channel_axis] = len(self.levels)
            data = variables[name] = np.full(shape, np.nan, dtype=np.float32)
            for index, level in entries:
                at = int(np.flatnonzero(self.levels == level)[0])
                data[(slice(None),) * channel_axis + (at,)] = np.take(values, index, axis=channel_axis)
        return variables


def channel_values(ds, channels: Sequence[str]) -> np.ndarray:
    """The channels back out of an opened store (items, [leads], channels, *grid): what a test or a score reads."""
    out = []
    for channel in channels:
        name, level = variable_of(channel)
        var = ds[name] if level is None else ds[name].sel(level=level)
        out.append(np.asarray(var.values))
    return np.stack(out, axis=2 if "prediction_timedelta" in ds.dims else 1)


# ----------------------------------------------------------------------------------------- the store


def output_format(out: Path) -> str:
    suffix = out.suffix.lower()
    if suffix not in FORMATS:
        raise DataError(f"--out {out}: name a Zarr store (.zarr) or a netCDF file (.nc)")
    return FORMATS[suffix]


def check_writable(out: Path) -> None:
    """DataError (one line) unless files can be made where the output goes, before any work and before anything of
    it is written: tried with a file made and removed there, as permissions alone do not tell (root ignores them, a
    read-only mount does not show in them). Folders still missing are tried at the nearest one there is (the
    store creates them)."""
    place = out.parent
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        if not place.is_dir():
            raise NotADirectoryError(f"{place} is a file")
        tempfile.TemporaryFile(dir=place).close()
    except OSError as error:
        raise DataError(f"--out {out}: cannot write there ({error.strerror or error}): choose a folder you can write "
                        "to") from None


class Store:
    """The temporary Zarr store of one output, its progress, and the rename at the end (module docstring)."""

    def __init__(self, out, request: dict):
        self.out = Path(out)
        self.format = output_format(self.out)
        self.partial = self.out.with_name(f".{self.out.name}.partial")
        self.progress = self.out.with_name(f".{self.out.name}.progress")
        self.request = json.loads(json.dumps(request))  # as it reads back from the file
        self._group = None

    def prepare(self, make_template: Callable[[], tuple], units: int) -> list[int]:
        """On every rank: the units already done. Rank 0 refuses an output in use or a partial store of another
        request (one line, every rank raises it), and creates the store if there is none."""
        verdict: object = None
        if _rank() == 0:
            try:
                verdict = self._prepare_on_rank0(make_template)
            except DataError as error:
                verdict = error
        if dist.is_initialized() and dist.get_world_size() > 1:
            shared = [verdict]
            dist.broadcast_object_list(shared, src=0)
            verdict = shared[0]
        if isinstance(verdict, Exception):
            raise verdict
        return sorted(u for u in range(units) if (self.progress / f"unit_{u:06d}").exists())

    def _prepare_on_rank0(self, make_template: Callable[[], tuple]) -> Optional[str]:
        if self.out.exists():
            raise DataError(f"--out {self.out} exists: choose another name, or delete it to predict again")
        request_file = self.progress / REQUEST
        if request_file.is_file():
            saved = json.loads(request_file.read_text())
            if saved != self.request:
                differ = sorted(k for k in {*saved, *self.request} if saved.get(k) != self.request.get(k))
                raise DataError(f"{self.partial} holds an unfinished prediction of another request ({', '.join(differ)} "
                                f"differ): run the same command again to finish it, or delete it")
            return "resumed"
        for stale in (self.partial, self.progress):  # a run killed before its request was recorded: nothing to keep
            if stale.exists():
                shutil.rmtree(stale)
        ds, encoding = make_template()
        ds.to_zarr(self.partial, mode="w-", encoding=encoding, zarr_format=2, consolidated=True)
        self.progress.mkdir()
        with replaced_atomically(request_file) as temporary:  # last: its presence says the store is complete
            temporary.write_text(json.dumps(self.request, indent=1, sort_keys=True))
        return None

    def write(self, variables: dict[str, np.ndarray], first: int, unit: int, member: Optional[int] = None) -> None:
        """Items ``first`` on of each variable (of ensemble member ``member``: a region of whole chunks), then unit
        ``unit`` recorded as done.
        Straight into the arrays xarray created, as xarray's ``to_zarr(region=...)`` would, without its checks of
        the whole store at every call (tens of milliseconds each)."""
        if self._group is None:
            self._group = zarr_module().open_group(str(self.partial), mode="r+", zarr_format=2)
        for name, data in variables.items():
            at = (slice(first, first + len(data)),) if member is None else (member, slice(first, first + len(data)))
            self._group[name][at] = data
        (self.progress / f"unit_{unit:06d}").touch()

    def finish(self, units: int) -> Path:
        """Rank 0, once every rank is done: the store (or the netCDF file) under the output's name."""
        missing = [u for u in range(units) if not (self.progress / f"unit_{u:06d}").exists()]
        if missing:
            raise DataError(f"{self.partial}: {len(missing)} of {units} units were not written (first: {missing[0]}); "
                            "run the same command again to write them")
        if self.format == "zarr":
            os.replace(self.partial, self.out)
            shutil.rmtree(self.progress)
            return self.out
        xr = xarray()
        with xr.open_zarr(self.partial, chunks=None, consolidated=False) as ds:
            for var in ds.variables.values():
                var.encoding = {k: v for k, v in var.encoding.items() if k in ("units", "calendar", "dtype",
                                                                                "_FillValue")}
            with replaced_atomically(self.out) as temporary:
                ds.to_netcdf(temporary)
        shutil.rmtree(self.partial)
        shutil.rmtree(self.progress)
        return self.out


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
