"""Your own gridded fields (netCDF, GRIB, Zarr) into the training layout, with xarray.

    python datasets/convert.py SOURCE... --out DIR [--channels nersc20|superbench|t850,z500,...] [--start DATE]
        [--end DATE] [--step HOURS] [--train-years Y...] [--valid-years Y...] [--test-years Y...] [--split NAME=Y,Y]
        [--lat NORTH SOUTH] [--lon WEST EAST] [--coarsen K] [--members all|0-7|0,3] [--fill refuse|mean|X] [--dry-run]

SOURCE: netCDF or GRIB files (or globs), or Zarr stores (folders, or URLs such as gs://: needs gcsfs). Writes, as
SuperBench's and NERSC's ERA5 (datasets/README.md) and what utils/data/era5.py reads:

    DIR/<split>/<year>.h5   dataset ``fields`` (samples, C, H, W) float32, one sample per chunk; attributes
                            ``channels`` (names), ``units``, ``hours_per_step``, ``segment_starts`` (gaps)
                            and a dataset ``time`` (hours since 1970-01-01 of each sample)
    DIR/stats/*.npy         compute_stats.py's statistics of the train split only (streamed)

- Channels: a CDS/WeatherBench 2 variable (short or long name: ``u10`` or ``10m_u_component_of_wind``), or
  a variable and a pressure level in hPa (``t850``, ``z500``); other variable names pass through. The
  default is every variable and level of the sources, in their order. ``nersc20`` and ``superbench`` are
  make_synthetic_era5.py's channel sets (SuperBench's 10 m "kinetic energy" is made from u10 and v10).
- Time: ``--start``/``--end`` (inclusive), ``--step`` (hours; e.g. 6 from hourly data), one file per year
  and split. A time step missing from the source is a gap: recorded in ``segment_starts``, so that no
  forecast pair spans it. Ensemble members (``--members``) are stored one after the other, each its own run.
- Space: rows from north to south and columns from 0 to 360 degrees east (reordered when the source
  differs; a regional grid starts at its western edge), then the crop and ``--coarsen K`` (every K-th
  point from the first: 721 x 1440 -> 181 x 360 at K = 4, both poles kept; the loader drops the last row).
- Robust: nothing is written before every source, variable, level, time and grid has been checked (bad
  input: one line on stderr, exit status 2); each year is written under a temporary name and renamed when
  complete, so a rerun skips complete years. NaNs (fill values decoded by xarray) are counted per channel
  and refused unless ``--fill`` says how to fill them.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time as clock
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import h5py
import numpy as np
from tqdm import tqdm

if __package__:  # imported as datasets.convert
    from .compute_stats import FIELDS_KEY, STATS_DIR, OneLineParser, StatsError, compute_stats, errors_as_one_line
    from .make_synthetic_era5 import CHANNELS as SUPERBENCH_CHANNELS, NERSC_CHANNELS, _parse_split
else:  # run as a script: datasets/ is on sys.path
    from compute_stats import FIELDS_KEY, STATS_DIR, OneLineParser, StatsError, compute_stats, errors_as_one_line
    from make_synthetic_era5 import CHANNELS as SUPERBENCH_CHANNELS, NERSC_CHANNELS, _parse_split
# The loader's attribute names (utils/data/era5.py; tests/test_convert.py checks that they agree). Not imported
# from there: importing the loader imports torch (3 s and 0.7 GB here), which a converter does not need.
NAMES_ATTR, SEGMENTS_ATTR = "channels", "segment_starts"

try:  # optional: the training scripts never need it (make install-data)
    import xarray as xr
except ImportError:  # reported as one line by main()
    xr = None

INSTALL = "pip install -r requirements-data.txt -c constraints.txt (make install-data)"
# CDS / WeatherBench 2 long names -> the short names of ERA5 (and of the configs' channels).
LONG_NAMES = {
    "10m_u_component_of_wind": "u10", "10m_v_component_of_wind": "v10", "100m_u_component_of_wind": "u100",
    "100m_v_component_of_wind": "v100", "2m_temperature": "t2m", "2m_dewpoint_temperature": "d2m",
    "surface_pressure": "sp", "mean_sea_level_pressure": "msl", "total_column_water_vapour": "tcwv",
    "sea_surface_temperature": "sst", "total_precipitation": "tp", "temperature": "t",
    "u_component_of_wind": "u", "v_component_of_wind": "v", "geopotential": "z", "relative_humidity": "r",
    "specific_humidity": "q", "vertical_velocity": "w",
}
PRESETS = {"superbench": SUPERBENCH_CHANNELS, "superbench3": SUPERBENCH_CHANNELS, "nersc20": NERSC_CHANNELS}
# SuperBench's channel names as ERA5 variables; its "kinetic energy" is derived (DERIVED).
ALIASES = {"temperature 2 m": "t2m", "total column water vapour": "tcwv"}
# SuperBench's hard-coded statistics of its 10 m channel (mean 6.30, std 3.74) have the size of a wind speed in
# m/s, and this project does not know how SuperBench made it: made here as the speed; check before mixing data.
DERIVED = {"kinetic energy 10 m": (("u10", "v10"), lambda u, v: np.sqrt(u * u + v * v))}
TIME_DIMS, MEMBER_DIMS = ("time", "valid_time"), ("number", "member", "realization")
LEVEL_DIMS = ("level", "pressure_level", "isobaricInhPa", "plev", "lev")
LAT_DIMS, LON_DIMS = ("latitude", "lat"), ("longitude", "lon")
GRIB_SUFFIXES = (".grib", ".grib1", ".grib2", ".grb", ".grb2")
HOUR = np.timedelta64(1, "h")


class ConvertError(ValueError):
    """Bad input, as one line naming what is wrong and what to do."""


@dataclass
class Source:
    """One opened file or store: its variables by short name, time, members, grid, and how to orient it."""

    path: str
    ds: object
    variables: dict  # short name -> (name in the source, level values in hPa or None)
    times: np.ndarray  # datetime64[ns], one per index of the time dimension (or one for a scalar time)
    dims: dict  # role (time, member, level, lat, lon) -> the source's dimension name
    members: np.ndarray
    lat: np.ndarray
    lon: np.ndarray
    nbytes: int


@dataclass
class Plan:
    channels: list  # output names
    units: list
    raw: list  # raw channels read: (short name, level or None)
    make: list  # per output channel: raw index, or (function, raw indices)
    lookup: dict  # raw index -> (source index per sample time, time index per sample time)
    times: np.ndarray  # every sample time, datetime64[ns]
    step: int  # hours
    members: list  # member values (or [None])
    rows: np.ndarray  # source row indices of the output grid, in output order
    cols: np.ndarray
    files: dict  # (split, year) -> time indices into ``times``


# ----------------------------------------------------------------------------------------------------------
# Opening the sources
# ----------------------------------------------------------------------------------------------------------


def expand_sources(patterns: Sequence[str]) -> list[str]:
    paths = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) and "://" not in pattern else [pattern]
        missing = [p for p in found if not os.path.exists(p) and "://" not in p]  # URLs: Zarr in the cloud
        if not found or missing:
            raise ConvertError(f"{pattern}: no such file or Zarr store; give netCDF/GRIB files, globs or Zarr folders")
        paths += [p for p in found if p not in paths]
    return paths


def _role(ds, names: Sequence[str], units: Sequence[str] = ()) -> Optional[str]:
    for name in names:
        if name in ds.dims:
            return name
    for name in ds.dims:  # CF attributes where the name is unusual
        if name in ds.coords and str(ds[name].attrs.get("units", "")).lower() in units:
            return name
    return None


def open_source(path: str) -> Source:
    try:
        if os.path.isdir(path) or "://" in path:  # chunks=None: lazy reads without dask; gs://: anonymous (gcsfs)
            ds = xr.open_zarr(path, chunks=None, consolidated=None,
                              storage_options={"token": "anon"} if path.startswith("gs://") else None)
        elif path.lower().endswith(GRIB_SUFFIXES):
            if "cfgrib" not in xr.backends.list_engines():  # cfgrib, or the ecCodes library it loads, is missing
                raise ConvertError(f"{path}: reading GRIB needs cfgrib and the ecCodes library; {INSTALL}")
            ds = xr.open_dataset(path, engine="cfgrib", backend_kwargs={"indexpath": ""}, cache=False)
        else:
            ds = xr.open_dataset(path, cache=False)
    except ConvertError:
        raise
    except Exception as e:  # noqa: BLE001 -- every backend raises its own types; all mean "cannot read"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConvertError(f"{path}: cannot be opened as netCDF, GRIB or Zarr ({first}); is it one, and is its "
                           f"reader installed? {INSTALL}") from None
    dims = {"time": _role(ds, TIME_DIMS), "member": _role(ds, MEMBER_DIMS), "level": _role(ds, LEVEL_DIMS),
            "lat": _role(ds, LAT_DIMS, ("degrees_north", "degree_north")),
            "lon": _role(ds, LON_DIMS, ("degrees_east", "degree_east"))}
    if dims["lat"] is None or dims["lon"] is None:
        raise ConvertError(f"{path}: no latitude/longitude dimensions (dimensions: {', '.join(map(str, ds.dims))}); "
                           f"expected a regular latitude-longitude grid")
    known = {d for d in dims.values() if d}
    variables = {}
    for name, var in ds.data_vars.items():
        if dims["lat"] not in var.dims or dims["lon"] not in var.dims or not np.issubdtype(var.dtype, np.number):
            continue
        extra = [f"{d} ({ds.sizes[d]})" for d in var.dims if d not in known and ds.sizes[d] > 1]
        if extra:
            raise ConvertError(f"{path}: variable {name} has dimensions {', '.join(extra)} besides time, level, member "
                               f"and grid; select one value of each first (xarray: ds.isel(...)), e.g. analyses only")
        levels = None
        if dims["level"] in var.dims:
            levels = np.asarray(ds[dims["level"]].values, dtype=float)
            if str(ds[dims["level"]].attrs.get("units", "")).lower() == "pa" or levels.max() > 2000:
                levels = levels / 100.0  # Pa -> hPa, as the channel names count
        variables[LONG_NAMES.get(str(name), str(name))] = (name, levels)
    times = _times(ds, dims["time"], path)
    members = np.asarray(ds[dims["member"]].values) if dims["member"] else np.array([None])
    nbytes = 0 if "://" in path else sum(f.stat().st_size for f in [Path(path), *Path(path).rglob("*")] if f.is_file())
    return Source(path, ds, variables, times, dims, members, np.asarray(ds[dims["lat"]].values, dtype=float),
                  np.asarray(ds[dims["lon"]].values, dtype=float), nbytes)


def _times(ds, dim: Optional[str], path: str) -> np.ndarray:
    if dim is not None:
        coord = ds[dim]
        # cfgrib: time is the analysis time, valid_time = time + step; the valid time is the field's time.
        if "valid_time" in ds.coords and ds["valid_time"].dims == (dim,):
            coord = ds["valid_time"]
    else:
        coord = next((ds[n] for n in (*TIME_DIMS, "date") if n in ds.coords and ds[n].ndim == 0), None)
    if coord is None or not np.issubdtype(coord.dtype, np.datetime64):
        raise ConvertError(f"{path}: no time coordinate of dates (found: {', '.join(map(str, ds.coords)) or 'none'}); "
                           f"give the time CF units (e.g. 'hours since 2000-01-01') so that xarray decodes it")
    times = np.atleast_1d(coord.values).astype("datetime64[ns]")
    step = np.diff(times)
    if (step <= np.timedelta64(0)).any():
        k = int(np.argmax(step <= np.timedelta64(0)))
        raise ConvertError(f"{path}: the time axis is not increasing ({_date(times[k])} then {_date(times[k + 1])} at "
                           f"index {k + 1}); sort it and drop repeated times (xarray: ds.sortby('time'))")
    return times


def _date(t) -> str:
    return str(np.datetime64(t, "m")).replace("T00:00", "")


def _check_grids(sources: list[Source]) -> None:
    first = sources[0]
    for other in sources[1:]:
        if other.lat.shape != first.lat.shape or other.lon.shape != first.lon.shape or not (
                np.allclose(other.lat, first.lat, atol=1e-4) and np.allclose(other.lon, first.lon, atol=1e-4)):
            raise ConvertError(f"mixed grids: {first.path} is {_grid(first)}, {other.path} is {_grid(other)}; "
                               f"convert each grid separately (or regrid first)")


def _grid(s: Source) -> str:
    step = abs(s.lat[1] - s.lat[0]) if len(s.lat) > 1 else 0
    return f"{len(s.lat)}x{len(s.lon)} ({step:g} degrees, latitude {s.lat[0]:g} to {s.lat[-1]:g})"


# ----------------------------------------------------------------------------------------------------------
# The plan: channels, times, grid, files; every check before anything is written
# ----------------------------------------------------------------------------------------------------------


def parse_channels(spec: Optional[str], sources: list[Source]) -> tuple[list[str], list[Optional[str]]]:
    """(names, units or None): a preset, a comma/space separated list, or every variable and level found."""
    if spec and spec.lower() in PRESETS:
        table = PRESETS[spec.lower()]
        return [n for n, _ in table], [u for _, u in table]
    if spec:
        names = [n for n in re.split(r"[,\s]+", spec.strip()) if n]
        return names, [None] * len(names)
    names = []
    for source in sources:
        for short, (_, levels) in source.variables.items():
            for name in ([short] if levels is None else [f"{short}{lv:g}" for lv in levels]):
                if name not in names:
                    names.append(name)
    if not names:
        raise ConvertError(f"{sources[0].path}: no numeric variable on the latitude-longitude grid to convert")
    return names, [None] * len(names)


def resolve_raw(name: str, sources: list[Source]) -> tuple[str, Optional[float]]:
    """A channel name as (variable, level): a variable of that name first (u10 is the 10 m wind, not u at 10 hPa)."""
    short = LONG_NAMES.get(ALIASES.get(name, name), ALIASES.get(name, name))
    if any(short in s.variables and s.variables[short][1] is None for s in sources):
        return short, None
    match = re.fullmatch(r"(.*?)(\d+(?:\.\d+)?)", short)
    if match:
        var, level = match.group(1), float(match.group(2))
        with_var = [s.variables[var][1] for s in sources if var in s.variables and s.variables[var][1] is not None]
        if with_var and any(np.isclose(levels, level).any() for levels in with_var):
            return var, level
        if with_var:
            have = sorted({f"{lv:g}" for levels in with_var for lv in levels}, key=float)
            raise ConvertError(f"channel {name}: variable {var} has no level {level:g} hPa (levels: "
                               f"{', '.join(have)}); add that level to the download or drop the channel")
    found = sorted({v for s in sources for v in s.variables})
    raise ConvertError(f"channel {name}: no variable {short} in the sources (variables: {', '.join(found) or 'none'}); "
                       f"add it to the download or drop the channel (--channels)")


def _parse_members(spec: str, available: np.ndarray) -> list:
    if spec == "all":
        return list(available)
    chosen = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        chosen += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    values = available.tolist()
    missing = [m for m in chosen if m not in values]
    if missing:
        raise ConvertError(f"--members {spec}: no member {missing[0]} in the sources (members: {values})")
    return chosen


def _axis_order(values: np.ndarray, is_lon: bool) -> np.ndarray:
    """Indices that put latitude north -> south, or longitude east from 0 (a regional grid: from its west edge)."""
    if not is_lon:
        return np.argsort(-values, kind="stable")
    wrapped = np.mod(values, 360.0)
    order = np.argsort(wrapped, kind="stable")
    ring = np.diff(np.append(wrapped[order], wrapped[order][0] + 360.0))
    if len(ring) > 1 and ring.max() > 1.5 * ring.min():  # regional: start after the widest gap
        order = np.roll(order, -(int(np.argmax(ring)) + 1))
    return order


def grid_indices(source: Source, lat_range, lon_range, coarsen: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = _axis_order(source.lat, False), _axis_order(source.lon, True)
    if lat_range:
        north, south = max(lat_range), min(lat_range)
        rows = rows[(source.lat[rows] <= north + 1e-6) & (source.lat[rows] >= south - 1e-6)]
    if lon_range:
        west, east = (v % 360.0 for v in lon_range)
        lon = np.mod(source.lon[cols], 360.0)
        east_of, west_of = lon >= west - 1e-6, lon <= east + 1e-6
        # Across 0 degrees (west > east): the columns east of WEST first, so that the crop stays contiguous.
        cols = cols[east_of & west_of] if west <= east else np.concatenate([cols[east_of], cols[west_of]])
    if len(rows) < 2 or len(cols) < 1:
        raise ConvertError(f"--lat {lat_range} --lon {lon_range}: the crop holds {len(rows)}x{len(cols)} points of "
                           f"{_grid(source)}; widen it")
    return rows[::coarsen], cols[::coarsen]


def make_plan(sources: list[Source], args) -> Plan:
    _check_grids(sources)
    names, units = parse_channels(args.channels, sources)
    if len(set(names)) != len(names):
        raise ConvertError(f"--channels names a channel twice: {', '.join(names)}")
    raw, make = [], []
    for name in names:
        needs = DERIVED[name][0] if name in DERIVED else (name,)
        indices = []
        for part in needs:
            key = resolve_raw(part, sources)
            if key not in raw:
                raw.append(key)
            indices.append(raw.index(key))
        make.append((DERIVED[name][1], indices) if name in DERIVED else indices[0])
    source_units = {short: str(s.ds[v[0]].attrs.get("units", "1")) for s in sources for short, v in s.variables.items()}
    units = [u or (source_units[raw[m][0]] if isinstance(m, int) else "1") for u, m in zip(units, make)]
    member_sets = {tuple(s.members.tolist()) for s in sources}
    if len(member_sets) > 1:
        raise ConvertError(f"the sources hold different ensemble members ({' vs '.join(map(str, member_sets))}); "
                           f"convert them separately or select the same members in each")
    members = _parse_members(args.members, sources[0].members) if sources[0].dims["member"] else [None]

    start = np.datetime64(args.start, "ns") if args.start else None
    end = np.datetime64(args.end, "ns") if args.end else None
    if end is not None and len(args.end) <= 10:
        end = end + np.timedelta64(1, "D") - np.timedelta64(1, "ns")  # a date: the whole day
    per_raw = [_raw_times(sources, short, level, start, end) for short, level in raw]
    every = np.unique(np.concatenate([t for t, _, _ in per_raw]))
    if len(every) == 0:
        raise ConvertError(f"no time between --start {args.start} and --end {args.end} in the sources")
    for (short, level), (times, _, _) in zip(raw, per_raw):
        if len(times) != len(every):
            lacking = every[~np.isin(every, times)]
            raise ConvertError(f"{_raw_name(short, level)} lacks {len(lacking)} of the {len(every)} times (first "
                               f"{_date(lacking[0])}); give every variable the same times, or choose --start/--end")
    every, step = _select_step(every, args.step)
    lookup = {}
    for k, (times, src, index) in enumerate(per_raw):
        at = np.searchsorted(times, every)
        lookup[k] = (src[at], index[at])
    rows, cols = grid_indices(sources[0], args.lat, args.lon, args.coarsen)
    return Plan(names, units, raw, make, lookup, every, step, members, rows, cols, _split_files(every, args))


def _raw_name(short: str, level: Optional[float]) -> str:
    return short if level is None else f"{short}{level:g}"


def _raw_times(sources: list[Source], short: str, level, start, end) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, source, time index) of one variable and level over every source holding it, sorted by time."""
    entries = [(s.times, i) for i, s in enumerate(sources) if short in s.variables
               and (level is None) == (s.variables[short][1] is None)
               and (level is None or np.isclose(s.variables[short][1], level).any())]
    times = np.concatenate([t for t, _ in entries])
    src = np.concatenate([np.full(len(t), i) for t, i in entries])
    index = np.concatenate([np.arange(len(t)) for t, _ in entries])
    keep = ((times >= start) if start is not None else True) & ((times <= end) if end is not None else True)
    keep = np.broadcast_to(keep, times.shape)
    order = np.argsort(times[keep], kind="stable")
    times, src, index = times[keep][order], src[keep][order], index[keep][order]
    twice = np.flatnonzero(np.diff(times) == np.timedelta64(0))
    if len(twice):
        a, b = sources[src[twice[0]]].path, sources[src[twice[0] + 1]].path
        raise ConvertError(f"{_raw_name(short, level)}: time {_date(times[twice[0]])} is in both {a} and {b}; give "
                           f"each time once (overlapping downloads?)")
    return times, src, index


