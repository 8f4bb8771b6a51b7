"""Part II's forecasting pieces, in-process: metrics against hand computations, baselines, losses,
the cosine schedule, validation independent of the rank count, and every bad input."""

from __future__ import annotations

import math
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from tests.test_train import expect_error_in_process
from utils.config import ConfigError, build_config
from utils.data.common import DataError, ResumableDistributedSampler, build_dataloader
from utils.data.era5 import ERA5Dataset, resolve_from_data
from utils.observe.scores import ACCAccumulator, RMSEAccumulator, latitude_weights
from utils.tasks import Forecast, build_task
from utils.training import build_loss, build_optimizer, relative_l2

C, H_STORED, W = 3, 9, 16  # 8 x 16 fields after the loader drops the last row
NAMES = ["u10", "t2m", "z500"]


def write_nersc_layout(root: Path, samples: int = 6, channels: int = C, stats: bool = True) -> Path:
    """A tiny data set in NERSC's layout: train/ and valid/ with one file each, stats/ with the three arrays."""
    generator = np.random.default_rng(0)
    offsets = np.array([0.0, 280.0, 5.5e4][:channels] + [0.0] * max(0, channels - 3), dtype=np.float32)
    for split, year in (("train", 2000), ("valid", 2001)):
        fields = generator.standard_normal((samples, channels, H_STORED, W)).astype(np.float32)
        fields += offsets.reshape(1, -1, 1, 1)
        (root / split).mkdir(parents=True, exist_ok=True)
        with h5py.File(root / split / f"{year}.h5", "w") as f:
            f.create_dataset("fields", data=fields).attrs["channels"] = NAMES[:channels] + [
                f"x{i}" for i in range(channels - 3)]
        if split == "train" and stats:
            (root / "stats").mkdir(exist_ok=True)
            np.save(root / "stats" / "global_means.npy", fields.mean(axis=(0, 2, 3), keepdims=True))
            np.save(root / "stats" / "global_stds.npy", fields.std(axis=(0, 2, 3), keepdims=True))
            np.save(root / "stats" / "time_means.npy", fields.mean(axis=0, keepdims=True))
    return root


def vit_config(root: Path, **overrides):
    values = {"data_dir": str(root), "channel_names": [], "key_channels": [], "in_chans": C, "img_size": [8, 16],
              "model_args": {"patch_size": 4, "embed_dim": 8, "depths": [1], "num_heads": [2]}, "batch_size": 2,
              "val_samples": 0}
    values.update(overrides)
    return build_config("vit_quickstart", values)


# ----------------------------------------------------------------------------------------------
# Metrics against hand computations
# ----------------------------------------------------------------------------------------------


def test_latitude_weights_by_hand():
    # 5 rows from 90N to 90S: latitudes 90, 45, 0, -45, -90; cos = 0, 0.707, 1, 0.707, 0.
    cosines = np.array([0.0, math.sqrt(0.5), 1.0, math.sqrt(0.5), 0.0])
    np.testing.assert_allclose(latitude_weights(5).numpy(), cosines / cosines.mean(), atol=1e-12)
    # The loader drops the last row: weights of the first 4 rows of the same grid, mean 1 over them.
    np.testing.assert_allclose(latitude_weights(5, 4).numpy(), cosines[:4] / cosines[:4].mean(), atol=1e-12)
    with pytest.raises(ValueError):
        latitude_weights(5, 6)


def test_weighted_rmse_by_hand_and_independent_of_batching():
    pred = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]])  # (1, 1, 3, 2)
    target = torch.zeros_like(pred)
    weights = torch.tensor([0.5, 2.0, 0.5])
    accumulator = RMSEAccumulator(1, row_weights=weights)
    accumulator.update(pred, target)
    by_hand = math.sqrt((0.5 * (1 + 4) + 2.0 * (9 + 16) + 0.5 * (25 + 36)) / (2 * (0.5 + 2.0 + 0.5)))
    assert accumulator.compute() == pytest.approx([by_hand], rel=1e-12)

    generator = torch.Generator().manual_seed(0)
    pred, target = torch.randn(6, 2, 4, 5, generator=generator), torch.randn(6, 2, 4, 5, generator=generator)
    weights = latitude_weights(5, 4).float()
    whole, parts = RMSEAccumulator(2, row_weights=weights), RMSEAccumulator(2, row_weights=weights)
    whole.update(pred, target)
    for a, b in ((0, 1), (1, 4), (4, 6)):
        parts.update(pred[a:b], target[a:b])
    assert parts.compute() == pytest.approx(whole.compute(), rel=1e-12)
    w = weights.double().view(1, 1, -1, 1)
    direct = ((pred.double() - target.double()).square() * w).sum(dim=(0, 2, 3)) / (w.sum() * 6 * 5)
    assert whole.compute() == pytest.approx(direct.sqrt().tolist(), rel=1e-12)


