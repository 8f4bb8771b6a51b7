"""The reading rules for gridded fields from any centre (netCDF, GRIB, Zarr), in one place: datasets/convert.py
writes the training layout with them, and a prediction reads its coarse inputs with them.

    sources = open_sources(["era5.nc", "cmip/*.nc"], rename={"UWND": "u10"})   # opened, axes found, checked
    name, level = resolve_channel("z500", sources)                               # ("z", 500.0)
    block = sources[0].read(name, time=0, levels=[500.0])                        # in the channel's units
    fields = open_fields(["monthly.nc"], ["u10", "v10"], rename={"UWND": "u10", "VWND": "v10"})
    # -> xarray.DataArray (time, channel, lat, lon): rows north to south, columns east from 0, float32

- Axes by the CF conventions first, then by usual names: latitude by ``units: degrees_north`` (or
  ``standard_name: latitude``, ``axis: Y``), longitude by ``degrees_east`` (``longitude``, ``X``), time by
  dates (numpy's, or cftime's of a model calendar) or ``axis: T`` / ``standard_name: time``, levels by a
  vertical ``standard_name``, a ``positive`` attribute, ``axis: Z`` or units of pressure, members by
  ``standard_name: realization``. A dimension that fits no rule can be named with ``rename`` (``Y=latitude``).
- Variables by name: ``rename`` first, then the CDS / WeatherBench 2 long names, CMIP6's and MERRA-2's short
  names (``tas`` -> ``t2m``, ``zg`` on ``plev`` -> ``z``), else the name itself. A channel is a variable
  (``u10``) or a variable and a level in hPa (``z500``); levels in Pa (CMIP's ``plev``) are divided by 100.
- Units: where a variable has a known unit (UNITS) and the file states another, the values are converted
  (km/h -> m s-1, degrees Celsius -> K, hPa -> Pa, geopotential height -> geopotential with G0); a unit that
  is not the channel's is refused. A file that states none is taken at its word: the channel's unit.
- Grid: ``axis_order`` puts rows north to south and columns east from 0 degrees (longitudes in any range, such
  as 20 -> 377.5, are wrapped; a repeated cyclic column is dropped; a regional grid starts at its western edge).

Bad input raises ForeignDataError: one line that names the file, what is wrong and what to do.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

import numpy as np
import yaml

try:  # the base install has it (requirements.txt), but the training scripts never need it: an environment may lack it
    import xarray as xr
except ImportError:  # reported as one line by the commands
    xr = None

INSTALL_BASE = "pip install -r requirements.txt -c constraints.txt (make install)"  # xarray, zarr, netCDF4
INSTALL = "pip install -r requirements-data.txt -c constraints.txt (make install-data)"  # h5netcdf, cfgrib, ecCodes
# CDS / WeatherBench 2 long names -> the short names of ERA5 (and of the configs' channels).
LONG_NAMES = {
    "10m_u_component_of_wind": "u10", "10m_v_component_of_wind": "v10", "100m_u_component_of_wind": "u100",
    "100m_v_component_of_wind": "v100", "2m_temperature": "t2m", "2m_dewpoint_temperature": "d2m",
    "surface_pressure": "sp", "mean_sea_level_pressure": "msl", "total_column_water_vapour": "tcwv",
    "sea_surface_temperature": "sst", "total_precipitation": "tp", "temperature": "t",
    "u_component_of_wind": "u", "v_component_of_wind": "v", "geopotential": "z", "relative_humidity": "r",
    "specific_humidity": "q", "vertical_velocity": "w",
}
# CMIP6's short names (its data request) and MERRA-2's, where they are an ERA5 variable.
CMIP_NAMES = {"tas": "t2m", "uas": "u10", "vas": "v10", "psl": "msl", "ps": "sp", "prw": "tcwv", "zg": "z",
              "ta": "t", "ua": "u", "va": "v", "hus": "q", "hur": "r", "wap": "w"}
MERRA2_NAMES = {"U10M": "u10", "V10M": "v10", "T2M": "t2m", "SLP": "msl", "PS": "sp", "TQV": "tcwv", "H": "z",
                "T": "t", "U": "u", "V": "v", "QV": "q", "RH": "r"}
KNOWN_NAMES = {**LONG_NAMES, **CMIP_NAMES, **MERRA2_NAMES}
# SuperBench's channel names as ERA5 variables; its "kinetic energy" is derived (DERIVED).
ALIASES = {"temperature 2 m": "t2m", "total column water vapour": "tcwv"}
# SuperBench's hard-coded statistics of its 10 m channel (mean 6.30, std 3.74) have the size of a wind speed in
# m/s, and this project does not know how SuperBench made it: made here as the speed; check before mixing data.
DERIVED = {"kinetic energy 10 m": (("u10", "v10"), lambda u, v: np.sqrt(u * u + v * v), "m2 s-2")}  # its label
# The unit each ERA5 variable is stored in (the CDS's, as make_synthetic_era5.py's channel sets write them).
UNITS = {"u10": "m s-1", "v10": "m s-1", "u100": "m s-1", "v100": "m s-1", "u": "m s-1", "v": "m s-1",
         "t2m": "K", "d2m": "K", "t": "K", "sst": "K", "sp": "Pa", "msl": "Pa", "z": "m2 s-2", "r": "%",
         "q": "kg kg-1", "tcwv": "kg m-2", "tp": "m", "w": "Pa s-1"}
G0 = 9.80665  # m s-2, standard gravity: geopotential height (CMIP's zg, MERRA-2's H) is geopotential / G0, exactly

ROLES = ("time", "member", "level", "lat", "lon")
WORDS = {"time": "time", "member": "the ensemble member", "level": "the vertical level", "lat": "latitude",
         "lon": "longitude"}
NAMES = {"time": ("time", "valid_time"), "member": ("number", "member", "realization", "ensemble"),
         "level": ("level", "pressure_level", "isobaricinhpa", "plev", "lev"), "lat": ("latitude", "lat"),
         "lon": ("longitude", "lon")}
LAT_UNITS = ("degrees_north", "degree_north", "degrees_n", "degree_n", "degreesn", "degreen")
LON_UNITS = ("degrees_east", "degree_east", "degrees_e", "degree_e", "degreese", "degreee")
VERTICAL = {"air_pressure", "altitude", "height", "depth", "model_level_number", "atmosphere_sigma_coordinate",
            "atmosphere_hybrid_sigma_pressure_coordinate", "atmosphere_hybrid_height_coordinate"}
CF_HINT = {"lat": "units degrees_north, standard_name latitude or axis Y",
           "lon": "units degrees_east, standard_name longitude or axis X"}
GRIB_SUFFIXES = (".grib", ".grib1", ".grib2", ".grb", ".grb2")


class ForeignDataError(ValueError):
    """Bad input, as one line naming what is wrong and what to do."""


# ----------------------------------------------------------------------------------------------------------
# Units: a small parser, as archives spell them (M/S, m s**-1, km/h, degC, hPa, 1)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    scale: float  # to the base units m, s, kg, K, Pa
    dims: tuple  # sorted (base unit, power) pairs
    offset: float = 0.0  # added after scaling: degrees Celsius -> K


_LENGTH, _TIME, _PRESSURE = {"m": 1}, {"s": 1}, {"Pa": 1}
_SYMBOLS = {  # lower case: archives write M/S, DEGK, MB
    **{k: (1.0, _LENGTH) for k in ("m", "meter", "metre", "meters", "metres", "gpm")},
    "km": (1e3, _LENGTH), "cm": (1e-2, _LENGTH), "mm": (1e-3, _LENGTH),
    **{k: (1.0, _TIME) for k in ("s", "sec", "second", "seconds")}, "min": (60.0, _TIME),
    **{k: (3600.0, _TIME) for k in ("h", "hr", "hour", "hours")}, "day": (86400.0, _TIME),
    **{k: (1.0, {"K": 1}) for k in ("k", "kelvin", "degk", "deg_k", "degrees_k")},
    "pa": (1.0, _PRESSURE), "kpa": (1e3, _PRESSURE),
    **{k: (100.0, _PRESSURE) for k in ("hpa", "mb", "mbar", "millibar", "millibars")},
    "kg": (1.0, {"kg": 1}), "g": (1e-3, {"kg": 1}), "%": (1e-2, {}), "percent": (1e-2, {}), "1": (1.0, {}),
    **{k: (1852 / 3600, {"m": 1, "s": -1}) for k in ("knots", "knot", "kt", "kts")},
}
_CELSIUS = {"degc", "deg_c", "°c", "celsius", "degrees_c", "degree_c", "c", "degrees celsius"}


def parse_units(text: str) -> Optional[Unit]:
    """A units string as scale and powers of base units, or None when a part of it is not known here."""
    s = " ".join(str(text).strip().lower().replace("**", "^").split())
    if s in _CELSIUS:
        return Unit(1.0, (("K", 1),), 273.15)
    scale, dims = 1.0, {}
    for k, part in enumerate((s if s not in ("", "-", "none", "dimensionless") else "1").split("/")):
        sign = 1 if k == 0 else -1
        for token in filter(None, re.split(r"[\s.*·]+", part)):
            match = re.fullmatch(r"([a-z%°_]+|1)\^?([-+]?\d+)?", token)
            if not match or match.group(1) not in _SYMBOLS:
                return None
            power = sign * int(match.group(2) or 1)
            factor, base = _SYMBOLS[match.group(1)]
            scale *= factor ** power
            for name, p in base.items():
                dims[name] = dims.get(name, 0) + p * power
    return Unit(scale, tuple(sorted((n, p) for n, p in dims.items() if p)))


def conversion(units: Optional[str], short: str, where: str) -> tuple[float, float, str]:
    """(scale, offset, unit stored): a value of the file times scale plus offset is in the unit stored, the
    variable's in UNITS (else the file's own). ``where`` names the file and variable in the error."""
    expected = UNITS.get(short)
    if expected is None or units is None or not str(units).strip():
        return 1.0, 0.0, expected or str(units or "1")  # unknown variable, or a file that states no unit
    source, target = parse_units(units), parse_units(expected)
    if source is None:
        raise ForeignDataError(f"{where}: units {units!r} are not understood here; {short} is stored in {expected}: "
                               f"correct the units attribute (e.g. '{expected}')")
    scale = source.scale
    if short == "z" and source.dims == (("m", 1),):  # geopotential height (zg, H): by definition x G0
        source, scale = target, scale * G0
    if source.dims != target.dims or (source.offset and target.dims != (("K", 1),)):
        raise ForeignDataError(f"{where}: units {units!r} cannot be converted to {expected}, the unit of {short}; "
                               f"is it {short}? map variables to channels with --rename NAME=CHANNEL")
    return scale / target.scale, (source.offset - target.offset) / target.scale, expected


# ----------------------------------------------------------------------------------------------------------
# Axes: CF attributes, then names. Hand-written rather than cf_xarray: these few rules also read units of
# pressure and archives' loose spellings, and keep the optional readers to xarray and its engines.
# ----------------------------------------------------------------------------------------------------------


def _is_dates(coord) -> bool:
    values = np.ravel(coord.values)
    return np.issubdtype(coord.dtype, np.datetime64) or (coord.dtype == object and values.size > 0
                                                         and hasattr(values[0], "calendar"))  # cftime


def _stated_role(coord) -> Optional[str]:
    """The role a dimension's coordinate states by the CF conventions, or None."""
    attrs = {k: str(v).strip() for k, v in coord.attrs.items()}
    units, name = attrs.get("units", "").lower(), attrs.get("standard_name", "").lower()
    axis, positive = attrs.get("axis", "").upper(), attrs.get("positive", "").lower()
    if _is_dates(coord) or axis == "T" or name == "time":
        return "time"
    if units in LAT_UNITS or name == "latitude" or (axis == "Y" and not units):
        return "lat"
    if units in LON_UNITS or name == "longitude" or (axis == "X" and not units):
        return "lon"
    pressure = units and getattr(parse_units(units), "dims", None) == (("Pa", 1),)
    if name in VERTICAL or positive in ("up", "down") or axis == "Z" or pressure:
        return "level"
    return "member" if name == "realization" else None


