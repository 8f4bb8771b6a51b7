"""datasets/convert.py: netCDF / GRIB / Zarr into the training layout, on files written here with xarray and on
real ERA5 fields no one here wrote (cfgrib's sample, `make real-data`), then read by the training loaders."""

import os
import re
import subprocess
from pathlib import Path
from unittest import mock

import h5py
import numpy as np
import pandas as pd
import pytest
import xarray as xr

from datasets import cds_request, convert
from utils.data import foreign
from utils.data.foreign import open_fields
from tests.conftest import REPO, TINY_MODEL, read_metrics, run_script
from utils.data.era5 import ERA5Dataset
from utils.data.files import NAMES_ATTR, SEGMENTS_ATTR, STEP_ATTR, YearFile, lead_time, pair_starts

REAL = REPO / "datasets" / "real"
REAL_FILES = ("era5-levels-members.grib", "era5-levels-members.nc")
LAT_SN = np.arange(-90.0, 90.1, 30.0)  # 7 rows, south to north (WeatherBench 2's order)
LON_180 = np.arange(-180.0, 180.0, 30.0)  # 12 columns from -180


def cds_like(times, long_names=False, level_dim="pressure_level", time_dim="valid_time") -> xr.Dataset:
    """ERA5 as the CDS (or WeatherBench 2) writes it, south to north, longitudes from -180, with fields whose
    value says where and when they are: lat + lon / 1000 + hours since the start / 1e4 (+ an offset per field)."""
    hours = (times - times[0]) / np.timedelta64(1, "h")
    grid = LAT_SN[None, :, None] + LON_180[None, None, :] / 1000 + hours[:, None, None] / 1e4
    levels = np.array([850.0, 500.0])
    names = dict(u10="u10", v10="v10", t2m="t2m", tcwv="tcwv", t="t", z="z")
    if long_names:
        names = {k: next(n for n, s in foreign.LONG_NAMES.items() if s == k) for k in names}
    single = (("u10", 1, "m s**-1"), ("v10", 2, "m s**-1"), ("t2m", 300, "K"), ("tcwv", 20, "kg m**-2"))
    surface = {names[k]: ((time_dim, "latitude", "longitude"), (grid + off).astype("f4"), {"units": u})
               for k, off, u in single}
    upper = {names[k]: ((time_dim, level_dim, "latitude", "longitude"),
                        (grid[:, None] + off + levels[None, :, None, None]).astype("f4"), {"units": u})
             for k, off, u in (("t", 0, "K"), ("z", 5e4, "m**2 s**-2"))}
    return xr.Dataset({**surface, **upper}, coords={time_dim: times, level_dim: levels, "latitude": LAT_SN,
                                                     "longitude": LON_180})


def six_hourly(start: str, end: str, gap=()) -> np.ndarray:
    times = pd.date_range(start, end, freq="6h").values
    return times[~np.isin(times, np.array(gap, dtype="datetime64[ns]"))]


# Dec 20, 2008 to Jan 10, 2009, every 6 h, without Dec 25 (4 times): 44 + 40 samples.
TIMES = six_hourly("2008-12-20", "2009-01-10T18:00", gap=pd.date_range("2008-12-25", periods=4, freq="6h").values)


def run(capsys, *argv) -> tuple[int, str, str]:
    """datasets/convert.py in this process: (exit status, stdout, stderr)."""
    try:
        code = convert.main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def fields(path: Path):
    with h5py.File(path, "r") as f:
        return f["fields"][:], dict(f["fields"].attrs), f["time"][:]


@pytest.fixture(scope="module")
def nc_source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sources") / "era5.nc"
    cds_like(TIMES).to_netcdf(path)
    return path