def _select_step(times: np.ndarray, step: Optional[int]) -> tuple[np.ndarray, int]:
    """Times on the step's grid (hours since 1970 a multiple of it), and the step in hours."""
    hours = (times - np.datetime64("1970-01-01", "ns")) / HOUR
    if len(times) == 1:
        return times, step or 24
    diffs = np.diff(hours)
    native = float(diffs.min())
    odd = ~np.isclose(np.mod(diffs, native), 0)
    if native != int(native) or odd.any():
        raise ConvertError(f"the time steps are irregular ({native:g} h, then {diffs[np.argmax(odd)]:g} h); the "
                           f"converter needs steps of whole hours, gaps a multiple of them (monthly data: unsupported)")
    if step and step % native:
        raise ConvertError(f"--step {step} is not a multiple of the sources' {native:g} h step; choose a multiple")
    step = step or int(native)
    keep = np.isclose(np.mod(hours, step), 0)
    if not keep.any():
        raise ConvertError(f"--step {step}: no time at a multiple of {step} h after 00 UTC; choose another step")
    return times[keep], step


def _split_files(times: np.ndarray, args) -> dict:
    years = times.astype("datetime64[Y]").astype(int) + 1970
    splits = {"train": args.train_years, "valid": args.valid_years, "test": args.test_years}
    for name, chosen in args.split:
        splits.setdefault(name, [])
        splits[name] = list(splits[name] or []) + chosen
    named = {k: v for k, v in splits.items() if v}
    if not named:
        named = {"train": sorted(set(years.tolist()))}  # no split given: every year is training data
    files, seen = {}, {}
    for split, chosen in named.items():
        for year in chosen:
            if year in seen:
                raise ConvertError(f"year {year} is in both {seen[year]} and {split}; a year belongs to one split")
            seen[year] = split
            picked = np.flatnonzero(years == year)
            if not len(picked):
                raise ConvertError(f"--{split}-years {year}: no time of {year} in the sources (years there: "
                                   f"{', '.join(map(str, sorted(set(years.tolist()))))})")
            files[(split, year)] = picked
    return files