def _described(ds, dims) -> str:
    """Dimensions as 'TIME (132, dates), FNOCY (73, units degrees_north)' for a message."""
    parts = []
    for dim in dims:
        coord = ds[dim] if dim in ds.variables else None
        said = [] if coord is None else [f"{k} {coord.attrs[k]}" for k in ("units", "standard_name", "axis")
                                         if k in coord.attrs]
        said = said or (["dates"] if coord is not None and _is_dates(coord) else [])
        parts.append(f"{dim} ({', '.join([str(ds.sizes[dim]), *said])})")
    return ", ".join(parts)


def find_axes(ds, path: str) -> dict:
    """role (time, member, level, lat, lon) -> the dimension's name or None; latitude and longitude required."""
    claims = {role: [] for role in ROLES}
    for dim in ds.dims:
        role = _stated_role(ds[dim]) if dim in ds.variables else None
        if role:
            claims[role].append(dim)
    roles = {}
    for role, dims in claims.items():
        if len(dims) > 1:
            raise ForeignDataError(f"{path}: {len(dims)} dimensions are {WORDS[role]} by their CF attributes: "
                                   f"{_described(ds, dims)}; select one value of all but one (xarray: ds.isel)")
        roles[role] = dims[0] if dims else None
    for role in ROLES:  # then by the usual names
        taken = set(roles.values())
        roles[role] = roles[role] or next((d for d in ds.dims if str(d).lower() in NAMES[role] and d not in taken),
                                          None)
    for role in ("lat", "lon"):
        if roles[role] is None:
            two_d = [f"{n}({', '.join(map(str, c.dims))})" for n, c in ds.coords.items()
                     if c.ndim > 1 and _stated_role(c) == role]
            if two_d:
                raise ForeignDataError(f"{path}: {WORDS[role]} is 2-D ({two_d[0]}): a curvilinear or projected grid; "
                                       f"regrid to a regular latitude-longitude grid first")
            others = [d for d in ds.dims if d not in roles.values()]
            raise ForeignDataError(f"{path}: which dimension is {WORDS[role]}? None has its CF attributes "
                                   f"({CF_HINT[role]}) or a usual name ({', '.join(NAMES[role])}); candidates: "
                                   f"{_described(ds, others) or 'none'}; name it: --rename DIM={NAMES[role][0]}")
        if roles[role] not in ds.coords:
            raise ForeignDataError(f"{path}: dimension {roles[role]} ({WORDS[role]}) has no coordinate values; "
                                   f"add them (xarray: ds.assign_coords) before converting")
    lat = np.asarray(ds[roles["lat"]].values, dtype=float)
    if np.abs(lat).max() > 90 + 1e-6 or not (np.all(np.diff(lat) > 0) or np.all(np.diff(lat) < 0)):
        raise ForeignDataError(f"{path}: {roles['lat']} runs {lat[0]:g} .. {lat[-1]:g}, not latitudes in order within "
                               f"90 degrees of the equator; is it latitude?")
    return roles