def test_acc_by_hand():
    climatology = torch.tensor([[[1.0, 1.0], [2.0, 2.0]]])  # (C=1, H=2, W=2)
    weights = torch.tensor([1.0, 3.0])
    target = torch.tensor([[[[2.0, 0.0], [3.0, 4.0]]]])  # anomalies a = [1, -1; 1, 2]
    pred = torch.tensor([[[[1.5, 1.0], [2.0, 4.0]]]])  # anomalies f = [0.5, 0; 0, 2]
    accumulator = ACCAccumulator(climatology, weights)
    accumulator.update(pred, target)
    fa = 1 * (0.5 * 1 + 0 * -1) + 3 * (0 * 1 + 2 * 2)
    ff = 1 * (0.25 + 0) + 3 * (0 + 4)
    aa = 1 * (1 + 1) + 3 * (1 + 4)
    assert accumulator.compute() == pytest.approx([fa / math.sqrt(ff * aa)], rel=1e-12)

    # Averaged over samples (not pooled): a perfect sample (1) and a sign-flipped one (-1) give 0.
    both = ACCAccumulator(climatology, weights)
    both.update(torch.cat([target, 2 * climatology - target]), torch.cat([target, target]))
    assert both.compute() == pytest.approx([0.0], abs=1e-12)
    # The climatology itself has no anomaly: ACC 0 by definition, not NaN.
    flat = ACCAccumulator(climatology, weights)
    flat.update(climatology.unsqueeze(0), target)
    assert flat.compute() == [0.0]


