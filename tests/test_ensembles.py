"""Ensembles (Part V, docs/part5-ensembles.md): predict.py --members on the tiny ViT (2 ranks against 1 bit for bit, a
run killed with SIGKILL and finished against an uninterrupted one, a member the same whatever else is predicted, the
lagged members against deterministic forecasts), the perturbations by their definitions, and evaluate.py's
probabilistic scores against an independent scorer (the Bureau of Meteorology's `scores`, fair CRPS) and definitions
written out here (xskillscore, where installed, for CRPS and the rank histogram)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
import xarray as xr

import evaluate
from tests.conftest import run_script
from tests.test_predict import _kill_after, predict_main, run_predict, store_bytes
from tests.test_train import expect_error_in_process
from utils.config import EnsembleConfig
from utils.predict.ensemble import Ensemble, SphereSmoother
from utils.predict.ensemble_scores import ranks
from utils.predict.scores import latitude_weights

MEMBERS, TIMES, STEPS = 8, "0:3", 2
ROWS = 16  # vit_data's 17 stored rows, the last dropped


def ensemble_args(checkpoint, out, *extra: str) -> list[str]:
    return ["--checkpoint", str(checkpoint), "--out", str(out), "--members", str(MEMBERS), "--times", TIMES,
            "--steps", str(STEPS), "--perturbation", "spherical", "--correlation_km", "2000", "--picture", "none",
            *extra]


@pytest.fixture(scope="module")
def ensemble_store(vit_reference, tmp_path_factory):
    """8 members of the tiny ViT from 3 initial times, 2 steps each, spherical noise (stdout dropped)."""
    out = tmp_path_factory.mktemp("ensemble") / "ens.zarr"
    assert predict_main(*ensemble_args(vit_reference, out)) == 0
    return out


def test_store_layout_and_spread(ensemble_store):
    with xr.open_zarr(ensemble_store) as ds:
        assert ds["2m_temperature"].dims == ("realization", "time", "prediction_timedelta", "latitude", "longitude")
        assert list(ds.realization.values) == list(range(MEMBERS))
        assert "perturbation spherical" in ds.attrs["ensemble"] and "correlation_km 2000" in ds.attrs["ensemble"]
        t2m = ds["2m_temperature"].values
    assert np.isfinite(t2m).all() and (t2m.std(axis=0) > 0).all()  # every member its own


def test_two_ranks_and_a_killed_run_write_the_same_bits(vit_reference, ensemble_store, tmp_path, capsys):
    expected = store_bytes(ensemble_store)
    run_script("predict.py", *ensemble_args(vit_reference, tmp_path / "two.zarr"), "--progress", "never", ranks=2)
    assert store_bytes(tmp_path / "two.zarr") == expected
    out, progress = tmp_path / "resumed.zarr", tmp_path / ".resumed.zarr.progress"
    units = MEMBERS * 3  # one member's one time each
    assert _kill_after([*ensemble_args(vit_reference, out), "--progress", "never"], progress, 5) == -signal.SIGKILL
    written = len(list(progress.glob("unit_*")))
    assert 5 <= written < units and not out.exists()
    printed = run_predict(capsys, *ensemble_args(vit_reference, out))
    assert f"{written} written before" in printed  # units of one time each: the times already written
    assert store_bytes(out) == expected and not progress.exists()


def test_a_member_depends_on_the_seed_and_its_number_only(vit_reference, ensemble_store, tmp_path, capsys):
    """Members 0 and 1 of times 1 and 2, predicted alone (other members, other times, another order of work),
    are the bits of the 8-member run; another seed gives other members."""
    common = ["--checkpoint", str(vit_reference), "--members", "2", "--times", "1:3", "--steps", str(STEPS),
              "--perturbation", "spherical", "--correlation_km", "2000", "--picture", "none"]
    run_predict(capsys, *common, "--out", str(tmp_path / "two.zarr"))
    run_predict(capsys, *common, "--ensemble_seed", "1", "--out", str(tmp_path / "seed1.zarr"))
    with xr.open_zarr(ensemble_store) as big, xr.open_zarr(tmp_path / "two.zarr") as small, \
            xr.open_zarr(tmp_path / "seed1.zarr") as other:
        want = big["geopotential"].isel(realization=slice(0, 2), time=slice(1, 3)).values
        np.testing.assert_array_equal(small["geopotential"].values, want)
        assert not np.allclose(other["geopotential"].values, want, equal_nan=True)


def test_lagged_members_are_earlier_deterministic_forecasts(vit_reference, tmp_path, capsys):
    """Member k of initial time i is the deterministic forecast from time i - k, k steps further on."""
    run_predict(capsys, "--checkpoint", str(vit_reference), "--out", str(tmp_path / "det.zarr"), "--times", "0:5",
                "--steps", str(STEPS + 2), "--picture", "none")
    run_predict(capsys, "--checkpoint", str(vit_reference), "--out", str(tmp_path / "lag.zarr"), "--members", "3",
                "--perturbation", "lagged", "--times", "2:5", "--steps", str(STEPS), "--picture", "none")
    with xr.open_zarr(tmp_path / "det.zarr") as det, xr.open_zarr(tmp_path / "lag.zarr") as lag:
        forecasts, members = det["temperature"].values, lag["temperature"].values
        assert "perturbation lagged" in lag.attrs["ensemble"] and "seed" not in lag.attrs["ensemble"]
    for k in range(3):
        for i in range(2, 5):
            np.testing.assert_array_equal(members[k, i - 2], forecasts[i - k, k:k + STEPS])


def _ensemble(perturbation: str, channels: int = 2, **keys) -> tuple[Ensemble, list[float]]:
    std = [2.0, 50.0][:channels]
    cfg = SimpleNamespace(ensemble=EnsembleConfig(perturbation=perturbation, **keys),
                          model=SimpleNamespace(std=std, in_chans=channels))  # what Ensemble reads of a config

    class Fields:  # the one thing Ensemble reads of the inputs: a field's shape
        def read(self, index):
            return torch.zeros(channels, 91, 180)
    return Ensemble(cfg, 4, 90.0 - 2.0 * np.arange(91), Fields()), std


def test_gaussian_noise_is_scaled_per_channel_and_reproducible():
    ensemble, std = _ensemble("gaussian", noise_scale=0.1)
    noise = ensemble.noise([0, 1, 2], 3, (2, 91, 180)).double()
    for c, s in enumerate(std):
        assert noise[:, c].std().item() == pytest.approx(0.1 * s, rel=0.02)
    assert torch.equal(ensemble.noise([2], 3, (2, 91, 180)).double(), noise[2:])  # item 2 alone: the same noise
    assert not torch.equal(ensemble.noise([2], 4, (2, 91, 180)).double(), noise[2:])  # another member: other noise


def test_spherical_noise_has_unit_variance_and_a_gaussian_correlation_in_distance():
    """The variance is 1 everywhere, poles included (exactly: the smoother is linear, so a cell's variance is the
    sum of squares of its weights, found by smoothing every unit impulse of a 10-degree grid); on a 2-degree grid,
    L = 1000 km, the correlation of points d apart along the equator and along a meridian is exp(-d^2 / 2L^2),
    estimated from 400 fields."""
    coarse = SphereSmoother(90.0 - 10.0 * np.arange(19), 36, 3000.0)
    weights = coarse(np.eye(19 * 36).reshape(-1, 19, 36)).reshape(19 * 36, -1)
    np.testing.assert_allclose((weights ** 2).sum(axis=0), 1.0, rtol=1e-12)
    latitude = 90.0 - 2.0 * np.arange(91)
    smoother = SphereSmoother(latitude, 180, 1000.0)
    fields = smoother(np.random.default_rng(0).standard_normal((400, 91, 180)))
    cell_km = 6371.0 * np.deg2rad(2.0)
    equator = 45
    for shift in (2, 4, 6):  # ~445, 890, 1334 km
        expected = np.exp(-0.5 * (shift * cell_km / 1000.0) ** 2)
        along = (fields[:, equator] * np.roll(fields[:, equator], shift, axis=-1)).mean()
        across = (fields[:, equator] * fields[:, equator + shift]).mean()
        assert along == pytest.approx(expected, abs=0.05) and across == pytest.approx(expected, abs=0.05)


def test_bred_vectors_grow_along_the_step_and_keep_the_noise_size():
    """With a linear step x -> g x, the bred vector after n cycles is g^n times the first noise, rescaled per item
    and channel to the noise's RMS (written out here)."""
    ensemble, _ = _ensemble("bred", bred_cycles=3, noise_scale=0.1)
    gain = torch.linspace(0.5, 2.0, 180).expand(2, 91, 180)
    x = torch.randn(2, 2, 91, 180)
    delta = ensemble.perturb(x, [5, 6], 1, lambda state: state * gain) - x
    first = ensemble.noise([5, 6], 1, (2, 91, 180))
    grown = first * gain ** 3
    rms = lambda v: v.pow(2).mean(dim=(-2, -1), keepdim=True).sqrt()  # noqa: E731
    torch.testing.assert_close(delta, grown * rms(first) / rms(grown), rtol=1e-4, atol=1e-5)