def _levels_hpa(coord) -> np.ndarray:
    """Level values in hPa where they are pressures (CMIP's plev is in Pa), else as the file has them."""
    values = np.asarray(coord.values, dtype=float)
    stated = str(coord.attrs.get("units", "")).strip()
    unit = parse_units(stated) if stated else None
    if unit is not None and unit.dims == (("Pa", 1),):
        return values * unit.scale / 100.0
    return values / 100.0 if not stated and values.max() > 2000 else values  # no units: Pa by their size


def _dates(coord, path: str) -> np.ndarray:
    """A time coordinate as datetime64[ns]; cftime dates of a model calendar (noleap, 360_day) keep their
    calendar date, and one that the standard calendar lacks (30 February) is refused."""
    values = np.atleast_1d(coord.values)
    if np.issubdtype(values.dtype, np.datetime64):
        return values.astype("datetime64[ns]")
    try:
        return np.array([v.strftime("%Y-%m-%dT%H:%M:%S") for v in values], dtype="datetime64[ns]")
    except ValueError:
        raise ForeignDataError(f"{path}: the {values[0].calendar} calendar has dates that the standard calendar "
                               f"lacks; convert it first (xarray: ds.convert_calendar('standard', "
                               f"align_on='year'))") from None


def _times(ds, dim: Optional[str], path: str) -> np.ndarray:
    if dim is not None:
        coord = ds[dim]
        # cfgrib: time is the analysis time, valid_time = time + step; the valid time is the field's time.
        if "valid_time" in ds.coords and ds["valid_time"].dims == (dim,):
            coord = ds["valid_time"]
    else:
        coord = next((ds[n] for n in (*NAMES["time"], "date") if n in ds.coords and ds[n].ndim == 0), None)
    if coord is None or not _is_dates(coord):
        raise ForeignDataError(f"{path}: no time coordinate of dates (found: {', '.join(map(str, ds.coords)) or 'none'}"
                               f"); give the time CF units (e.g. 'hours since 2000-01-01') so that xarray decodes it")
    times = _dates(coord, path)
    step = np.diff(times)
    if (step <= np.timedelta64(0)).any():
        k = int(np.argmax(step <= np.timedelta64(0)))
        raise ForeignDataError(f"{path}: the time axis is not increasing ({date(times[k])} then {date(times[k + 1])} "
                               f"at index {k + 1}); sort it and drop repeated times (xarray: ds.sortby('time'))")
    return times


