"""Task diagnostic (Part IV): named input channels -> named target channels of the same time, through train.py,
train_ddp.py, predict.py and evaluate.py, with its linear-regression baseline."""

import textwrap

import h5py
import numpy as np
import pytest
import torch

import evaluate
import predict
from tests.conftest import VIT_MODEL, assert_layout_equal, check_layouts, final_weights, read_metrics, run_script
from utils.checkpoint.reading import read_checkpoint
from utils.config import ConfigError, build_config
from utils.data.era5 import channel_sets
from utils.data.files import scan_split
from utils.memory.estimate import estimate_memory
from utils.memory.measure import measure_config
from utils.predict.model import config_from_checkpoint, load_model
from utils.predict.store import xarray
from utils.tasks import LinearBaseline
from utils.training import build_loss

INPUTS = "[t2m, t850, r850, r500, msl]"


def diagnostic_args(data_dir, run_dir, *extra: str) -> list[str]:
    return ["--config", "vit_tcwv_quickstart", "--data_dir", str(data_dir), "--run_dir", str(run_dir),
            "--input_channels", INPUTS, "--batch_size", "4", "--val_samples", "5", "--num_workers", "0",
            "--progress", "never", "--max_steps", "4", "--val_every", "4", "--log_every", "2", *VIT_MODEL, *extra]


