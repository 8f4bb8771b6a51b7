"""evaluate.py and utils/predict/scores.py: WeatherBench 2's definitions by hand (area weights, the RMSE's root after
the time mean), agreement with an independent scorer (the Bureau of Meteorology's `scores`), an end-to-end run on
predict.py's store of the tiny ViT against its data folder, bad input, and monthly leads matched by the calendar."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pandas as pd
import pytest
import xarray as xr

import evaluate
import predict
from datasets import convert
from tests.test_train import expect_error_in_process
from utils.predict.scores import (index_in, latitude_weights, match_by_month, over_time, per_time, verifying_times,
                                  zonal_spectrum)
from utils.predict.truth import is_monthly

S22, S67 = np.sin(np.deg2rad(22.5)), np.sin(np.deg2rad(67.5))


def wb2_weights(latitude) -> np.ndarray:
    """WeatherBench 2's get_lat_weights as its definition states it, written out row by row: on latitudes sorted
    south to north, in radians, cell bounds at -pi/2, the midpoints between rows, and pi/2; the weight is
    sin(upper) - sin(lower), divided by its mean; returned in the rows' own order."""
    lat = [float(v) for v in latitude]
    ranked = sorted(range(len(lat)), key=lambda i: lat[i])
    x = [np.radians(lat[i]) for i in ranked]
    bounds = [-np.pi / 2] + [(x[k] + x[k + 1]) / 2 for k in range(len(x) - 1)] + [np.pi / 2]
    area = {ranked[k]: np.sin(bounds[k + 1]) - np.sin(bounds[k]) for k in range(len(x))}
    mean = sum(area.values()) / len(area)
    return np.array([area[i] / mean for i in range(len(lat))])


def test_weights_are_cell_areas_of_mean_one_not_cos_latitude():
    lat = np.array([90.0, 45.0, 0.0, -45.0, -90.0])  # a regular grid with both poles: the pole cells are half cells
    areas = np.array([1 - S67, S67 - S22, 2 * S22, S67 - S22, 1 - S67])  # sin(upper) - sin(lower), bounds +-22.5
    assert areas.sum() == pytest.approx(2.0)  # the whole sphere, from sin(90) - sin(-90)
    weights = latitude_weights(lat)
    np.testing.assert_allclose(weights, areas / 0.4, rtol=1e-12)
    assert weights.mean() == pytest.approx(1.0)
    np.testing.assert_allclose(latitude_weights(lat[::-1]), weights[::-1], rtol=1e-12)  # either order, by value
    cos = np.cos(np.deg2rad(lat)) / np.cos(np.deg2rad(lat)).mean()
    assert weights[0] > 0.19 and cos[0] < 1e-12  # a pole row keeps its cap's area
    assert abs(weights[2] - cos[2]) > 0.15


def test_the_outermost_cells_reach_the_poles_as_in_weatherbench2():
    # Without the 90S row (the project's grids, 720-row ERA5): the last row's cell runs from -22.5 down to the pole,
    # not half a spacing (-67.5): its area is 1 - sin(22.5), not sin(67.5) - sin(22.5).
    lat = np.array([90.0, 45.0, 0.0, -45.0])
    areas = np.array([1 - S67, S67 - S22, 2 * S22, 1 - S22])
    assert areas.sum() == pytest.approx(2.0)
    np.testing.assert_allclose(latitude_weights(lat), areas / 0.5, rtol=1e-12)
    # Rows offset by half a spacing from the poles: every cell is a whole band, so the weights are exactly
    # cos(latitude) / its mean (sin(a + d) - sin(a - d) = 2 cos(a) sin(d)).
    offset = np.array([67.5, 22.5, -22.5, -67.5])
    cos = np.cos(np.deg2rad(offset))
    np.testing.assert_allclose(latitude_weights(offset), cos / cos.mean(), rtol=1e-12)
    # One row: the whole sphere.
    np.testing.assert_allclose(latitude_weights([10.0]), [1.0])
    # WeatherBench 2's definition written out, on a 0.25 degree grid of 720 rows (the 90S row dropped), either
    # order, and on an irregular grid in no order.
    era5 = 90.0 - 0.25 * np.arange(720)
    np.testing.assert_allclose(latitude_weights(era5), wb2_weights(era5), rtol=1e-12)
    np.testing.assert_allclose(latitude_weights(era5[::-1]), wb2_weights(era5[::-1]), rtol=1e-12)
    irregular = np.random.default_rng(2).permutation([88.0, 61.0, 30.5, 2.0, -15.0, -40.0, -71.0])
    np.testing.assert_allclose(latitude_weights(irregular), wb2_weights(irregular), rtol=1e-12)
    # The last row's cell: from -89.625 to the pole, 1.5 rows' worth there, not one.
    assert latitude_weights(era5)[-1] / latitude_weights(era5)[-2] == pytest.approx(
        (np.sin(np.radians(-89.625)) + 1) / (np.sin(np.radians(-89.375)) - np.sin(np.radians(-89.625))), rel=1e-9)