def date(t) -> str:
    return str(np.datetime64(t, "m")).replace("T00:00", "")


# ----------------------------------------------------------------------------------------------------------
# Sources: one opened file or store
# ----------------------------------------------------------------------------------------------------------


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
    renamed: dict = field(default_factory=dict)  # what --rename renamed here
    _conversions: dict = field(default_factory=dict)

    def conversion(self, short: str) -> tuple[float, float, str]:
        """(scale, offset, unit stored) of a variable: see :func:`conversion`."""
        if short not in self._conversions:
            name = self.variables[short][0]
            self._conversions[short] = conversion(self.ds[name].attrs.get("units"), short,
                                                  f"{self.path}: variable {name}")
        return self._conversions[short]

    def read(self, short: str, time=0, levels: Optional[Sequence[float]] = None, member=None,
             rows=slice(None), cols=slice(None)) -> np.ndarray:
        """A variable at one time index (or an array of them: a leading time axis), its levels in this order
        (all without ``levels``; none for a variable without levels), the rows and columns asked for, in the
        unit stored (:meth:`conversion`): (time?, level?, rows, cols)."""
        name, have = self.variables[short]
        var, dims = self.ds[name], self.dims
        sel = {d: 0 for d in var.dims if d not in dims.values()}  # size-1 extra dimensions
        order = []
        if dims["time"] in var.dims:
            sel[dims["time"]] = time
            order += [] if np.ndim(time) == 0 else [dims["time"]]
        if dims["member"] in var.dims:
            sel[dims["member"]] = 0 if member is None else int(np.flatnonzero(self.members == member)[0])
        if have is not None:
            wanted = have if levels is None else levels
            sel[dims["level"]] = [int(np.flatnonzero(np.isclose(have, lv))[0]) for lv in wanted]
            order.append(dims["level"])
        sel[dims["lat"]], sel[dims["lon"]] = rows, cols
        block = np.asarray(var.isel(sel).transpose(*order, dims["lat"], dims["lon"]).values)
        scale, offset, _ = self.conversion(short)
        return block * scale + offset if (scale, offset) != (1.0, 0.0) else block


