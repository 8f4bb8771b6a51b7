"""Your own gridded fields (netCDF, GRIB, Zarr) into the training layout, with xarray.

    python datasets/convert.py SOURCE... --out DIR [--channels nersc20|superbench|t850,z500,...]
        [--rename NAME=CHANNEL,...] [--rename-file YAML] [--start DATE] [--end DATE] [--step HOURS]
        [--train-years Y...] [--valid-years Y...] [--test-years Y...] [--split NAME=Y,Y] [--lat NORTH SOUTH]
        [--lon WEST EAST] [--coarsen K] [--members all|0-7|0,3] [--fill refuse|mean|X] [--dry-run]

SOURCE: netCDF or GRIB files (or globs), or Zarr stores (folders, or URLs such as gs://: needs gcsfs). Writes, as
SuperBench's and NERSC's ERA5 (datasets/README.md) and what utils/data/era5.py reads:

    DIR/<split>/<year>.h5   dataset ``fields`` (samples, C, H, W) float32, one sample per chunk; attributes
                            ``channels`` (names), ``units``, ``time_step`` ("6 h", "1 month"), ``hours_per_step``
                            (hourly steps), ``segment_starts`` (gaps) and a dataset ``time`` (hours since
                            1970-01-01 of each sample)
    DIR/stats/*.npy         compute_stats.py's statistics of the train split only (streamed)

- Reading (utils/data/foreign.py, the rules a prediction's inputs are read with too): axes by their CF
  attributes, then by name; variables by ``--rename``, CDS/WeatherBench 2, CMIP6 and MERRA-2 names; values
  converted to each channel's unit where the file states another (km/h, degrees Celsius, hPa, geopotential height).
- Channels: a variable (``u10``, ``10m_u_component_of_wind``, ``uas``), or a variable and a pressure level in
  hPa (``t850``, ``z500``); other variable names pass through. The default is every variable and level of the
  sources, in their order. ``nersc20`` and ``superbench`` are make_synthetic_era5.py's channel sets
  (SuperBench's 10 m "kinetic energy" is made from u10 and v10).
- Time: ``--start``/``--end`` (inclusive), ``--step`` (hours; e.g. 6 from hourly data), one file per year
  and split; monthly data keep every month (step "1 month"). A time step missing from the source is a gap:
  recorded in ``segment_starts``, so that no forecast pair spans it. Ensemble members (``--members``) are
  stored one after the other, each its own run.
- Space: rows from north to south and columns from 0 to 360 degrees east (reordered when the source
  differs; a regional grid starts at its western edge), then the crop and ``--coarsen K`` (every K-th
  point from the first: 721 x 1440 -> 181 x 360 at K = 4, both poles kept; the loader drops the last row).
- Robust: nothing is written before every source, variable, unit, level, time and grid has been checked (bad
  input: one line on stderr, exit status 2); each year is written under a temporary name and renamed when
  complete, so a rerun skips complete years. NaNs (fill values decoded by xarray) are counted per channel
  and refused unless ``--fill`` says how to fill them.
"""

from __future__ import annotations

import argparse
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
    from .compute_stats import (FIELDS_KEY, STATS_DIR, DefaultsOnce, OneLineParser, StatsError, compute_stats,
                                errors_as_one_line)
    from utils.data.foreign import (DERIVED, INSTALL_BASE, ForeignDataError, Source, axis_order, common_times,
                          default_channels, grid, open_sources, parse_rename, read_rename_file, resolve_channel,
                          stored_unit, xr)
    from .make_synthetic_era5 import CHANNELS as SUPERBENCH_CHANNELS, NERSC_CHANNELS, _parse_split
else:  # run as a script: datasets/ is on sys.path
    from compute_stats import (FIELDS_KEY, STATS_DIR, DefaultsOnce, OneLineParser, StatsError, compute_stats,
                               errors_as_one_line)
    from utils.data.foreign import (DERIVED, INSTALL_BASE, ForeignDataError, Source, axis_order, common_times,
                         default_channels, grid, open_sources, parse_rename, read_rename_file, resolve_channel,
                         stored_unit, xr)
    from make_synthetic_era5 import CHANNELS as SUPERBENCH_CHANNELS, NERSC_CHANNELS, _parse_split
# The loader's attribute names (utils/data/era5.py; tests/test_convert.py checks that they agree). Not imported
# from there: importing the loader imports torch (3 s and 0.7 GB here), which a converter does not need.
NAMES_ATTR, SEGMENTS_ATTR, STEP_ATTR = "channels", "segment_starts", "time_step"

PRESETS = {"superbench": SUPERBENCH_CHANNELS, "superbench3": SUPERBENCH_CHANNELS, "nersc20": NERSC_CHANNELS}
HOUR = np.timedelta64(1, "h")