def segment_starts(times: np.ndarray, step: int, members: int) -> list[int]:
    """First sample of each run of consecutive times (every member repeats the times: its own runs)."""
    breaks = [0] + [k + 1 for k, d in enumerate(np.diff(times) / HOUR) if d != step]
    return [m * len(times) + b for m in range(members) for b in breaks]


# ----------------------------------------------------------------------------------------------------------
# Reading samples and writing years
# ----------------------------------------------------------------------------------------------------------


class Reader:
    """One output sample at a time: each (source, variable) read once per sample with all its levels, only the
    rows and columns the output keeps (their bounding box), then oriented, cropped and coarsened in memory."""

    def __init__(self, plan: Plan, sources: list[Source]):
        self.plan, self.sources = plan, sources
        self.box = (slice(plan.rows.min(), plan.rows.max() + 1), slice(plan.cols.min(), plan.cols.max() + 1))
        self.local = np.ix_(plan.rows - plan.rows.min(), plan.cols - plan.cols.min())
        self.bytes_read = 0

    def sample(self, member, t: int) -> np.ndarray:
        plan = self.plan
        groups = defaultdict(list)  # (source, time index, variable) -> [(raw index, level)]
        for k, (short, level) in enumerate(plan.raw):
            src, index = plan.lookup[k][0][t], plan.lookup[k][1][t]
            groups[(int(src), int(index), short)].append((k, level))
        raw = [None] * len(plan.raw)
        for (src, index, short), wanted in groups.items():
            source = self.sources[src]
            name, levels = source.variables[short]
            var, dims = source.ds[name], source.dims
            sel = {d: 0 for d in var.dims if d not in dims.values()}  # size-1 extra dimensions
            if dims["time"] in var.dims:
                sel[dims["time"]] = index
            if dims["member"] in var.dims:
                sel[dims["member"]] = int(np.flatnonzero(source.members == member)[0])
            order = [dims["lat"], dims["lon"]]
            if levels is not None:
                sel[dims["level"]] = [int(np.flatnonzero(np.isclose(levels, lv))[0]) for _, lv in wanted]
                order.insert(0, dims["level"])
            sel[dims["lat"]], sel[dims["lon"]] = self.box
            block = np.asarray(var.isel(sel).transpose(*order).values)
            self.bytes_read += block.nbytes
            block = block.reshape(-1, *block.shape[-2:])
            for j, (k, _) in enumerate(wanted):
                raw[k] = block[j][self.local].astype(np.float32)
        out = [raw[m] if isinstance(m, int) else m[0](*(raw[i] for i in m[1])) for m in plan.make]
        return np.stack(out).astype(np.float32, copy=False)