def expand_sources(patterns: Sequence[str]) -> list[str]:
    paths = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if glob.has_magic(pattern) and "://" not in pattern else [pattern]
        missing = [p for p in found if not os.path.exists(p) and "://" not in p]  # URLs: Zarr in the cloud
        if not found or missing:
            raise ForeignDataError(f"{pattern}: no such file or Zarr store; give netCDF/GRIB files, globs or Zarr "
                                   f"folders")
        paths += [p for p in found if p not in paths]
    return paths


def _open_dataset(path: str):
    try:
        if os.path.isdir(path) or "://" in path:  # chunks=None: lazy reads without dask; gs://: anonymous (gcsfs)
            return xr.open_zarr(path, chunks=None, consolidated=None,
                                storage_options={"token": "anon"} if path.startswith("gs://") else None)
        if path.lower().endswith(GRIB_SUFFIXES):
            if "cfgrib" not in xr.backends.list_engines():  # cfgrib, or the ecCodes library it loads, is missing
                raise ForeignDataError(f"{path}: reading GRIB needs cfgrib and the ecCodes library; {INSTALL}")
            return xr.open_dataset(path, engine="cfgrib", backend_kwargs={"indexpath": ""}, cache=False)
        return xr.open_dataset(path, cache=False)
    except ForeignDataError:
        raise
    except Exception as e:  # noqa: BLE001 -- every backend raises its own types; all mean "cannot read"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ForeignDataError(f"{path}: cannot be opened as netCDF, GRIB or Zarr ({first}); is it one, and is its "
                               f"reader installed? {INSTALL}") from None