def test_netcdf_is_oriented_split_by_year_with_its_gap_recorded(nc_source, tmp_path, capsys):
    code, out, err = run(capsys, nc_source, "--out", tmp_path, "--channels", "u10,t850,z500", "--train-years", 2008,
                         "--valid-years", 2009, "--quiet")
    assert code == 0, err
    train, attrs, hours = fields(tmp_path / "train" / "2008.h5")
    valid, _, _ = fields(tmp_path / "valid" / "2009.h5")
    assert train.shape == (48 - 4, 3, 7, 12) and valid.shape == (10 * 4, 3, 7, 12) and train.dtype == np.float32
    assert list(attrs["channels"]) == ["u10", "t850", "z500"] and attrs["hours_per_step"] == 6
    assert list(attrs["units"]) == ["m s-1", "K", "m2 s-2"] and attrs["time_step"] == "6 h"  # the channels' units
    # North to south, columns from 0 degrees east (the source ran from -180): 0, 30, ..., 330 -> -180 + 180 = 0 first.
    lon = np.where(np.arange(0, 360, 30) >= 180, np.arange(0, 360, 30) - 360, np.arange(0, 360, 30))
    np.testing.assert_allclose(train[0, 0], 1 + LAT_SN[::-1, None] + lon[None, :] / 1000, atol=1e-4)
    np.testing.assert_allclose(train[0, 2] - train[0, 0], 5e4 + 500 - 1, rtol=1e-6)
    # The gap: 20 samples (Dec 20-24), then a new run from Dec 26.
    assert list(attrs["segment_starts"]) == [0, 20]
    assert hours[20] - hours[19] == 30 and set(np.diff(hours[:20])) == {6}
    # Statistics from the training split only, as compute_stats.py writes them.
    means = np.load(tmp_path / "stats" / "global_means.npy")
    assert means.shape == (1, 3, 1, 1)
    np.testing.assert_allclose(means.ravel(), train.astype(np.float64).mean(axis=(0, 2, 3)), rtol=1e-5)
    assert "wrote 2 files" in out and "stats/ (from train/, " in out


def test_forecast_pairs_never_span_a_recorded_gap(nc_source, tmp_path, capsys):
    assert run(capsys, nc_source, "--out", tmp_path, "--channels", "t2m", "--train-years", 2008, "--quiet")[0] == 0
    data = ERA5Dataset(tmp_path / "train", task="forecast", crop_size=0, lead=2, train=False)
    _, _, hours = fields(tmp_path / "train" / "2008.h5")
    assert len(data) == (20 - 2) + (24 - 2)
    for index in range(len(data)):
        _, day = data.locate(index)
        assert hours[day + 2] - hours[day] == 12  # two steps of 6 h: never across the gap
    x, y = data[17]
    assert x.shape == y.shape == (1, 6, 12)  # the loader drops the last row (7 -> 6)
    assert (convert.NAMES_ATTR, convert.SEGMENTS_ATTR, convert.STEP_ATTR) == (NAMES_ATTR, SEGMENTS_ATTR, STEP_ATTR)
    assert pair_starts(YearFile(Path("f"), 10, 7, 12, 1, segments=(0,)), 1) is None  # one run: every t < 9
    assert list(pair_starts(YearFile(Path("f"), 10, 7, 12, 1, segments=(0, 3, 4)), 1)) == [0, 1, 4, 5, 6, 7, 8]


def test_zarr_with_long_names_gives_the_same_file(nc_source, tmp_path, capsys):
    store = tmp_path / "wb2.zarr"
    cds_like(TIMES, long_names=True, level_dim="level", time_dim="time").to_zarr(store, zarr_format=2)  # as WB2
    args = ("--channels", "u10,v10,t850,z500", "--train-years", 2009, "--quiet")
    assert run(capsys, store, "--out", tmp_path / "z", *args)[0] == 0
    assert run(capsys, nc_source, "--out", tmp_path / "n", *args)[0] == 0
    z, z_attrs, _ = fields(tmp_path / "z" / "train" / "2009.h5")
    n, _, _ = fields(tmp_path / "n" / "train" / "2009.h5")
    np.testing.assert_array_equal(z, n)
    assert list(z_attrs["channels"]) == ["u10", "v10", "t850", "z500"]