class Persistence(nn.Module):
    """A "model" that forecasts no change."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return x + 0 * self.unused


def forecast_task(root: Path) -> Forecast:
    cfg = vit_config(root)
    resolve_from_data(cfg)
    return build_task(cfg)


def test_forecast_baselines_and_metric_record(tmp_path):
    root = write_nersc_layout(tmp_path / "data")
    task = forecast_task(root)
    assert task.channel_names == NAMES
    valid = ERA5Dataset(root / "valid", task="forecast", crop_size=0)
    loader = build_dataloader(valid, 2, shuffle=False)
    result = task.evaluate(Persistence(), loader, torch.device("cpu"), "none")
    metrics = result.metrics
    assert set(metrics) == {"rmse", "acc", "persistence_rmse", "persistence_acc", "climatology_rmse", "climatology_acc"}
    assert metrics["rmse"] == metrics["persistence_rmse"] and metrics["acc"] == metrics["persistence_acc"]
    assert metrics["climatology_acc"] == [0.0] * C
    # Climatology RMSE by hand: latitude-weighted over the 5 validation pairs' targets (samples 1..5).
    with h5py.File(root / "valid" / "2001.h5") as f:
        truth = f["fields"][1:, :, :8].astype(np.float64)
    climatology = np.load(root / "stats" / "time_means.npy")[0, :, :8].astype(np.float64)
    w = latitude_weights(H_STORED, 8).numpy().reshape(1, 1, -1, 1)
    by_hand = np.sqrt((w * (truth - climatology) ** 2).sum(axis=(0, 2, 3)) / (w.sum() * 5 * W))
    np.testing.assert_allclose(metrics["climatology_rmse"], by_hand, rtol=1e-6)
    inputs, truth_t, forecast = result.sample
    assert inputs.shape == truth_t.shape == forecast.shape == (C, 8, W)
    task.save_picture(tmp_path / "sample.png", result)
    assert (tmp_path / "sample.png").read_bytes()[:4] == b"\x89PNG"


def test_validation_leaves_out_the_samplers_repeats(tmp_path):
    # 5 validation pairs over 2 ranks: DistributedSampler repeats one to give both ranks 3. The two
    # ranks' metrics, summed as all_reduce would, must equal one process's over the 5 pairs.
    root = write_nersc_layout(tmp_path / "data")
    task = forecast_task(root)
    valid = ERA5Dataset(root / "valid", task="forecast", crop_size=0)
    device = torch.device("cpu")
    single = task.evaluate(Persistence(), build_dataloader(valid, 2, shuffle=False), device, "none")
    accumulators = task.new_accumulators(C, device)
    for rank in (0, 1):
        loader = build_dataloader(valid, 2, shuffle=False, rank=rank, world_size=2)
        assert len(loader.sampler) == 3
        seen = 0
        for inputs, target in loader:
            real = loader.sampler.padding_mask(seen, len(inputs))
            seen += len(inputs)
            task.update(accumulators, inputs[real], inputs[real], target[real])
    assert ResumableDistributedSampler(valid, 2, 1).padding_mask(0, 3).tolist() == [True, True, False]
    for key, accumulator in accumulators.items():
        assert accumulator.compute() == pytest.approx(single.metrics[key], rel=1e-12), key


# ----------------------------------------------------------------------------------------------
# Loss and schedule
# ----------------------------------------------------------------------------------------------


def test_relative_l2_and_normalized_space():
    target = torch.randn(3, 2, 4, 4) + 5.0
    assert relative_l2(1.1 * target, target).item() == pytest.approx(0.1, rel=1e-5)
    cfg = build_config("vit_quickstart", {"in_chans": 2, "mean": [5.0, 100.0], "std": [1.0, 10.0],
                                          "channel_names": ["a", "b"], "key_channels": [], "loss": "mse"})
    pred = target + torch.tensor([1.0, 10.0]).view(1, 2, 1, 1)  # one std off in both channels
    assert build_loss(cfg)(pred, target).item() == pytest.approx(1.0, rel=1e-5)
    cfg.train.loss_space = "physical"
    assert build_loss(cfg)(pred, target).item() == pytest.approx((1 + 100) / 2, rel=1e-5)


def test_cosine_schedule_with_warmup():
    cfg = build_config("vit_quickstart", {"max_steps": 20, "warmup_steps": 4, "lr": 1.0, "mean": [0.0] * 20,
                                          "std": [1.0] * 20})
    model = nn.Linear(2, 2)
    optimizer, scheduler = build_optimizer(model, cfg, steps_per_epoch=7, device=torch.device("cpu"))
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["weight_decay"] == 0.0
    lrs = []
    for _ in range(20):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4 + 8] == pytest.approx(0.5)  # half-way through the 16 decay steps
    assert lrs[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 15 / 16)))
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:])), "cosine must not rise after warm-up"


# ----------------------------------------------------------------------------------------------
# Bad input: one line, what is wrong and what to do
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, error, match", [
    ({"task": "sr"}, ConfigError, "use task forecast"),
    ({"img_size": [10, 16]}, ConfigError, "not divisible by patch_size 4"),
    ({"crop_size": 8}, ConfigError, "whole fields"),
    ({"model_args.depths": [1, 1], "model_args.num_heads": [2, 2]}, ConfigError, "one stage"),
    ({"mean": [0.0, 1.0]}, ConfigError, "mean and std need 3 values"),
    ({"betas": [0.9]}, ConfigError, "betas"),
    ({"ac": "layer"}, ConfigError, "SwinIR's RSTB"),
])
def test_bad_vit_config(tmp_path, overrides, error, match):
    with pytest.raises(error, match=match):
        vit_config(tmp_path, **overrides)


@pytest.mark.parametrize("overrides, make, match", [
    ({"in_chans": 2, "mean": [], "std": []}, None, "has 3 channels but the config's in_chans is 2"),
    ({"img_size": [4, 8]}, None, "takes 4x8 inputs (img_size) but the data"),
    ({"key_channels": ["v10"]}, None, "not channels of the data"),
    ({"channel_names": ["a", "b", "c"], "key_channels": []}, None, None),
    ({}, lambda root: (root / "stats" / "global_stds.npy").unlink(), "compute_stats.py --data_dir"),
    ({}, lambda root: np.save(root / "stats" / "global_means.npy", np.zeros(5)), "5 values for 3 channels"),
])
def test_data_and_config_disagree(tmp_path, overrides, make, match):
    root = write_nersc_layout(tmp_path / "data")
    if make:
        make(root)
    cfg = vit_config(root, **overrides)
    if match is None:  # the config's names win over the file's
        resolve_from_data(cfg)
        assert cfg.data.channel_names == ["a", "b", "c"]
        return
    with pytest.raises((ConfigError, DataError)) as excinfo:
        resolve_from_data(cfg)
    assert match in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_statistics_and_names_come_from_the_data(tmp_path):
    root = write_nersc_layout(tmp_path / "data")
    cfg = vit_config(root)
    assert cfg.model.mean == [] and cfg.data.channel_names == []
    resolve_from_data(cfg)
    assert cfg.data.channel_names == NAMES
    np.testing.assert_allclose(cfg.model.mean, np.load(root / "stats" / "global_means.npy").reshape(-1), rtol=1e-6)
    np.testing.assert_allclose(cfg.model.std, np.load(root / "stats" / "global_stds.npy").reshape(-1), rtol=1e-6)


def test_lead_and_missing_climatology(tmp_path, capsys):
    root = write_nersc_layout(tmp_path / "data", samples=4)
    assert len(ERA5Dataset(root / "train", task="forecast", crop_size=0, lead=3)) == 1
    with pytest.raises(DataError, match="lead 4 needs more than 4 samples in a file, the longest holds 4"):
        ERA5Dataset(root / "train", task="forecast", crop_size=0, lead=4)
    (root / "stats" / "time_means.npy").unlink()
    run = tmp_path / "run"
    args = ["--config", "vit_quickstart", "--data_dir", str(root), "--run_dir", str(run), "--channel_names", "[]",
            "--key_channels", "[]", "--in_chans", "3", "--img_size", "[8, 16]", "--model_args.patch_size", "4",
            "--model_args", "{embed_dim: 8, depths: [1], num_heads: [2]}", "--batch_size", "2"]
    expect_error_in_process(capsys, *args, match="time_means.npy: no such file")
    expect_error_in_process(capsys, *args, "--lead", "5", match="lead 5 needs more than 5 samples")
    assert not run.exists()


@pytest.mark.parametrize("config, overrides", [
    ("baseline", {"crop_size": 32, "n_patches": 1, "batch_size": 2, "num_workers": 0}),  # valid_1, 3 channels
    ("vit_quickstart", {"batch_size": 2}),                                              # 20 channels, 6-hourly
])
def test_missing_data_hint_generates_what_the_config_reads(tmp_path, config, overrides):
    import shlex
    import subprocess
    import sys

    from tests.conftest import REPO
    from utils.data import build_loaders

    cfg = build_config(config, {"data_dir": str(tmp_path / "data"), **overrides})
    with pytest.raises(DataError) as excinfo:
        build_loaders(cfg)
    command = str(excinfo.value).split("`")[1]
    assert command.startswith("python datasets/make_synthetic_era5.py --out ")
    argv = shlex.split(command)[1:]
    argv[argv.index("--samples-per-year") + 1] = "4"  # the hint's size, fewer samples
    subprocess.run([sys.executable, *argv, "--quiet"], cwd=REPO, check=True, capture_output=True, timeout=300)
    train, valid = build_loaders(cfg)
    inputs, target = next(iter(train))
    assert inputs.shape[1] == target.shape[1] == cfg.model.in_chans


def test_a_named_config_takes_the_channels_and_grid_of_other_data(tmp_path, capsys):
    """vit_quickstart (20 channels, its own grid) pointed at 3-channel data of another grid: the data's channel
    count, names, statistics and grid replace the config's, said in one line; what the command line states stays."""
    root = write_nersc_layout(tmp_path / "data")
    cfg = build_config("vit_quickstart", {"data_dir": str(root), "model_args.patch_size": 4})
    assert cfg.model.in_chans == 20 and cfg.model.img_size != [H_STORED - 1, W]
    resolve_from_data(cfg)
    assert cfg.model.in_chans == C and cfg.data.channel_names == NAMES[:C]
    assert cfg.data.key_channels and set(cfg.data.key_channels) <= set(NAMES[:C])
    means = np.load(root / "stats" / "global_means.npy").ravel()
    assert cfg.model.mean == pytest.approx(means.tolist()) and cfg.model.img_size == [H_STORED - 1, W]
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "in_chans 3 (the config's 20)" in said and "img_size" in said
    stated = build_config("vit_quickstart", {"data_dir": str(root), "model_args.patch_size": 4,
                                             "key_channels": ["z500"]})
    resolve_from_data(stated)
    assert stated.model.in_chans == C and stated.data.key_channels == ["z500"]