def open_source(path: str, rename: Optional[Mapping[str, str]] = None) -> Source:
    """Open one file or store, rename what ``rename`` names (variables or dimensions) and find its axes and
    variables (module docstring)."""
    ds = _open_dataset(path)
    present = {old: new for old, new in (rename or {}).items() if old in ds.variables or old in ds.dims}
    try:
        ds = ds.rename(present)
    except ValueError as e:  # the new name is taken
        raise ForeignDataError(f"{path}: --rename {','.join(f'{a}={b}' for a, b in present.items())}: {e}; "
                               f"choose names the file does not use") from None
    dims = find_axes(ds, path)
    known = {d for d in dims.values() if d}
    variables, origin = {}, {}
    for name, var in ds.data_vars.items():
        if dims["lat"] not in var.dims or dims["lon"] not in var.dims or not np.issubdtype(var.dtype, np.number):
            continue  # bounds, masks of other grids, text
        extra = [d for d in var.dims if d not in known and ds.sizes[d] > 1]
        if extra:
            raise ForeignDataError(f"{path}: variable {name} has dimensions {_described(ds, extra)} besides time, "
                                   f"level, member and grid; select one value of each first (xarray: ds.isel(...)), "
                                   f"or name the axis it is: --rename DIM=time (or level, number)")
        short = KNOWN_NAMES.get(str(name), str(name))
        if short in origin:
            raise ForeignDataError(f"{path}: variables {origin[short]} and {name} are both {short}; keep one or name "
                                   f"the other with --rename {name}=NAME")
        origin[short] = name
        levels = _levels_hpa(ds[dims["level"]]) if dims["level"] in var.dims else None
        variables[short] = (name, levels)
    times = _times(ds, dims["time"], path)
    members = np.asarray(ds[dims["member"]].values) if dims["member"] else np.array([None])
    nbytes = 0 if "://" in path else sum(f.stat().st_size for f in [Path(path), *Path(path).rglob("*")] if f.is_file())
    return Source(path, ds, variables, times, dims, members, np.asarray(ds[dims["lat"]].values, dtype=float),
                  np.asarray(ds[dims["lon"]].values, dtype=float), nbytes, present)


def open_sources(patterns: Sequence[str], rename: Optional[Mapping[str, str]] = None) -> list[Source]:
    """Every file, glob or store opened (:func:`open_source`), on one grid, each ``rename`` name used."""
    sources = [open_source(p, rename) for p in expand_sources(patterns)]
    unused = [old for old in (rename or {}) if not any(old in s.renamed for s in sources)]
    if unused:
        found = sorted({str(v) for s in sources for v in s.ds.data_vars})
        raise ForeignDataError(f"--rename {unused[0]}: no variable or dimension {unused[0]} in the sources "
                               f"(variables: {', '.join(found) or 'none'})")
    check_grids(sources)
    return sources