def test_default_channels_step_crop_coarsen_and_presets(nc_source, tmp_path, capsys):
    code, _, err = run(capsys, nc_source, "--out", tmp_path / "a", "--step", 12, "--start", "2009-01-01",
                       "--end", "2009-01-02", "--lat", 60, -60, "--lon", 330, 60, "--coarsen", 2, "--quiet")
    assert code == 0, err
    data, attrs, hours = fields(tmp_path / "a" / "train" / "2009.h5")
    assert list(attrs["channels"]) == ["u10", "v10", "t2m", "tcwv", "t850", "t500", "z850", "z500"]
    assert attrs["hours_per_step"] == 12 and len(hours) == 4 and set(np.diff(hours)) == {12}
    # Rows 60, 0, -60 (every 2nd of 60..-60); columns 330, 0, 30, 60 (across 0 E) -> every 2nd: 330 and 30.
    assert data.shape == (4, 8, 3, 2)
    src = cds_like(TIMES).sel(valid_time=np.datetime64("2009-01-01T12:00"), latitude=[60, 0, -60], longitude=[-30, 30])
    np.testing.assert_array_equal(data[1, 0], src.u10.values)
    np.testing.assert_array_equal(data[1, 7], src.z.sel(pressure_level=500).values)
    # SuperBench's set: the 10 m channel is the wind speed made from u10 and v10.
    assert run(capsys, nc_source, "--out", tmp_path / "s", "--channels", "superbench", "--train-years", 2009,
               "--quiet")[0] == 0
    sb, sb_attrs, _ = fields(tmp_path / "s" / "train" / "2009.h5")
    uv, _, _ = fields(tmp_path / "a" / "train" / "2009.h5")
    assert list(sb_attrs["channels"]) == ["kinetic energy 10 m", "temperature 2 m", "total column water vapour"]
    src = cds_like(TIMES).sel(valid_time="2009-01-01T00:00").isel(latitude=slice(None, None, -1))
    u, v = src.u10.roll(longitude=6).values, src.v10.roll(longitude=6).values
    np.testing.assert_allclose(sb[0, 0], np.sqrt(u * u + v * v), rtol=1e-6)