def test_rmse_is_the_root_of_the_time_mean_not_the_mean_of_roots():
    truth = np.zeros((2, 2, 3))
    forecast = np.stack([np.zeros((2, 3)), np.full((2, 3), 2.0)])  # errors 0 then 2 everywhere
    weights = latitude_weights([45.0, -45.0])
    stats = per_time(forecast, truth, None, weights)
    np.testing.assert_allclose(stats["se"], [0.0, 4.0])
    scores = over_time({k: v.sum(axis=0) for k, v in stats.items()}, 2)
    assert scores["rmse"] == pytest.approx(np.sqrt(2.0))  # sqrt((0 + 4) / 2)
    assert np.sqrt(stats["se"]).mean() == pytest.approx(1.0)  # the mean of per-time RMSEs: another number
    assert scores["bias"] == pytest.approx(1.0) and scores["mae"] == pytest.approx(1.0)


def test_agrees_with_the_bureau_of_meteorologys_scores():
    """The same arrays and WeatherBench 2's weights through `scores` (PyPI, independent of this project)."""
    continuous = pytest.importorskip("scores.continuous")
    rng = np.random.default_rng(0)
    lat, lon = 90.0 - np.arange(9) * 22.5, np.arange(8) * 45.0
    truth = rng.normal(280.0, 10.0, (5, 9, 8))
    forecast = truth + rng.normal(0.5, 2.0, truth.shape) * np.linspace(0.2, 2.0, 9)[:, None]
    weights = latitude_weights(lat)
    ours = over_time({k: v.sum(axis=0) for k, v in per_time(forecast, truth, None, weights).items()}, 5)
    coords = {"time": np.arange(5), "latitude": lat, "longitude": lon}
    as_xr = lambda a: xr.DataArray(a, coords=coords, dims=tuple(coords))
    w = xr.DataArray(weights, coords={"latitude": lat}, dims=("latitude",))
    theirs = {"rmse": continuous.rmse(as_xr(forecast), as_xr(truth), weights=w),
              "mae": continuous.mae(as_xr(forecast), as_xr(truth), weights=w),
              "bias": continuous.additive_bias(as_xr(forecast), as_xr(truth), weights=w)}
    for metric, value in theirs.items():
        assert float(ours[metric]) == pytest.approx(float(value), rel=1e-6, abs=1e-9), metric
    unweighted = continuous.rmse(as_xr(forecast), as_xr(truth))
    assert abs(float(unweighted) - float(ours["rmse"])) > 1e-3  # the weights matter on these arrays