class ConvertError(ForeignDataError):
    """Bad input, as one line naming what is wrong and what to do."""


@dataclass(frozen=True)
class Step:
    """The time between consecutive samples: whole hours, or calendar months (whose lengths differ)."""

    count: int
    unit: str  # "h" or "month"

    def __str__(self) -> str:
        return f"{self.count} h" if self.unit == "h" else f"{self.count} month{'s' if self.count > 1 else ''}"

    def spacing(self, times: np.ndarray) -> np.ndarray:
        """Between consecutive times, in this unit: a gap is more than ``count``."""
        return np.diff(times) / HOUR if self.unit == "h" else np.diff(_month(times))


def _month(times: np.ndarray) -> np.ndarray:
    return times.astype("datetime64[M]").astype(np.int64)


@dataclass
class Plan:
    channels: list  # output names
    units: list
    raw: list  # raw channels read: (short name, level or None)
    make: list  # per output channel: raw index, or (function, raw indices)
    lookup: dict  # raw index -> (source index per sample time, time index per sample time)
    times: np.ndarray  # every sample time, datetime64[ns]
    step: Step
    members: list  # member values (or [None])
    rows: np.ndarray  # source row indices of the output grid, in output order
    cols: np.ndarray
    files: dict  # (split, year) -> time indices into ``times``


# ----------------------------------------------------------------------------------------------------------
# The plan: channels, times, grid, files; every check before anything is written
# ----------------------------------------------------------------------------------------------------------


def parse_channels(spec: Optional[str], sources: list[Source]) -> tuple[list[str], list[Optional[str]]]:
    """(names, units or None): a preset, a comma/space separated list, or every variable and level found."""
    if spec and spec.lower() in PRESETS:
        table = PRESETS[spec.lower()]
        return [n for n, _ in table], [u for _, u in table]
    names = [n for n in re.split(r"[,\s]+", spec.strip()) if n] if spec else default_channels(sources)
    return names, [None] * len(names)


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


def grid_indices(source: Source, lat_range, lon_range, coarsen: int) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = axis_order(source.lat, False), axis_order(source.lon, True)
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
                           f"{grid(source)}; widen it")
    return rows[::coarsen], cols[::coarsen]


def make_plan(sources: list[Source], args) -> Plan:
    names, units = parse_channels(args.channels, sources)
    if len(set(names)) != len(names):
        raise ConvertError(f"--channels names a channel twice: {', '.join(names)}")
    raw, make = [], []
    for name in names:
        needs = DERIVED[name][0] if name in DERIVED else (name,)
        indices = []
        for part in needs:
            key = resolve_channel(part, sources)
            if key not in raw:
                raw.append(key)
            indices.append(raw.index(key))
        make.append((DERIVED[name][1], indices) if name in DERIVED else indices[0])
    stored = {short: stored_unit(sources, short) for short, _ in raw}  # every source's units checked now
    units = [u or (stored[raw[m][0]] if isinstance(m, int) else DERIVED[n][2]) for n, u, m in zip(names, units, make)]
    member_sets = {tuple(s.members.tolist()) for s in sources}
    if len(member_sets) > 1:
        raise ConvertError(f"the sources hold different ensemble members ({' vs '.join(map(str, member_sets))}); "
                           f"convert them separately or select the same members in each")
    members = _parse_members(args.members, sources[0].members) if sources[0].dims["member"] else [None]

    start = np.datetime64(args.start, "ns") if args.start else None
    end = np.datetime64(args.end, "ns") if args.end else None
    if end is not None and len(args.end) <= 10:
        end = end + np.timedelta64(1, "D") - np.timedelta64(1, "ns")  # a date: the whole day
    every, per_raw = common_times(sources, raw, start, end)
    if len(every) == 0:
        raise ConvertError(f"no time between --start {args.start} and --end {args.end} in the sources")
    every, step = _select_step(every, args.step)
    lookup = {}
    for k, (times, src, index) in enumerate(per_raw):
        at = np.searchsorted(times, every)
        lookup[k] = (src[at], index[at])
    rows, cols = grid_indices(sources[0], args.lat, args.lon, args.coarsen)
    return Plan(names, units, raw, make, lookup, every, step, members, rows, cols, _split_files(every, args))