def check_grids(sources: list[Source]) -> None:
    first = sources[0]
    for other in sources[1:]:
        if other.lat.shape != first.lat.shape or other.lon.shape != first.lon.shape or not (
                np.allclose(other.lat, first.lat, atol=1e-4) and np.allclose(other.lon, first.lon, atol=1e-4)):
            raise ForeignDataError(f"mixed grids: {first.path} is {grid(first)}, {other.path} is {grid(other)}; "
                                   f"convert each grid separately (or regrid first)")


def grid(s: Source) -> str:
    step = abs(s.lat[1] - s.lat[0]) if len(s.lat) > 1 else 0
    return f"{len(s.lat)}x{len(s.lon)} ({step:g} degrees, latitude {s.lat[0]:g} to {s.lat[-1]:g})"


def axis_order(values: np.ndarray, is_lon: bool) -> np.ndarray:
    """Indices that put latitude north -> south, or longitude east from 0 (a regional grid: from its west edge;
    a column repeated after 360 degrees, the cyclic point some files carry, dropped)."""
    if not is_lon:
        return np.argsort(-values, kind="stable")
    wrapped = np.mod(values, 360.0)
    order = np.argsort(wrapped, kind="stable")
    order = order[np.append(True, ~np.isclose(np.diff(wrapped[order]), 0, atol=1e-6))]
    ring = np.diff(np.append(wrapped[order], wrapped[order][0] + 360.0))
    if len(ring) > 1 and ring.max() > 1.5 * ring.min():  # regional: start after the widest gap
        order = np.roll(order, -(int(np.argmax(ring)) + 1))
    return order


# ----------------------------------------------------------------------------------------------------------
# Channels: names -> (variable, level); their times over several sources
# ----------------------------------------------------------------------------------------------------------


def parse_rename(text: str) -> dict:
    """'UWND=u10,VWND=v10' -> {'UWND': 'u10', 'VWND': 'v10'}."""
    pairs = [p.partition("=") for p in re.split(r"[,\s]+", text.strip()) if p]
    if not pairs or any(not old or not sep or not new for old, sep, new in pairs):
        raise ForeignDataError(f"--rename {text}: expected NAME=CHANNEL pairs, e.g. --rename UWND=u10,VWND=v10")
    return {old: new for old, _, new in pairs}


def read_rename_file(path) -> dict:
    """A YAML mapping of the source's names to channel (or axis) names, one per line: ``UWND: u10``."""
    try:
        mapping = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ForeignDataError(f"--rename-file {path}: cannot be read ({first}); write one 'NAME: CHANNEL' a line")
    if not isinstance(mapping, dict) or not all(isinstance(v, (str, int)) for v in mapping.values()):
        raise ForeignDataError(f"--rename-file {path}: expected a mapping of names, one 'NAME: CHANNEL' a line")
    return {str(k): str(v) for k, v in mapping.items()}


def default_channels(sources: list[Source]) -> list[str]:
    """Every variable and level of the sources, in their order (a level as variable + hPa: z500)."""
    names = []
    for source in sources:
        for short, (_, levels) in source.variables.items():
            for name in ([short] if levels is None else [f"{short}{lv:g}" for lv in levels]):
                names += [name] if name not in names else []
    if not names:
        raise ForeignDataError(f"{sources[0].path}: no numeric variable on the latitude-longitude grid to convert")
    return names


def resolve_channel(name: str, sources: list[Source]) -> tuple[str, Optional[float]]:
    """A channel name as (variable, level): a variable of that name first (u10 is the 10 m wind, not u at 10 hPa)."""
    short = KNOWN_NAMES.get(ALIASES.get(name, name), ALIASES.get(name, name))
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
            raise ForeignDataError(f"channel {name}: variable {var} has no level {level:g} hPa (levels: "
                                   f"{', '.join(have)}); add that level to the download or drop the channel")
    found = sorted({v for s in sources for v in s.variables})
    raise ForeignDataError(f"channel {name}: no variable {short} in the sources (variables: "
                           f"{', '.join(found) or 'none'}); add it to the download, map one to it (--rename "
                           f"NAME={short}) or drop the channel")