def test_rank_ties_are_broken_at_random_reproducibly():
    members = np.zeros((4, 1000))
    truth = np.zeros(1000)  # every member ties with the truth: every rank equally likely
    drawn = ranks(members, truth, np.random.default_rng(7))
    assert np.array_equal(drawn, ranks(members, truth, np.random.default_rng(7)))
    assert np.bincount(drawn, minlength=5).min() > 150  # 200 expected each
    members[:2] = -1.0  # two below, two tied: ranks 2, 3 or 4
    assert set(ranks(members, truth, np.random.default_rng(7)).tolist()) == {2, 3, 4}


# ----------------------------------------------------------------------------------------- the scores


def _truth(vit_data, channel: str, leads: int) -> np.ndarray:
    """(time, lead, lat, lon) of one channel at times 0..2 plus each lead, from the data file itself."""
    with h5py.File(vit_data / "valid" / "2015.h5") as f:
        at = list(f["fields"].attrs["channels"]).index(channel)
        fields = f["fields"][:, at, :ROWS].astype(np.float64)
    return np.stack([fields[[i + k for k in range(1, leads + 1)]] for i in range(3)])


def test_probabilistic_scores_equal_independent_implementations(ensemble_store, vit_reference, vit_data, tmp_path,
                                                                capsys):
    from scores.probability import crps_for_ensemble

    out, alone = tmp_path / "scores.nc", tmp_path / "deterministic.zarr"
    run_predict(capsys, "--checkpoint", str(vit_reference), "--out", str(alone), "--times", TIMES, "--steps",
                str(STEPS), "--picture", "none")
    assert evaluate.main(["--forecast", str(ensemble_store), "--deterministic", str(alone), "--truth", str(vit_data),
                          "--out", str(out), "--png", str(tmp_path / "card.png")]) == 0
    assert "CRPS ensemble" in capsys.readouterr().out
    assert (tmp_path / "card.ensemble.png").read_bytes()[:4] == b"\x89PNG"
    with xr.open_zarr(ensemble_store) as ds:
        members = ds["2m_temperature"].values.astype(np.float64)  # (member, time, lead, lat, lon)
        latitude = ds.latitude.values
    truth = _truth(vit_data, "t2m", STEPS)
    with xr.open_dataset(out) as scores, xr.open_dataset(out, group="rank_histogram") as hist:
        one = scores["2m_temperature"].sel(forecast="deterministic")  # a one-member ensemble: CRPS = MAE
        np.testing.assert_array_equal(one.sel(metric="crps").values, one.sel(metric="mae").values)
        assert (one.sel(metric="spread_skill_ratio").values == 0).all()
        got = scores["2m_temperature"].sel(forecast="model")
        histogram = hist["2m_temperature"].values
        assert {"crps", "spread_skill_ratio", "ensemble_mean_rmse", "debiased_ensemble_mean_rmse"} <= set(
            scores.metric.values)
        got = {m: got.sel(metric=m).values for m in scores.metric.values}
    weights = xr.DataArray(latitude_weights(latitude), dims="latitude")
    dims = ("realization", "time", "latitude", "longitude")
    w = latitude_weights(latitude)[:, None] * np.ones(members.shape[-1])
    for lead in range(STEPS):
        fcst = xr.DataArray(members[:, :, lead], dims=dims)
        obs = xr.DataArray(truth[:, lead], dims=dims[1:])
        crps = crps_for_ensemble(fcst, obs, "realization", method="fair", weights=weights, preserve_dims=["time"])
        np.testing.assert_allclose(got["crps"][lead], crps.mean().item(), rtol=1e-6)
        # WeatherBench 2's ensemble-mean RMSE, its debiased form and the spread, written out.
        mean, variance = members[:, :, lead].mean(axis=0), members[:, :, lead].var(axis=0, ddof=1)
        area = lambda v: (v * w).sum(axis=(-2, -1)) / w.sum()  # noqa: E731
        mse, var = area((mean - truth[:, lead]) ** 2).mean(), area(variance).mean()
        np.testing.assert_allclose(got["ensemble_mean_rmse"][lead], np.sqrt(mse), rtol=1e-6)
        np.testing.assert_allclose(got["rmse"][lead], np.sqrt(mse), rtol=1e-6)  # the deterministic: the mean's
        np.testing.assert_allclose(got["spread_skill_ratio"][lead], np.sqrt(var / mse), rtol=1e-6)
        debiased = mse - var / MEMBERS
        np.testing.assert_allclose(got["debiased_ensemble_mean_rmse"][lead],
                                   np.sqrt(debiased) if debiased >= 0 else np.nan, rtol=1e-6)
        # The rank histogram by its definition: members below the truth, counted by area (floats: no ties).
        counts = np.zeros((3, MEMBERS + 1))
        for t in range(3):
            for i in range(ROWS):
                for j in range(members.shape[-1]):
                    below = sum(members[m, t, lead, i, j] < truth[t, lead, i, j] for m in range(MEMBERS))
                    counts[t, below] += w[i, j]
        np.testing.assert_allclose(histogram[lead], (counts / w.sum()).mean(axis=0), rtol=1e-6, atol=1e-12)
        try:
            import xskillscore
        except ImportError:
            continue
        # xskillscore's CRPS is the empirical distribution's (pairs over M^2, not M(M-1)): the same skill, the spread
        # times (M-1)/M.
        ecdf = got["crps_skill"][lead] - got["crps_spread"][lead] * (MEMBERS - 1) / MEMBERS
        per_time = xskillscore.crps_ensemble(obs, fcst, member_dim="realization", dim=["latitude", "longitude"],
                                             weights=weights.broadcast_like(obs.isel(time=0)))
        np.testing.assert_allclose(ecdf, per_time.mean().item(), rtol=1e-6)
        # Its rank histogram counts cells, unweighted, ranks 1..M+1: the same ranks of every cell (no ties here).
        theirs = xskillscore.rank_histogram(obs, fcst, dim=["time", "latitude", "longitude"], member_dim="realization")
        ours = ranks(members[:, :, lead], truth[:, lead], np.random.default_rng(0))
        np.testing.assert_array_equal(theirs.values, np.bincount(ours.ravel(), minlength=MEMBERS + 1))