def _select_step(times: np.ndarray, step: Optional[int]) -> tuple[np.ndarray, Step]:
    """Times on the step's grid (hours since 1970 a multiple of it), and the step; or every time of monthly data
    (one time a month: lengths of 28 to 31 days, mid-month times that wander by a day or two)."""
    hours = (times - np.datetime64("1970-01-01", "ns")) / HOUR
    if len(times) == 1:
        return times, Step(step or 24, "h")
    diffs, months = np.diff(hours), np.diff(_month(times))
    if diffs.min() >= 27 * 24 and (months >= 1).all() and (np.abs(diffs / 24 - 30.44 * months) <= 3 * months).all():
        native = int(months.min())
        if step or (months % native).any():
            raise ConvertError(f"--step {step}: the sources hold one time a month; keep every month (no --step)" if step
                               else f"the time steps are irregular ({native} month, then {months.max()} months)")
        return times, Step(native, "month")
    native = float(diffs.min())
    odd = ~np.isclose(np.mod(diffs, native), 0)
    if native != int(native) or odd.any():
        raise ConvertError(f"the time steps are irregular ({native:g} h, then {diffs[np.argmax(odd)]:g} h); the "
                           f"converter needs steps of whole hours, gaps a multiple of them, or one time a month")
    if step and step % native:
        raise ConvertError(f"--step {step} is not a multiple of the sources' {native:g} h step; choose a multiple")
    step = step or int(native)
    keep = np.isclose(np.mod(hours, step), 0)
    if not keep.any():
        raise ConvertError(f"--step {step}: no time at a multiple of {step} h after 00 UTC; choose another step")
    return times[keep], Step(step, "h")


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


def segment_starts(times: np.ndarray, step: Step, members: int) -> list[int]:
    """First sample of each run of consecutive times (every member repeats the times: its own runs)."""
    breaks = [0] + [k + 1 for k, d in enumerate(step.spacing(times)) if d != step.count]
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
            levels = None if wanted[0][1] is None else [lv for _, lv in wanted]
            block = self.sources[src].read(short, index, levels, member, *self.box)
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
            fields.attrs[STEP_ATTR] = str(plan.step)  # "6 h", "1 month": the loader says a forecast's lead in it
            if plan.step.unit == "h":
                fields.attrs["hours_per_step"] = plan.step.count  # rollout.py's lead times
            fields.attrs[SEGMENTS_ATTR] = segment_starts(times, plan.step, len(members))
            fields.attrs["sources"] = sorted({os.path.basename(s.path.rstrip("/")) for s in reader.sources})
            hours = (times - np.datetime64("1970-01-01", "ns")) / HOUR  # float: mid-month times fall on half hours
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
    print(f"sources: {len(sources)} ({sum(s.nbytes for s in sources) / 1e6:.1f} MB), grid {grid(sources[0])}; "
          f"output {c} channels ({', '.join(plan.channels)}) on {h}x{w}, every {plan.step}")
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
    out = Path(args.out)
    for folder in (out, *out.parents):  # before any work: the first that exists must be a folder
        if folder.exists():
            if not folder.is_dir():
                raise ConvertError(f"--out {out}: {folder} is a file, not a folder; give the folder to write the "
                                   f"data root in (it is created if absent)")
            break
    rename = read_rename_file(args.rename_file) if args.rename_file else {}
    for text in args.rename:
        rename.update(parse_rename(text))  # --rename wins over the file
    sources = open_sources(args.sources, rename)
    plan = make_plan(sources, args)
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
    parser = OneLineParser(prog="convert.py", formatter_class=DefaultsOnce,
                           description="netCDF, GRIB, Zarr -> <out>/<split>/<year>.h5 and stats/ (datasets/README.md)")
    parser.add_argument("sources", nargs="+", metavar="SOURCE", help="netCDF/GRIB files or globs, or Zarr stores")
    parser.add_argument("--out", required=True, type=Path, help="data root to write (<out>/<split>/<year>.h5)")
    parser.add_argument("--channels", default=None, metavar="SET|NAMES",
                        help="nersc20, superbench, or names such as u10,t850,z500 (default: every variable and level)")
    parser.add_argument("--rename", action="append", default=[], metavar="NAME=CHANNEL,...",
                        help="the sources' names for channels (or axes), e.g. UWND=u10,VWND=v10 or Y=latitude")
    parser.add_argument("--rename-file", type=Path, default=None, metavar="YAML",
                        help="many such names, one 'NAME: CHANNEL' a line (--rename wins)")
    parser.add_argument("--start", default=None, help="first time (ISO date or date-time)")
    parser.add_argument("--end", default=None, help="last time (a date includes its whole day)")
    parser.add_argument("--step", type=int, default=None, help="hours between samples (default: the source's)")
    parser.add_argument("--train-years", type=int, nargs="*", default=[], help="years in train/ (default: every year)")
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
        parser.exit(2, f"{parser.prog}: error: xarray is not installed; {INSTALL_BASE}\n")
    if args.coarsen < 1 or (args.step is not None and args.step < 1):
        parser.error("--coarsen and --step must be at least 1")
    with errors_as_one_line(parser, (ForeignDataError, StatsError), args.out,
                            "complete years were kept, the partial one removed; run again to resume"):
        convert(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