def test_zonal_spectrum_follows_weatherbench2s_definition():
    # WB2's ZonalEnergySpectrum: S_0 = C |F_0|^2, S_k = 2 C |F_k|^2 for every k > 0 (Nyquist too), F = DFT / L, C the
    # circle's length with R = 6,367.5 km. Without a Nyquist term the sum is the circle's mean square times C.
    rng = np.random.default_rng(1)
    circle = 2 * np.pi * 6.3675e6 * np.cos(np.deg2rad(30.0))
    for width in (16, 15):  # with and without a Nyquist wavenumber
        x = rng.normal(size=(1, width))
        energy = zonal_spectrum(x, np.array([30.0]), np.array([1.0]))
        coefficients = np.array([(x[0] * np.exp(-2j * np.pi * k * np.arange(width) / width)).mean()
                                 for k in range(width // 2 + 1)])
        assert energy == pytest.approx(np.abs(coefficients) ** 2 * circle * np.r_[1, [2] * (width // 2)], rel=1e-12)
    assert energy.sum() == pytest.approx((x ** 2).mean() * circle)  # width 15
    wave = np.cos(2 * np.pi * 3 * np.arange(16) / 16)[None]
    assert zonal_spectrum(wave, np.array([0.0]), np.array([1.0])).argmax() == 3


# ----------------------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def forecast_store(vit_reference, tmp_path_factory):
    """predict.py's store of the tiny ViT: 10 initial times of the validation split, 2 leads of 6 h."""
    out = tmp_path_factory.mktemp("evaluate") / "forecast.zarr"
    assert predict.main(["--checkpoint", str(vit_reference), "--out", str(out), "--times", "0:10", "--steps", "2",
                         "--picture", "none", "--progress", "never", "--device", "cpu"]) == 0
    return out


def hand_rmse(forecast: np.ndarray, truth: np.ndarray, lat: np.ndarray) -> float:
    """WeatherBench 2's RMSE written out: its area weights (the grid lacks the 90S row: the last cell reaches the
    pole), spatial means, time mean, then the root."""
    w = wb2_weights(lat)
    mse = [(w[:, None] * (f - o) ** 2).mean() for f, o in zip(forecast, truth)]
    return float(np.sqrt(np.mean(mse)))


def test_scores_of_predicts_store_against_the_data_folder(forecast_store, vit_data, tmp_path, capsys):
    out, png = tmp_path / "scores.nc", tmp_path / "card.png"
    assert evaluate.main(["--forecast", str(forecast_store), "--truth", str(vit_data), "--out", str(out),
                          "--png", str(png)]) == 0
    stdout = capsys.readouterr().out
    assert "0 dropped" in stdout and "valid" in stdout and "verifying times matched exactly" in stdout
    assert png.stat().st_size > 0 and png.with_suffix(".curves.png").stat().st_size > 0
    with h5py.File(vit_data / "valid" / "2015.h5") as f:
        names = [n.decode() if isinstance(n, bytes) else str(n) for n in f["fields"].attrs["channels"]]
        t2m = f["fields"][:12, names.index("t2m"), :16].astype(np.float64)  # the last row dropped, as predict
    with xr.open_zarr(forecast_store) as fc, xr.open_dataset(out) as scores:
        lat = fc.latitude.values
        model = fc["2m_temperature"].values[:, 0]  # lead 1 of the 10 initial times
        assert list(scores["2m_temperature"].dims) == ["forecast", "metric", "lead_time"]
        assert list(scores.forecast.values) == ["model", "persistence", "climatology"]
        rmse = scores["2m_temperature"].sel(metric="rmse").isel(lead_time=0)
        assert float(rmse.sel(forecast="model")) == pytest.approx(hand_rmse(model, t2m[1:11], lat), rel=1e-5)
        assert float(rmse.sel(forecast="persistence")) == pytest.approx(hand_rmse(t2m[0:10], t2m[1:11], lat),
                                                                       rel=1e-5)
        assert scores.samples.sel(forecast="persistence").values.tolist() == [10, 10]
        assert scores.attrs["verifying_times_dropped"] == 0 and "train" in scores.attrs["climatology"]
        acc = scores["geopotential"].sel(metric="acc", level=500, forecast="persistence")
        assert np.all((acc.values > -1) & (acc.values <= 1))
        assert np.isnan(scores["geopotential"].sel(metric="acc", level=500, forecast="climatology")).all()
    with xr.open_dataset(out, group="spectra") as spectra:
        assert "truth" in spectra.forecast.values and spectra.zonal_wavenumber.size == 17


def test_bad_input_is_one_line_and_leaves_nothing(forecast_store, vit_data, tmp_path, capsys):
    out = tmp_path / "scores.nc"
    with xr.open_zarr(forecast_store) as fc:  # a truth store without one of the forecast's variables
        truth = fc.isel(prediction_timedelta=0).drop_vars("prediction_timedelta").drop_vars("2m_temperature")
        truth.to_zarr(tmp_path / "truth.zarr", zarr_format=2)
    cases = {"no variable 2m_temperature": ["--truth", str(tmp_path / "truth.zarr")],
             "none of the forecast's 20 verifying times": ["--truth", str(vit_data), "--split", "train"],
             "name a netCDF file": ["--truth", str(vit_data), "--out", str(tmp_path / "scores.zarr")]}
    for match, extra in cases.items():
        expect_error_in_process(capsys, "--forecast", str(forecast_store), "--out", str(out), *extra, match=match,
                                script="evaluate.py")
        assert not list(tmp_path.glob("*scores*")), match


def test_monthly_leads_count_calendar_months(tmp_path):
    months = np.array(["2015-01-01", "2015-02-01", "2015-03-01", "2015-04-01"], dtype="datetime64[ns]")
    lat = np.array([-60.0, 0.0, 60.0])  # the truth runs south to north, the forecast north to south
    field = lambda m: np.broadcast_to((m + 1) * 10.0 + lat[:, None], (3, 4))
    truth = xr.Dataset({"2m_temperature": (("time", "latitude", "longitude"), np.stack([field(m) for m in range(4)]))},
                       coords={"time": months, "latitude": lat, "longitude": np.arange(4) * 90.0})
    truth.to_zarr(tmp_path / "truth.zarr", zarr_format=2)
    # From January and February, 1 and 2 months ahead: exactly the truth of the calendar month reached.
    values = np.stack([np.stack([field(start + n)[::-1] for n in (1, 2)]) for start in (0, 1)])
    forecast = xr.Dataset({"2m_temperature": (("time", "prediction_timedelta", "latitude", "longitude"), values)},
                          coords={"time": months[:2], "prediction_timedelta": ("prediction_timedelta", [1, 2],
                                                                               {"units": "calendar months"}),
                                  "latitude": lat[::-1], "longitude": np.arange(4) * 90.0})
    forecast.to_zarr(tmp_path / "forecast.zarr", zarr_format=2)
    out = tmp_path / "scores.nc"
    assert evaluate.main(["--forecast", str(tmp_path / "forecast.zarr"), "--truth", str(tmp_path / "truth.zarr"),
                          "--out", str(out), "--baselines", "persistence"]) == 0
    with xr.open_dataset(out) as scores:
        assert scores.attrs["verifying_times_dropped"] == 0
        np.testing.assert_allclose(scores["2m_temperature"].sel(forecast="model", metric="rmse").values, 0, atol=1e-6)
        persistence = scores["2m_temperature"].sel(forecast="persistence", metric="bias").values
        np.testing.assert_allclose(persistence, [-10.0, -20.0])  # the initial month, 1 and 2 months behind
        assert scores.lead_time.attrs["units"] == "calendar months"
    ends = verifying_times(np.array(["2015-01-31"], dtype="datetime64[ns]"), np.array([1]), monthly=True)
    assert ends[0, 0] == np.datetime64("2015-02-28")  # a calendar month, not 30 days


# ----------------------------------------------------------------------------------------- monthly archives

# Monthly means as archives stamp them: each month at its centre, 730.5 h apart, so the hours wander (2001-01-16 20:00,
# 02-16 06:30, 03-18 17:00, ...): "initial time + 1 month" is never the next stamp. 2001 train, 2002 valid, 2003 test.
ARCHIVE_MONTHS = pd.date_range("2001-01-16T20:00", periods=36, freq="43830min").values
LAT_ARCHIVE, LON_ARCHIVE = np.arange(90.0, -90.1, -30.0), np.arange(0.0, 360.0, 30.0)


@pytest.fixture(scope="module")
def monthly_data(tmp_path_factory):
    """The archive converted by datasets/convert.py into train/valid/test, as a user would."""
    root = tmp_path_factory.mktemp("monthly")
    k = np.arange(len(ARCHIVE_MONTHS))[:, None, None]  # a field's value says which month it is: k + where
    values = k + LAT_ARCHIVE[None, :, None] / 100 + LON_ARCHIVE[None, None, :] / 1000
    xr.Dataset({"UWND": (("time", "lat", "lon"), values.astype("f4"), {"units": "m s-1"})},
               coords={"time": ARCHIVE_MONTHS, "lat": ("lat", LAT_ARCHIVE, {"units": "degrees_north"}),
                       "lon": ("lon", LON_ARCHIVE, {"units": "degrees_east"})}).to_netcdf(root / "archive.nc")
    assert convert.main([str(root / "archive.nc"), "--out", str(root / "data"), "--channels", "u10", "--rename",
                         "UWND=u10", "--train-years", "2001", "--valid-years", "2002", "--test-years", "2003",
                         "--quiet"]) == 0
    return root / "data"


def monthly_forecast(path, data, year: int, error: np.ndarray):
    """A forecast from each month of ``year`` as predict.py stamps it (the file's recorded times), 1 to 3 calendar
    months ahead: the truth of the month reached plus ``error`` (per latitude row)."""
    with h5py.File(next(data.glob(f"*/{year}.h5"))) as f:
        initial = (np.datetime64("1970-01-01", "ns") + (f["time"][:] * 3600e9).astype("timedelta64[ns]"))
    k0 = 12 * (year - 2001) + np.arange(12)
    lat = LAT_ARCHIVE[:-1]  # the 90S row dropped, as predict.py writes the grid
    reached = lambda k: k + lat[:, None] / 100 + LON_ARCHIVE[None, :] / 1000 + error[:, None]
    values = np.stack([np.stack([reached(k + n) for n in (1, 2, 3)]) for k in k0]).astype("f4")
    xr.Dataset({"10m_u_component_of_wind": (("time", "prediction_timedelta", "latitude", "longitude"), values)},
               coords={"time": initial, "prediction_timedelta": ("prediction_timedelta", [1, 2, 3],
                                                                 {"units": "calendar months"}),
                       "latitude": lat, "longitude": LON_ARCHIVE}).to_zarr(path, zarr_format=2)
    return initial


def test_monthly_archive_matched_by_calendar_month_against_the_forecasts_split(monthly_data, tmp_path, capsys):
    error = 1 + LAT_ARCHIVE[:-1] / 45  # larger toward the north pole: the weights matter
    initial = monthly_forecast(tmp_path / "forecast.zarr", monthly_data, 2002, error)
    assert str(initial[1])[:16] == "2002-02-16T12:30"  # the archive's wandering stamp, not a month's first
    out = tmp_path / "scores.nc"
    assert evaluate.main(["--forecast", str(tmp_path / "forecast.zarr"), "--truth", str(monthly_data),
                          "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "verifying times matched by calendar month (monthly data" in stdout
    assert "truth split valid: it holds 12 of the forecast's 12 initial times" in stdout
    with xr.open_dataset(out) as scores:
        u10 = scores["10m_u_component_of_wind"]
        # From October to December, 1 to 3 months ahead leave 2002: 6 of 36 pairs not in the validation split.
        assert scores.attrs["verifying_times_dropped"] == 6 and scores.samples.sel(forecast="model").values.tolist() \
            == [11, 10, 9]
        w = wb2_weights(LAT_ARCHIVE[:-1])  # WeatherBench 2's, the last cell down to the pole
        np.testing.assert_allclose(u10.sel(forecast="model", metric="rmse"), np.sqrt((w * error ** 2).mean()),
                                   rtol=1e-5)
        np.testing.assert_allclose(u10.sel(forecast="model", metric="bias"), (w * error).mean(), rtol=1e-5)
        # Persistence is n months behind; the climatology of 2001 by calendar month, 12 months behind, every month
        # present (no time of year substituted).
        np.testing.assert_allclose(u10.sel(forecast="persistence", metric="bias"), [-1, -2, -3], atol=1e-4)
        np.testing.assert_allclose(u10.sel(forecast="climatology", metric="rmse"), 12, atol=1e-4)
        assert "by calendar month" in scores.attrs["climatology"] and "climatology_substituted" not in scores.attrs


def test_monthly_errors_name_the_split_searched(monthly_data, tmp_path, capsys):
    monthly_forecast(tmp_path / "forecast.zarr", monthly_data, 2002, np.zeros(6))
    args = ["--forecast", str(tmp_path / "forecast.zarr"), "--out", str(tmp_path / "scores.nc")]
    expect_error_in_process(capsys, *args, "--truth", str(monthly_data), "--split", "train", script="evaluate.py",
                            match=f"(matched by calendar month) is among the truth's 12 in {monthly_data / 'train'}")
    only_train = tmp_path / "only_train"
    shutil.copytree(monthly_data / "train", only_train / "train")  # the forecast's year is in no split
    expect_error_in_process(capsys, *args, "--truth", str(only_train), script="evaluate.py",
                            match="no split holds any of the forecast's 12 initial times (2002-01-17T02:00 to")
    assert not list(tmp_path.glob("scores*"))


def test_only_monthly_spacing_is_matched_by_month():
    assert is_monthly(ARCHIVE_MONTHS) and is_monthly(ARCHIVE_MONTHS[[0, 1, 3, 4]])  # a missing month is a gap
    assert is_monthly(pd.date_range("2001-01-01", periods=14, freq="MS").values)
    assert not is_monthly(pd.date_range("2001-01-01", periods=90, freq="D").values)
    assert not is_monthly(pd.date_range("2001-01-01", periods=8, freq="6h").values)
    assert not is_monthly(np.array(["2001-01-01", "2001-01-30", "2001-03-01"], dtype="datetime64[ns]"))  # two in Jan
    # Daily truth: exactly; a stamp an hour off is not found. Monthly: any day and hour of the same month.
    daily = pd.date_range("2001-01-01", periods=60, freq="D").values
    assert not match_by_month(daily, leads_monthly=True)
    assert index_in(np.array(["2001-02-01T01:00"], dtype="datetime64[ns]"), daily).tolist() == [-1]
    assert index_in(np.array(["2001-03-02T09:15"], dtype="datetime64[ns]"), ARCHIVE_MONTHS, by_month=True).tolist() \
        == [2]