@pytest.mark.parametrize("case, match", [
    ("one member", "--members must be >= 2"),
    ("not a forecaster", "--members and the ensemble keys are for forecasts"),
    ("keys without members", "--perturbation perturbs an ensemble's members: give --members M"),
    ("lagged before the data", "no state 2 step(s) before item 1"),
    ("unknown perturbation", "perturbation: 'other' is not one of"),
])
def test_bad_input_is_one_line_and_leaves_nothing(case, match, vit_reference, reference_run, tmp_path, capsys):
    out = tmp_path / "out.zarr"
    args = {"one member": ["--checkpoint", str(vit_reference), "--members", "1"],
            "not a forecaster": ["--checkpoint", str(reference_run), "--members", "4"],
            "keys without members": ["--checkpoint", str(vit_reference), "--perturbation", "bred"],
            "lagged before the data": ["--checkpoint", str(vit_reference), "--members", "3", "--perturbation",
                                       "lagged", "--times", "1:3"],
            "unknown perturbation": ["--checkpoint", str(vit_reference), "--members", "3", "--perturbation",
                                     "other"]}[case]
    expect_error_in_process(capsys, *args, "--out", str(out), script="predict.py", match=match)
    assert not out.exists() and not list(tmp_path.glob(".out.zarr*"))


def test_a_deterministic_forecast_of_other_times_is_refused_in_one_line(ensemble_store, vit_reference, vit_data,
                                                                        tmp_path, capsys):
    other = tmp_path / "other.zarr"
    run_predict(capsys, "--checkpoint", str(vit_reference), "--out", str(other), "--times", "0:2", "--steps",
                str(STEPS), "--picture", "none")
    out = tmp_path / "scores.nc"
    expect_error_in_process(capsys, "--forecast", str(ensemble_store), "--deterministic", str(other), "--truth",
                            str(vit_data), "--out", str(out), script="evaluate.py",
                            match="--deterministic differs from the forecast in its time")
    assert not out.exists()