def test_fill_values_are_refused_with_counts_or_filled_by_the_stated_rule(tmp_path, capsys):
    ds = cds_like(six_hourly("2010-01-01", "2010-01-02"))
    ds["t2m"][1, 2, 3] = np.nan  # written to the file as its _FillValue, decoded back to NaN by xarray
    ds["t2m"][4, :, 0] = np.nan
    ds.to_netcdf(tmp_path / "holes.nc", encoding={"t2m": {"_FillValue": -9999.0}})
    code, out, err = run(capsys, tmp_path / "holes.nc", "--out", tmp_path / "o", "--channels", "u10,t2m", "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "NaN or fill values in the source: t2m 8 (of 420 points per channel" in err and "--fill" in err
    assert not list((tmp_path / "o").rglob("*.h5*")) and not (tmp_path / "o" / "stats").exists()
    code, out, err = run(capsys, tmp_path / "holes.nc", "--out", tmp_path / "o", "--channels", "u10,t2m", "--quiet",
                         "--fill", "mean")
    assert code == 0 and "filled (mean): t2m 8" in out
    data, attrs, _ = fields(tmp_path / "o" / "train" / "2010.h5")
    assert np.isfinite(data).all() and list(attrs["filled"]) == [0, 8] and attrs["fill_rule"] == "mean"
    # The source's row 2 (30 S) is row 4 from the north; its column 3 (90 W) is column 9 from 0 E.
    assert data[1, 1, 4, 9] == pytest.approx(np.delete(data[1, 1].ravel(), 4 * 12 + 9).mean(), rel=1e-6)


def test_an_interrupted_conversion_resumes_by_skipping_complete_years(nc_source, tmp_path, capsys):
    real_sample, calls = convert.Reader.sample, []

    def interrupt_in_2009(self, member, t):  # the 6th sample of 2009
        calls.append(t)
        if self.plan.times[t] >= np.datetime64("2009-01-01") and len(calls) > 45:
            raise KeyboardInterrupt
        return real_sample(self, member, t)

    args = (nc_source, "--out", tmp_path, "--channels", "t2m", "--train-years", 2008, "--valid-years", 2009, "--quiet")
    with mock.patch.object(convert.Reader, "sample", interrupt_in_2009):
        code, _, err = run(capsys, *args)
    assert code == 130 and "complete years were kept" in err
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.h5*")) == ["train/2008.h5"]
    (tmp_path / "valid" / "2009.h5.12345.partial").write_bytes(b"left by a killed run")
    before = os.stat(tmp_path / "train" / "2008.h5").st_mtime_ns
    code, out, _ = run(capsys, *args)
    assert code == 0 and "train/2008.h5: complete, skipped" in out and "valid/2009.h5: 40 samples" in out
    assert os.stat(tmp_path / "train" / "2008.h5").st_mtime_ns == before
    assert not list(tmp_path.rglob("*.partial"))
    code, _, err = run(capsys, nc_source, "--out", tmp_path, "--channels", "t2m,u10", "--train-years", 2008, "--quiet")
    assert code == 2 and "exists with other content" in err


def test_dry_run_prints_sizes_and_time_and_writes_nothing(nc_source, tmp_path, capsys):
    code, out, _ = run(capsys, nc_source, "--out", tmp_path / "d", "--channels", "u10,z500", "--dry-run")
    assert code == 0 and "train/2008.h5: 44 samples, 2 runs of consecutive times" in out
    assert "dry run: 2 files to write" in out and "at the rate measured now" in out
    assert not (tmp_path / "d").exists()


# ----------------------------------------------------------------------------------------------------------
# Data from other centres: CF attributes and odd names, CMIP names, other units, longitudes past 360, months
# ----------------------------------------------------------------------------------------------------------

LAT_CF, LON_CF = np.arange(-90.0, 90.1, 30.0), np.arange(20.0, 380.1, 30.0)  # south to north; 20 -> 380 (cyclic)
# Monthly, mid-month times as archives write them (1 month apart, wandering by hours), June 2001 missing.
MONTHS = np.array([t for t in pd.date_range("2001-01-16T12", periods=24, freq="730h").values
                   if not str(t).startswith("2001-06")])


def archive_like(path: Path) -> None:
    """An older archive's netCDF, found only by CF attributes: dimensions TIME, FNOCY, FNOCX, PRESS (units only),
    winds in M/S and km/h, temperature in degrees Celsius; a field's value says where and when it is."""
    month = np.arange(len(MONTHS))[:, None, None]
    grid = LAT_CF[None, :, None] + np.mod(LON_CF, 360)[None, None, :] / 1000 + month / 100
    levels = grid[:, None] + np.array([-10.0, 20.0])[:, None, None]  # degrees C at 850 and 500 mbar
    ds = xr.Dataset({"UWND": (("TIME", "FNOCY", "FNOCX"), grid.astype("f4"), {"units": "M/S"}),
                     "VWND": (("TIME", "FNOCY", "FNOCX"), (grid * 3.6).astype("f4"), {"units": "km/h"}),
                     "TEMP": (("TIME", "PRESS", "FNOCY", "FNOCX"), levels.astype("f4"), {"units": "degC"})},
                    coords={"TIME": MONTHS, "PRESS": ("PRESS", [850.0, 500.0], {"units": "mbar"}),
                            "FNOCY": ("FNOCY", LAT_CF, {"units": "degrees_north"}),
                            "FNOCX": ("FNOCX", LON_CF, {"units": "degrees_east"})})
    ds.to_netcdf(path)


def cmip_like(path: Path) -> None:
    """CMIP6's names and attributes: tas, uas, zg and ta on plev in Pa, a noleap calendar, bounds variables."""
    times = xr.date_range("2005-01-01", periods=3, freq="D", calendar="noleap", use_cftime=True)
    grid = LAT_SN[None, :, None] + np.arange(0.0, 360.0, 30.0)[None, None, :] / 1000 + np.arange(3)[:, None, None]
    upper = grid[:, None] + np.array([0.0, 1.0])[None, :, None, None]
    dims, dims3 = ("time", "lat", "lon"), ("time", "plev", "lat", "lon")
    ds = xr.Dataset({"tas": (dims, grid + 280, {"units": "K", "standard_name": "air_temperature"}),
                     "uas": (dims, grid, {"units": "m s-1"}), "zg": (dims3, upper + 5000, {"units": "m"}),
                     "ta": (dims3, upper + 250, {"units": "K"}),
                     "lat_bnds": (("lat", "bnds"), np.stack([LAT_SN - 15, LAT_SN + 15], axis=1))},
                    coords={"time": ("time", times, {"axis": "T"}),
                            "plev": ("plev", [85000.0, 50000.0], {"units": "Pa", "axis": "Z", "positive": "down"}),
                            "lat": ("lat", LAT_SN, {"axis": "Y", "standard_name": "latitude"}),
                            "lon": ("lon", np.arange(0.0, 360.0, 30.0), {"axis": "X", "standard_name": "longitude"})})
    ds.to_netcdf(path)


def test_an_archive_by_cf_attributes_with_other_units_and_months_converts_and_loads(tmp_path, capsys):
    archive_like(tmp_path / "navy.cdf")
    (tmp_path / "map.yaml").write_text("# the archive's names: the channels' variables\nVWND: v10\nTEMP: t\n")
    code, out, err = run(capsys, tmp_path / "navy.cdf", "--out", tmp_path / "o", "--channels", "u10,v10,t500",
                         "--rename", "UWND=u10", "--rename-file", tmp_path / "map.yaml", "--train-years", 2001,
                         "--valid-years", 2002, "--quiet")
    assert code == 0, err
    data, attrs, hours = fields(tmp_path / "o" / "valid" / "2002.h5")
    assert data.shape == (12, 3, 7, 12)  # the cyclic column at 380 (= 20) E dropped
    assert list(attrs["units"]) == ["m s-1", "m s-1", "K"] and attrs["time_step"] == "1 month"
    assert "hours_per_step" not in attrs and list(attrs["segment_starts"]) == [0]
    # Rows north to south, columns east from 0 E: 20, 50, ..., 350 (380 is 20 again), values converted.
    expected = LAT_CF[::-1, None] + np.arange(20.0, 360.0, 30.0)[None, :] / 1000 + 11 / 100
    np.testing.assert_allclose(data[0, 0], expected, atol=1e-4)
    np.testing.assert_allclose(data[0, 1], expected, atol=1e-4)  # km/h -> m s-1
    np.testing.assert_allclose(data[0, 2], expected + 20 + 273.15, atol=1e-3)  # 500 mbar, degrees C -> K
    assert hours[1] - hours[0] == 730
    # The month missing from 2001 is a gap; the forecast loader pairs consecutive months and says so.
    train = ERA5Dataset(tmp_path / "o" / "train", task="forecast", crop_size=0, lead=1, train=False)
    assert list(fields(tmp_path / "o" / "train" / "2001.h5")[1]["segment_starts"]) == [0, 5]
    assert len(train) == 4 + 5 and train.lead_time == "1 month" and "lead 1 month" in repr(train)
    assert lead_time("1 month", 3) == "3 months" and lead_time("6 h", 2) == "12 h" and lead_time(None, 1) == "1 step"
    # The same rules, for a prediction's inputs: one array in the same order and units.
    array = open_fields([tmp_path / "navy.cdf"], ["u10", "v10", "t500"], rename={"UWND": "u10", "VWND": "v10",
                                                                                  "TEMP": "t"})
    assert array.dims == ("time", "channel", "lat", "lon") and array.attrs["units"] == ["m s-1", "m s-1", "K"]
    np.testing.assert_array_equal(array.sel(time=array.time.dt.year == 2002).values, data)
    assert list(array.lon.values) == list(np.arange(20.0, 360.0, 30.0)) and float(array.lat[0]) == 90


def test_cmip_names_plev_in_pa_and_a_model_calendar_convert_and_load(tmp_path, capsys):
    cmip_like(tmp_path / "cmip.nc")
    code, _, err = run(capsys, tmp_path / "cmip.nc", "--out", tmp_path / "o", "--channels", "t2m,u10,z500,t850",
                       "--quiet")
    assert code == 0, err
    data, attrs, hours = fields(tmp_path / "o" / "train" / "2005.h5")
    assert list(attrs["units"]) == ["K", "m s-1", "m2 s-2", "K"] and attrs["time_step"] == "24 h"
    src = xr.open_dataset(tmp_path / "cmip.nc").isel(lat=slice(None, None, -1), time=2)
    np.testing.assert_allclose(data[2, 0], src.tas.values, rtol=1e-6)
    np.testing.assert_allclose(data[2, 2], src.zg.sel(plev=50000).values * 9.80665, rtol=1e-6)  # height -> geopotential
    np.testing.assert_allclose(data[2, 3], src.ta.sel(plev=85000).values, rtol=1e-6)
    x, y = ERA5Dataset(tmp_path / "o" / "train", task="sr", crop_size=0, upscale=2, train=False)[0]
    assert y.shape == (4, 6, 12) and x.shape == (4, 3, 6)


def test_help_names_each_default_once(capsys):
    with pytest.raises(SystemExit):
        convert.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text and "(default: [])" not in text and "(default: False)" not in text
    assert "(default: every variable and level)" in text and not re.search(r"\(default[^)]*\) \(default", text)


def _bad_sources(root: Path) -> dict[str, tuple[list, str]]:
    """Every bad input: (arguments, what its one line says)."""
    times = six_hourly("2010-01-01", "2010-01-03")
    cds_like(times).to_netcdf(root / "ok.nc")
    shuffled = cds_like(times)
    shuffled.isel(valid_time=[0, 2, 1, 3]).to_netcdf(root / "shuffled.nc")
    coarse = cds_like(times).isel(latitude=slice(None, None, 2))
    coarse.to_netcdf(root / "coarse.nc")
    cds_like(six_hourly("2010-01-04", "2010-01-05")).to_netcdf(root / "later.nc")
    irregular = pd.to_datetime(["2010-01-01T00", "2010-01-01T06", "2010-01-01T15"]).values  # 6 h, then 9 h
    cds_like(irregular).to_netcdf(root / "irregular.nc")
    cds_like(times).to_netcdf(root / "copy.nc")
    (root / "text.nc").write_text("not a netCDF file")
    odd = cds_like(times)
    odd.u10.attrs["units"], odd.t2m.attrs["units"] = "K", "parsecs"
    odd.to_netcdf(root / "units.nc")
    cds_like(times).assign(uas=lambda d: d.u10).to_netcdf(root / "twice.nc")
    xr.Dataset({"u10": (("valid_time", "Y2", "X2"), np.zeros((len(times), 7, 12)))},
               coords={"valid_time": times, "Y2": LAT_SN, "X2": LON_180}).to_netcdf(root / "no_lat.nc")
    days_360 = xr.date_range("2001-02-28", periods=3, freq="D", calendar="360_day", use_cftime=True)
    cds_like(times[:3]).assign_coords(valid_time=days_360).to_netcdf(root / "360_day.nc")
    archive_like(root / "months.nc")
    (root / "list.yaml").write_text("- UWND\n- u10\n")
    ok = root / "ok.nc"
    return {
        "missing variable": ([ok, "--channels", "u10,sst"], "channel sst: no variable sst in the sources"),
        "missing level": ([ok, "--channels", "z700"], "channel z700: variable z has no level 700 hPa (levels: 500, "),
        "preset missing": ([ok, "--channels", "nersc20"], "channel sp: no variable sp"),
        "non-monotonic time": ([root / "shuffled.nc"], "the time axis is not increasing"),
        "mixed grids": ([ok, root / "coarse.nc"], "mixed grids:"),
        "no such file": ([root / "absent*.nc"], "no such file or Zarr store"),
        "not netCDF": ([root / "text.nc"], "cannot be opened as netCDF, GRIB or Zarr"),
        "year not there": ([ok, "--valid-years", 2011], "--valid-years 2011: no time of 2011"),
        "year twice": ([ok, "--train-years", 2010, "--valid-years", 2010], "year 2010 is in both train and valid"),
        "overlap": ([ok, root / "copy.nc"], "is in both"),
        "irregular": ([root / "irregular.nc"], "the time steps are irregular"),
        "step": ([ok, "--step", 9], "--step 9 is not a multiple of the sources' 6 h step"),
        "crop": ([ok, "--lat", 10, 5], "the crop holds"),
        "unit not the channel's": ([root / "units.nc", "--channels", "u10"], "units 'K' cannot be converted to m s-1"),
        "unit not understood": ([root / "units.nc", "--channels", "t2m"], "units 'parsecs' are not understood"),
        "two names, one channel": ([root / "twice.nc"], "variables u10 and uas are both u10; keep one or name"),
        "no latitude": ([root / "no_lat.nc"], "which dimension is latitude? None has its CF attributes (units "
                        "degrees_north, standard_name latitude or axis Y) or a usual name (latitude, lat); "
                        "candidates: Y2 (7), X2 (12); name it: --rename DIM=latitude"),
        "model calendar": ([root / "360_day.nc"], "the 360_day calendar has dates that the standard calendar lacks"),
        "rename unknown": ([ok, "--rename", "FOO=u10"], "--rename FOO: no variable or dimension FOO in the sources"),
        "rename syntax": ([ok, "--rename", "u10"], "expected NAME=CHANNEL pairs"),
        "rename file": ([ok, "--rename-file", root / "list.yaml"], "expected a mapping of names"),
        "monthly step": ([root / "months.nc", "--step", 6, "--channels", "UWND"], "hold one time a month; keep every"),
        "member": ([ok, "--members", "3"], ""),  # no member dimension: nothing to select, converts
        "later times": ([ok, root / "later.nc", "--channels", "t2m", "--start", "2010-01-05"], ""),
    }


def test_every_bad_input_stops_with_one_line_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    for what, (argv, says) in _bad_sources(tmp_path / "src").items():
        out = tmp_path / what.replace(" ", "_")
        code, _, err = run(capsys, *argv, "--out", out, "--quiet")
        if not says:
            assert code == 0, f"{what}: {err}"
            continue
        assert code == 2 and len(err.strip().splitlines()) == 1, f"{what}: {code} {err}"
        assert says in err, f"{what}: {err}"
        assert not out.exists(), f"{what}: wrote {list(out.rglob('*'))}"
    (tmp_path / "a_file").write_text("kept")  # --out naming a file: said so (not blamed on free space)
    code, _, err = run(capsys, tmp_path / "src" / "ok.nc", "--out", tmp_path / "a_file" / "era5", "--quiet")
    assert code == 2 and f"{tmp_path / 'a_file'} is a file, not a folder" in err
    assert (tmp_path / "a_file").read_text() == "kept"


def test_missing_readers_are_named_in_one_line(tmp_path, capsys):
    with mock.patch.object(convert, "xr", None):
        code, _, err = run(capsys, tmp_path / "any.nc", "--out", tmp_path / "o")
    assert code == 2 and "xarray is not installed; pip install -r requirements.txt -c constraints.txt (make install)" in err
    (tmp_path / "f.grib").write_bytes(b"GRIB")
    with mock.patch.object(xr.backends, "list_engines", lambda: {}):
        code, _, err = run(capsys, tmp_path / "f.grib", "--out", tmp_path / "o")
    assert code == 2 and "reading GRIB needs cfgrib and the ecCodes library" in err


def test_cds_requests_ask_for_exactly_the_variables_of_a_channel_set(tmp_path, capsys):
    single, upper, levels = cds_request.variables([name for name, _ in convert.PRESETS["nersc20"]])
    assert single == ["10m_u_component_of_wind", "10m_v_component_of_wind", "2m_temperature", "surface_pressure",
                      "mean_sea_level_pressure", "total_column_water_vapour"]
    assert upper == ["temperature", "u_component_of_wind", "v_component_of_wind", "geopotential", "relative_humidity"]
    assert levels == ["50", "500", "850", "1000"]
    assert cds_request.variables(["kinetic energy 10 m", "temperature 2 m"])[0] == [
        "10m_u_component_of_wind", "10m_v_component_of_wind", "2m_temperature"]
    assert cds_request.main(["--channels", "superbench", "--years", "2016", "--out", str(tmp_path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 12 and lines[0].startswith(f"{tmp_path}/single-2016-01.nc: reanalysis-era5-single-levels {{")
    with pytest.raises(SystemExit) as stop:
        cds_request.main(["--channels", "u10,foo", "--years", "2016", "--out", str(tmp_path)])
    assert stop.value.code == 2 and "channel foo: not an ERA5 variable" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ----------------------------------------------------------------------------------------------------------
# Real ERA5 fields: cfgrib's sample (GRIB and netCDF), fetched from PyPI by `make real-data`
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_data() -> Path:
    if not all((REAL / name).is_file() for name in REAL_FILES):
        proc = subprocess.run(["make", "-C", str(REPO), "real-data"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"make real-data failed (it needs PyPI):\n{proc.stdout}{proc.stderr}"
    return REAL


@pytest.fixture(scope="module")
def real_converted(real_data, tmp_path_factory) -> Path:
    """8 ensemble members for training, the other 2 for validation, as datasets/README.md converts them."""
    out = tmp_path_factory.mktemp("real") / "era5_sample"
    grib = real_data / "era5-levels-members.grib"
    assert convert.main([str(grib), "--out", str(out), "--members", "0-7", "--quiet"]) == 0
    assert convert.main([str(grib), "--out", str(out), "--members", "8-9", "--split", "valid=2017", "--quiet"]) == 0
    return out


def test_real_grib_and_netcdf_convert_to_the_same_fields(real_data, real_converted, tmp_path, capsys):
    code, _, err = run(capsys, real_data / "era5-levels-members.nc", "--out", tmp_path, "--members", "8-9", "--split",
                       "valid=2017", "--quiet")
    assert code == 0, err
    from_nc, attrs, hours = fields(tmp_path / "valid" / "2017.h5")
    from_grib, _, _ = fields(real_converted / "valid" / "2017.h5")
    assert list(attrs["channels"]) == ["z850", "z500", "t850", "t500"] and attrs["hours_per_step"] == 12
    assert from_nc.shape == (8, 4, 61, 120) and list(attrs["segment_starts"]) == [0, 4]  # 2 members x 4 times
    np.testing.assert_allclose(from_nc, from_grib, rtol=1e-6, atol=0.01)  # netCDF's packing: 0.1 steps at most
    assert 4.9e4 < from_grib[:, 1].mean() < 5.7e4 and 240 < from_grib[:, 3].mean() < 260  # z500 (m2 s-2), t500 (K)


def test_real_fields_pass_check_data_and_train(real_converted, tmp_path):
    overrides = ("--data_dir", str(real_converted), "--in_chans", "4", "--channel_names", "[]", "--mean", "[]",
                 "--std", "[]")
    proc = run_script("datasets/check_data.py", "--config", "quickstart", *overrides, in_process=True)
    assert "32 training and 8 validation samples" in proc.stdout
    run_dir = tmp_path / "run"
    proc = run_script("train.py", "--config", "quickstart", *overrides, "--run_dir", str(run_dir), *TINY_MODEL,
                      "--loss_space", "normalized", "--max_steps", "4", "--val_every", "4", "--log_every", "2",
                      "--progress", "never", in_process=True)
    val = [r for r in read_metrics(run_dir) if r.get("kind") == "val"][-1]
    assert len(val["rmse"]) == len(val["bicubic_rmse"]) == 4
    assert "rmse: z850" in proc.stdout and "t500" in proc.stdout  # the channel names come from the files