def raw_name(short: str, level: Optional[float]) -> str:
    return short if level is None else f"{short}{level:g}"


def raw_times(sources: list[Source], short: str, level, start=None, end=None) -> tuple[np.ndarray, ...]:
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
        raise ForeignDataError(f"{raw_name(short, level)}: time {date(times[twice[0]])} is in both {a} and {b}; "
                               f"give each time once (overlapping downloads?)")
    return times, src, index


def common_times(sources: list[Source], raw: list, start=None, end=None) -> tuple[np.ndarray, list]:
    """Every time of the raw channels ((variable, level) pairs) and each one's raw_times; every raw channel must
    have every time."""
    per_raw = [raw_times(sources, short, level, start, end) for short, level in raw]
    every = np.unique(np.concatenate([t for t, _, _ in per_raw]))
    for (short, level), (times, _, _) in zip(raw, per_raw):
        if len(times) != len(every):
            lacking = every[~np.isin(every, times)]
            raise ForeignDataError(f"{raw_name(short, level)} lacks {len(lacking)} of the {len(every)} times (first "
                                   f"{date(lacking[0])}); give every variable the same times, or choose --start/--end")
    return every, per_raw


def open_fields(paths, channels: Optional[Sequence[str]] = None,
                rename: Optional[Mapping[str, str]] = None, member=None) -> "xr.DataArray":
    """The channels of netCDF/GRIB/Zarr sources as one (time, channel, lat, lon) float32 DataArray, read now:
    rows north to south, columns east from 0 (coordinates ``lat``, ``lon`` in [0, 360)), each channel in its
    unit (attribute ``units``, a list), the same rules as datasets/convert.py. ``channels``: names (``u10``,
    ``z500``, SuperBench's) or None for every variable and level; ``paths``: files, globs or stores (or one);
    ``member``: which one of an ensemble."""
    if xr is None:
        raise ForeignDataError(f"reading netCDF, GRIB or Zarr needs xarray; {INSTALL_BASE}")
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else paths
    sources = open_sources([str(p) for p in paths], rename)
    members = sources[0].members.tolist()
    if (member is None and len(members) > 1) or (member is not None and member not in members):
        raise ForeignDataError(f"{sources[0].path}: ensemble members {members}; choose one of them (member=)")
    names = list(channels) if channels else default_channels(sources)
    keys = [[resolve_channel(p, sources) for p in (DERIVED[n][0] if n in DERIVED else (n,))] for n in names]
    raw = list(dict.fromkeys(key for group in keys for key in group))
    times, per_raw = common_times(sources, raw)
    rows, cols = axis_order(sources[0].lat, False), axis_order(sources[0].lon, True)
    values = []
    for (short, level), (_, src, index) in zip(raw, per_raw):
        block = np.empty((len(times), len(rows), len(cols)), dtype=np.float32)
        for s in np.unique(src):
            got = sources[s].read(short, index[src == s], None if level is None else [level], member, rows, cols)
            block[src == s] = got.reshape(-1, len(rows), len(cols))
        values.append(block)
    fields, units = [], []
    for name, group in zip(names, keys):
        got = [values[raw.index(key)] for key in group]
        fields.append(DERIVED[name][1](*got) if name in DERIVED else got[0])
        units.append(DERIVED[name][2] if name in DERIVED else stored_unit(sources, group[0][0]))
    return xr.DataArray(np.stack(fields, axis=1), dims=("time", "channel", "lat", "lon"),
                        coords={"time": times, "channel": names, "lat": sources[0].lat[rows],
                                "lon": np.mod(sources[0].lon[cols], 360.0)}, attrs={"units": units})


def stored_unit(sources: list[Source], short: str) -> str:
    """The unit a variable is stored in; the units of every source that holds it are checked here, before any read."""
    return [s.conversion(short)[2] for s in sources if short in s.variables][0]