@pytest.fixture(scope="module")
def diagnostic_runs(vit_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("diagnostic")
    run_script("train.py", *diagnostic_args(vit_data, root / "single"), in_process=True)
    run_script("train_ddp.py", *diagnostic_args(vit_data, root / "ddp"), ranks=2)
    return root


def test_a_diagnostic_model_trains_on_named_channels_and_two_ranks_equal_one(diagnostic_runs, vit_data):
    single, ddp = diagnostic_runs / "single", diagnostic_runs / "ddp"
    val = [r for r in read_metrics(single) if r["kind"] == "val"][-1]
    assert set(val) >= {"rmse", "linear_rmse", "climatology_rmse"} and len(val["rmse"]) == 1  # tcwv alone
    assert all(0 < val[key][0] < 100 for key in ("rmse", "linear_rmse", "climatology_rmse"))  # kg m-2
    cfg = recorded_config(single / "checkpoints" / "step_00000004.pt")[0]
    assert (cfg.model.in_chans, cfg.model.out_chans, cfg.data.channel_names) == (5, 1, ["tcwv"])
    mean = np.load(vit_data / "stats" / "global_means.npy").reshape(-1)  # NERSC's order: t2m 2, msl 4, ... tcwv 19
    assert cfg.model.mean == pytest.approx(mean[[2, 5, 18, 17, 4]].tolist())
    assert cfg.model.out_mean == pytest.approx([mean[19]])
    theirs = [r for r in read_metrics(ddp) if r["kind"] == "val"][-1]
    for key in ("rmse", "linear_rmse", "climatology_rmse"):
        assert theirs[key] == pytest.approx(val[key], rel=1e-5), key
    ours, other = final_weights(single), final_weights(ddp)
    assert ours.keys() == other.keys()
    for name in ours:
        torch.testing.assert_close(other[name], ours[name], rtol=1e-5, atol=1e-6)


def test_predict_writes_the_targets_at_their_times_and_evaluate_scores_them_at_lead_0(diagnostic_runs, vit_data,
                                                                                        tmp_path, capsys):
    checkpoint = diagnostic_runs / "single" / "checkpoints" / "step_00000004.pt"
    out = tmp_path / "tcwv.zarr"
    assert predict.main(["--checkpoint", str(checkpoint), "--out", str(out), "--times", "0:3"]) == 0
    with xarray().open_zarr(out, chunks=None) as ds:
        assert list(ds.data_vars) == ["total_column_water_vapour"] and "prediction_timedelta" not in ds.dims
        written = ds["total_column_water_vapour"].values[0]
    # The model on the first validation sample's five input channels, read here from the file.
    cfg, saved = recorded_config(checkpoint)
    model = load_model(cfg, saved, torch.device("cpu"))
    files = scan_split(vit_data / "valid")
    with h5py.File(files[0].path) as f:
        field = torch.from_numpy(f["fields"][0][[2, 5, 18, 17, 4], :-1])  # the loader drops the last row
    with torch.no_grad():
        expected = model(field[None])[0, 0].numpy()
    np.testing.assert_allclose(written, expected, rtol=1e-5, atol=1e-4)
    scores_path = tmp_path / "scores.nc"
    assert evaluate.main(["--forecast", str(out), "--truth", str(vit_data), "--out", str(scores_path)]) == 0
    said = capsys.readouterr().out
    assert "fields without lead times: scored at their own times (lead 0), without persistence" in said
    with xarray().open_dataset(scores_path) as scores:
        assert list(scores["forecast"].values) == ["model", "climatology"]
        assert scores["lead_time"].values.tolist() == [0]
        assert np.isfinite(scores["total_column_water_vapour"].sel(forecast="model", metric="rmse").values).all()


def test_the_loss_and_the_memory_estimate_see_the_targets_channels():
    cfg = build_config("vit_tcwv_quickstart", {"img_size": [16, 32], "batch_size": 2, "device": "cpu", "loss": "mse",
                                               "model_args": {"patch_size": 4, "embed_dim": 16, "depths": [2],
                                                              "num_heads": [2]},
                                               "loss_space": "normalized", "mean": [0.0] * 19, "std": [1.0] * 19,
                                               "out_mean": [30.0], "out_std": [12.0]})
    target = 30.0 + 12.0 * torch.randn(2, 1, 16, 32, generator=torch.Generator().manual_seed(0))
    # One std of tcwv off everywhere is a normalised error of 1, whatever the inputs' statistics.
    assert float(build_loss(cfg)(target + 12.0, target)) == pytest.approx(1.0)
    # The activations the estimate counts for a 19 -> 1 model are what autograd saves, to the byte (the loss on
    # the inputs' statistics, broadcast to 19 channels, saved 73,800 bytes more).
    assert estimate_memory(cfg, device_type="cpu").activations == measure_config(cfg, None, "cpu").activations


def recorded_config(checkpoint):
    saved = read_checkpoint(checkpoint)
    return config_from_checkpoint(saved, {}, ("diagnostic",), "a diagnostic checkpoint"), saved


def test_the_linear_baseline_recovers_a_linear_relation():
    g = torch.Generator().manual_seed(0)
    a, b = torch.tensor([[2.0, -1.0, 0.5]]), 3.0
    samples = []
    for _ in range(6):
        x = torch.randn(3, 8, 16, generator=g) * torch.tensor([1.0, 100.0, 0.01]).view(3, 1, 1)
        samples.append((x, torch.einsum("oi,ihw->ohw", a, x) + b))
    fit = LinearBaseline(samples, [0.0, 0.0, 0.0], [1.0, 100.0, 0.01], torch.ones(8))
    x, y = samples[0]
    torch.testing.assert_close(fit(x[None])[0], y, rtol=1e-5, atol=1e-4)


def test_a_task_declared_by_its_channels_on_the_command_line_trains_the_built_in_vit(vit_data, tmp_path):
    run = tmp_path / "run"  # vit_quickstart is a forecast of 20 channels: three keys make it a diagnostic
    said = run_script("train.py", "--config", "vit_quickstart", "--task", "diagnostic", "--input_channels", "[u10, v10]",
                      "--target_channels", "[t2m]", "--data_dir", str(vit_data), "--run_dir", str(run), "--batch_size",
                      "4", "--val_samples", "5", "--num_workers", "0", "--progress", "never", "--max_steps", "2",
                      "--val_every", "2", *VIT_MODEL, in_process=True).stdout
    assert "rmse: t2m " in said and "linear_rmse: t2m " in said
    cfg = recorded_config(run / "checkpoints" / "step_00000002.pt")[0]
    assert (cfg.model.in_chans, cfg.model.out_chans, cfg.data.channel_names, cfg.data.key_channels) == \
        (2, 1, ["t2m"], ["t2m"])


def test_a_bases_channel_keys_give_way_and_those_said_with_the_channels_must_agree(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(f"""
        stats: {{base: vit_quickstart, mean: {[0.0] * 20}, std: {[1.0] * 20}}}  # of the base's 20 channels
        wind: {{base: stats, task: diagnostic, input_channels: [u10, v10], target_channels: [t2m]}}
        wind_said_after: {{base: wind, out_chans: 2}}
        wind_said_beside: {{base: vit_quickstart, task: diagnostic, input_channels: [u10, v10], target_channels: [t2m],
                            out_chans: 2}}
        """))
    cfg = build_config("wind", path=path)
    assert (cfg.model.in_chans, cfg.model.out_chans, cfg.data.channel_names, cfg.data.key_channels) == \
        (2, 1, ["t2m"], ["t2m"])  # vit_quickstart's key_channels [u10, t2m, z500]: the one among the targets
    assert cfg.model.mean == cfg.model.std == []  # the data's, when it is read
    for name in ("wind_said_after", "wind_said_beside"):
        with pytest.raises(ConfigError, match=r"^out_chans 2 disagrees with target_channels \[t2m\] \(1 channel\)"):
            build_config(name, path=path)


@pytest.mark.parametrize("overrides, said", [
    ({"task": "diagnostic", "input_channels": ["t2m"], "target_channels": []}, "name both"),
    ({"input_channels": ["t2m"]}, "input_channels and target_channels are for task diagnostic"),
    ({"task": "diagnostic", "input_channels": ["t2m", "t2m"], "target_channels": ["tcwv"]}, "names a channel twice"),
    ({"task": "diagnostic", "input_channels": ["t2m"], "target_channels": ["tcwv"], "in_chans": 3},
     r"in_chans 3 disagrees with input_channels \[t2m\] \(1 channel\)"),
    ({"task": "diagnostic", "input_channels": ["t2m"], "target_channels": ["tcwv"], "channel_names": ["a", "b"]},
     r"channel_names \[a, b\] disagrees with target_channels \[tcwv\]"),
    ({"task": "diagnostic", "input_channels": ["t2m"], "target_channels": ["tcwv"], "key_channels": ["t2m"]},
     r"key_channels \[t2m\] are not among target_channels \[tcwv\]"),
])
def test_channel_sets_that_cannot_work_are_refused_in_one_line(overrides, said):
    base = "vit_tcwv_quickstart" if overrides.get("task") else "vit_quickstart"
    with pytest.raises(ConfigError, match=said):
        build_config(base, overrides)


def test_a_channel_the_data_lacks_is_refused_with_the_datas_channels(vit_data):
    cfg = build_config("vit_tcwv_quickstart", {"data_dir": str(vit_data), "target_channels": ["precip"]})
    with pytest.raises(ConfigError, match=r"\['precip'\] are not channels of .*its channels: \[u10, v10|'u10', 'v10'"):
        channel_sets(cfg, scan_split(vit_data / "train")[0])


def test_the_diagnostic_vit_passes_the_layout_check():
    # Tensor parallelism splits the head (19 inputs' tokens -> 1 channel) by its rows, context parallelism gathers
    # the head's output: the two layouts that touch what task diagnostic changes, on 2 processes.
    code, rows = check_layouts("--config", "vit_tcwv_quickstart", *VIT_MODEL, "--only", "tp,cp", "--steps", "2",
                               ranks=2)
    assert code == 0 and [r["layout"] for r in rows if r.get("passed") is not None] == ["tp2", "cp2"], rows
    for row in rows:
        if row.get("passed") is not None:
            assert_layout_equal(row)