def fill(sample: np.ndarray, bad: np.ndarray, rule: str) -> None:
    """Fill NaNs in place: "mean" = the channel's mean over this sample's finite points, else the number."""
    for c in np.flatnonzero(bad.any(axis=(1, 2))):
        good = sample[c][~bad[c]]
        value = (good.mean() if good.size else 0.0) if rule == "mean" else float(rule)
        sample[c][bad[c]] = value


def check_existing(path: Path, plan: Plan, samples: int) -> bool:
    """True when a complete file of this plan is there (a rerun skips it); other content stops the run."""
    if not path.exists():
        return False
    shape = (samples, len(plan.channels), len(plan.rows), len(plan.cols))
    try:
        with h5py.File(path, "r") as f:
            found = f[FIELDS_KEY].shape
            names = [n.decode() if isinstance(n, bytes) else str(n) for n in f[FIELDS_KEY].attrs.get(NAMES_ATTR, [])]
    except (OSError, KeyError) as e:
        raise ConvertError(f"{path}: exists but cannot be read ({e}); remove it and convert again") from None
    if found != shape or names != plan.channels:
        raise ConvertError(f"{path}: exists with other content ({found}, channels {names}), this run writes {shape}, "
                           f"channels {plan.channels}; remove it or choose another --out")
    return True


def write_year(path: Path, plan: Plan, reader: Reader, picks: np.ndarray, rule: str, quiet: bool) -> np.ndarray:
    """Write one year under a temporary name, rename it when complete; returns the NaN count per channel."""
    members, c, h, w = plan.members, len(plan.channels), len(plan.rows), len(plan.cols)
    times = plan.times[picks]
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f"{path.name}.*.partial"):  # left by an interrupted run
        stale.unlink()
    temporary = path.with_name(f"{path.name}.{os.getpid()}.partial")
    counts = np.zeros(c, dtype=np.int64)
    try:
        with h5py.File(temporary, "w") as f:
            fields = f.create_dataset(FIELDS_KEY, (len(members) * len(picks), c, h, w), "f4", chunks=(1, c, h, w))
            fields.attrs[NAMES_ATTR] = plan.channels
            fields.attrs["units"] = plan.units
            fields.attrs["hours_per_step"] = plan.step
            fields.attrs[SEGMENTS_ATTR] = segment_starts(times, plan.step, len(members))
            fields.attrs["sources"] = sorted({os.path.basename(s.path.rstrip("/")) for s in reader.sources})
            hours = ((times - np.datetime64("1970-01-01", "ns")) // HOUR).astype(np.int64)
            f.create_dataset("time", data=np.tile(hours, len(members))).attrs["units"] = "hours since 1970-01-01"
            bar = tqdm(total=len(members) * len(picks), desc=f"{path.parent.name}/{path.name}", unit="sample",
                       disable=quiet, leave=False)
            for m, member in enumerate(members):
                for j, t in enumerate(picks):
                    sample = reader.sample(member, int(t))
                    bad = ~np.isfinite(sample)
                    if bad.any():
                        counts += bad.sum(axis=(1, 2))
                        if rule != "refuse":
                            fill(sample, bad, rule)
                    if rule != "refuse" or not counts.any():  # refused: keep counting, stop writing
                        fields[m * len(picks) + j] = sample
                    bar.update()
            bar.close()
            fields.attrs["filled"] = counts if rule != "refuse" else np.zeros(c, dtype=np.int64)
            fields.attrs["fill_rule"] = "none" if rule == "refuse" else rule
        if rule == "refuse" and counts.any():
            listed = ", ".join(f"{n} {k}" for n, k in zip(plan.channels, counts) if k)
            raise ConvertError(f"{path.parent.name}/{path.name}: NaN or fill values in the source: {listed} (of "
                               f"{len(members) * len(picks) * h * w} points per channel); nothing written for this "
                               f"year; fill them: --fill mean (each channel's mean over the sample) or --fill VALUE")
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return counts


def dry_run(plan: Plan, sources: list[Source], out: Path) -> None:
    """The plan, its sizes and the time it takes at the rate of reading a few samples now."""
    c, h, w = len(plan.channels), len(plan.rows), len(plan.cols)
    print(f"sources: {len(sources)} ({sum(s.nbytes for s in sources) / 1e6:.1f} MB), grid {_grid(sources[0])}; "
          f"output {c} channels ({', '.join(plan.channels)}) on {h}x{w}, every {plan.step} h")
    for (split, year), picks in plan.files.items():
        runs = len(segment_starts(plan.times[picks], plan.step, len(plan.members)))
        n = len(plan.members) * len(picks)
        who = f" ({len(plan.members)} members x {len(picks)} times)" if plan.members != [None] else ""
        done = " (complete: skipped)" if check_existing(out / split / f"{year}.h5", plan, n) else ""
        print(f"{split}/{year}.h5: {n} samples{who}, {runs} run{'s' if runs > 1 else ''} of consecutive times, "
              f"{n * c * h * w * 4 / 1e6:.1f} MB{done}")
    reader, seconds = Reader(plan, sources), []
    for t in next(iter(plan.files.values()))[:3]:
        start = clock.perf_counter()
        reader.sample(plan.members[0], int(t))
        seconds.append(clock.perf_counter() - start)
    per_sample = float(np.median(seconds))
    per_bytes = reader.bytes_read / len(seconds)
    todo = [len(plan.members) * len(p) for (s, y), p in plan.files.items() if not (out / s / f"{y}.h5").exists()]
    total, size = sum(todo) * per_sample, sum(todo) * c * h * w * 4
    print(f"dry run: {len(todo)} files to write ({size / 1e9:.3f} GB), {sum(todo) * per_bytes / 1e6:.1f} MB of fields "
          f"to read; about {total:.1f} s at the rate measured now ({per_sample * 1e3:.1f} ms per sample, "
          f"{per_bytes / max(per_sample, 1e-9) / 1e6:.0f} MB/s); nothing written")


def convert(args) -> list[Path]:
    """Check everything, then write the years not yet complete and the training split's statistics."""
    sources = [open_source(p) for p in expand_sources(args.sources)]
    plan = make_plan(sources, args)
    out = Path(args.out)
    if args.dry_run:
        dry_run(plan, sources, out)
        return []
    todo = {key: picks for key, picks in plan.files.items()
            if not check_existing(out / key[0] / f"{key[1]}.h5", plan, len(plan.members) * len(picks))}
    reader, start, written = Reader(plan, sources), clock.perf_counter(), []
    for (split, year), picks in plan.files.items():
        path = out / split / f"{year}.h5"
        if (split, year) not in todo:
            print(f"{split}/{year}.h5: complete, skipped")
            continue
        counts = write_year(path, plan, reader, picks, args.fill, args.quiet)
        filled = f"; filled ({args.fill}): " + ", ".join(
            f"{n} {k}" for n, k in zip(plan.channels, counts) if k) if counts.any() else ""
        print(f"{split}/{year}.h5: {len(plan.members) * len(picks)} samples{filled}")
        written.append(path)
    seconds, train = clock.perf_counter() - start, any(split == "train" for split, _ in plan.files)
    if train:
        compute_stats(out, "train")  # from every year of the training split, streamed
    size, read = sum(p.stat().st_size for p in written) / 1e9, reader.bytes_read / 1e6
    stats = f" and {STATS_DIR}/ (from train/, {clock.perf_counter() - start - seconds:.1f} s)" if train else ""
    print(f"wrote {len(written)} files ({size:.3f} GB){stats} under {out}; read {read:.1f} MB of fields in "
          f"{seconds:.1f} s ({read / max(seconds, 1e-9):.1f} MB/s)")
    return written


def _fill_rule(text: str) -> str:
    if text not in ("refuse", "mean") and not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)(e[-+]?\d+)?", text, re.I):
        raise argparse.ArgumentTypeError(f"expected refuse, mean or a number, got {text!r}")
    return text


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(prog="convert.py", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           description="netCDF, GRIB, Zarr -> <out>/<split>/<year>.h5 and stats/ (datasets/README.md)")
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="netCDF/GRIB files or globs, or Zarr stores")
    parser.add_argument("--out", required=True, type=Path, help="data root to write (<out>/<split>/<year>.h5)")
    parser.add_argument("--channels", default=None, metavar="SET|NAMES",
                        help="nersc20, superbench, or names such as u10,t850,z500 (default: every variable and level)")
    parser.add_argument("--start", default=None, help="first time (ISO date or date-time)")
    parser.add_argument("--end", default=None, help="last time (a date includes its whole day)")
    parser.add_argument("--step", type=int, default=None, help="hours between samples (default: the source's)")
    parser.add_argument("--train-years", type=int, nargs="*", default=[], help="years in train/ (default: all)")
    parser.add_argument("--valid-years", type=int, nargs="*", default=[], help="years in valid/")
    parser.add_argument("--test-years", type=int, nargs="*", default=[], help="years in test/")
    parser.add_argument("--split", type=_parse_split, action="append", default=[], metavar="NAME=YEARS",
                        help="another split folder, e.g. --split valid_1=2015")
    parser.add_argument("--lat", type=float, nargs=2, default=None, metavar=("NORTH", "SOUTH"), help="crop (degrees)")
    parser.add_argument("--lon", type=float, nargs=2, default=None, metavar=("WEST", "EAST"),
                        help="crop (degrees east; WEST > EAST crosses 0)")
    parser.add_argument("--coarsen", type=int, default=1, help="keep every K-th row and column, from the first")
    parser.add_argument("--members", default="all", help="ensemble members: all, 0-7 or 0,3,5")
    parser.add_argument("--fill", type=_fill_rule, default="refuse",
                        help="NaN / fill values: refuse, mean (each channel's mean over the sample) or a number")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, sizes and time; write nothing")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if xr is None:
        parser.exit(2, f"{parser.prog}: error: xarray is not installed; {INSTALL}\n")
    if args.coarsen < 1 or (args.step is not None and args.step < 1):
        parser.error("--coarsen and --step must be at least 1")
    with errors_as_one_line(parser, (ConvertError, StatsError), args.out,
                            "complete years were kept, the partial one removed; run again to resume"):
        convert(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
