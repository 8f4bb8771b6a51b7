"""rollout.py on a tiny ViT checkpoint: outputs, lead 1 against train.py's validation, hand-computed
baselines, a train_fsdp.py (DCP) checkpoint, the data's hours_per_step, and every bad input."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from unittest import mock

import h5py
import numpy as np
import pytest
import torch

import rollout
from models import build_model
from tests.conftest import as_dcp_checkpoint, read_metrics, run_script
from tests.test_forecast import H_STORED, NAMES, W, write_nersc_layout
from tests.test_train import check_error, expect_error_in_process
from utils.checkpoint.single import load_checkpoint
from utils.config import build_config
from utils.observe.scores import latitude_weights

SAMPLES = 6  # per file: 5 validation pairs at lead 1, 3 start times for 3 steps
ROWS = H_STORED - 1  # the loader drops the last latitude row
TINY_VIT = ["--config", "vit_quickstart", "--channel_names", "[]", "--key_channels", "[t2m, z500]", "--in_chans", "3",
            "--img_size", "[8, 16]", "--model_args", "{patch_size: 4, embed_dim: 8, depths: [1], num_heads: [2]}",
            "--batch_size", "2", "--max_steps", "2", "--val_samples", "0", "--progress", "never"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path]:
    """(data root, run folder) of a 2-step train.py run of a tiny ViT, trained in this process (no start-up)."""
    import train

    tmp = tmp_path_factory.mktemp("rollout")
    root, run = write_nersc_layout(tmp / "data", samples=SAMPLES), tmp / "run"
    with mock.patch.object(sys, "argv", ["train.py", *TINY_VIT, "--data_dir", str(root), "--run_dir", str(run)]):
        train.main()
    return root, run


def run_rollout(capsys, out: Path, *args: str) -> tuple[dict, str]:
    """rollout.py's main in this process: (rollout.json from ``out``, stdout)."""
    assert rollout.main([*args, "--device", "cpu"]) == 0
    return json.loads((out / "rollout.json").read_text()), capsys.readouterr().out


def valid_fields(root: Path) -> np.ndarray:
    with h5py.File(root / "valid" / "2001.h5") as f:
        return f["fields"][:, :, :ROWS].astype(np.float64)


def weighted_rmse(pred: np.ndarray, truth: np.ndarray) -> np.ndarray:
    w = latitude_weights(H_STORED, ROWS).numpy().reshape(1, 1, -1, 1)
    return np.sqrt((w * (pred - truth) ** 2).sum(axis=(0, 2, 3)) / (w.sum() * len(pred) * W))


def test_rollout_outputs_and_baselines_by_hand(trained, tmp_path, capsys):
    root, run = trained
    out = run / "rollout"  # the default
    result, stdout = run_rollout(capsys, out, "--checkpoint", str(run), "--steps", "3", "--samples", "16")
    assert result["checkpoint"] == str(run / "checkpoints" / "step_00000002.pt") and result["step"] == 2
    assert result["channel_names"] == NAMES and result["config"] == "vit_quickstart"
    assert result["lead_steps"] == [1, 2, 3] and result["lead_times"] == [6.0, 12.0, 18.0]
    assert result["lead_unit"] == "h" and result["time_step_assumed"] is True and "assumed 6 h" in result["note"]
    # 16 asked, 3 usable: the starts whose 3 steps stay in the 6-sample file.
    assert result["initial_conditions"] == result["usable_initial_conditions"] == 3
    assert result["start_times"] == [["2001.h5", 0], ["2001.h5", 1], ["2001.h5", 2]]
    assert set(result["metrics"]) == set(rollout.METRICS)
    assert all(np.shape(values) == (3, 3) for values in result["metrics"].values())
    assert result["metrics"]["climatology_acc"] == [[0.0] * 3] * 3

    fields = valid_fields(root)
    starts = np.arange(3)
    climatology = np.load(root / "stats" / "time_means.npy")[:, :, :ROWS].astype(np.float64)
    for k in (1, 2, 3):
        truth = fields[starts + k]
        np.testing.assert_allclose(result["metrics"]["persistence_rmse"][k - 1], weighted_rmse(fields[starts], truth),
                                   rtol=1e-6)
        np.testing.assert_allclose(result["metrics"]["climatology_rmse"][k - 1],
                                   weighted_rmse(np.broadcast_to(climatology, truth.shape), truth), rtol=1e-6)

    # The model's own 2-step forecast, fed back by hand.
    payload = load_checkpoint(run / "checkpoints" / "step_00000002.pt")
    flat = dict(payload["config"])
    model = build_model(build_config(flat.pop("config"), flat).model)
    model.load_state_dict(payload["model"])
    model.eval()
    with torch.no_grad():
        two_steps = model(model(torch.from_numpy(fields[starts]).float())).double().numpy()
    np.testing.assert_allclose(result["metrics"]["rmse"][1], weighted_rmse(two_steps, fields[starts + 2]), rtol=1e-5)

    assert (out / "rollout.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".tmp-*"))
    assert "3 of 3 usable start times" in stdout and "assumed 6 h" in stdout
    table = stdout.splitlines()
    assert table[1].startswith("t2m: RMSE")  # the first key channel
    assert table[3].split()[:2] == ["6", f"{result['metrics']['rmse'][0][1]:.4g}"]


def test_lead_one_equals_the_validation_record(trained, tmp_path, capsys):
    root, run = trained
    result, _ = run_rollout(capsys, tmp_path, "--checkpoint", str(run / "checkpoints" / "step_00000002.pt"),
                            "--steps", "1", "--samples", "0", "--out", str(tmp_path))
    assert result["initial_conditions"] == SAMPLES - 1  # the validation's pairs
    validation = [r for r in read_metrics(run) if r["kind"] == "val" and r["step"] == 2][-1]
    for key in rollout.METRICS:
        assert result["metrics"][key][0] == pytest.approx(validation[key], rel=1e-5, abs=1e-9), key


def test_hours_from_the_data_and_a_dcp_checkpoint(trained, tmp_path, capsys):
    root, run = trained
    data = Path(shutil.copytree(root, tmp_path / "data"))
    with h5py.File(data / "valid" / "2001.h5", "a") as f:
        f["fields"].attrs["hours_per_step"] = 3
    # train.py's weights saved as train_fsdp.py does.
    as_dcp_checkpoint(run / "checkpoints" / "step_00000002.pt", tmp_path / "fsdp" / "checkpoints")

    common = ("--steps", "2", "--data_dir", str(data))
    from_dcp, stdout = run_rollout(capsys, tmp_path / "fsdp" / "rollout", "--checkpoint", str(tmp_path / "fsdp"), *common)
    from_file, _ = run_rollout(capsys, tmp_path / "file", "--checkpoint", str(run), *common, "--out", str(tmp_path / "file"))
    assert from_dcp["checkpoint"] == str(tmp_path / "fsdp" / "checkpoints" / "step_00000002") and from_dcp["step"] == 2
    assert (tmp_path / "fsdp" / "rollout" / "rollout.png").is_file()
    assert from_dcp["lead_times"] == [3.0, 6.0] and from_dcp["time_step_assumed"] is False
    assert "note" not in from_dcp and "assumed" not in stdout
    assert from_dcp["metrics"] == from_file["metrics"]

    # Monthly data (datasets/convert.py records "1 month"): leads are months, never hours assumed.
    with h5py.File(data / "valid" / "2001.h5", "a") as f:
        f["fields"].attrs["time_step"] = "1 month"
    monthly, stdout = run_rollout(capsys, tmp_path / "monthly", "--checkpoint", str(run), *common, "--out",
                                  str(tmp_path / "monthly"))
    assert monthly["lead_times"] == [1.0, 2.0] and monthly["lead_unit"] == "month"
    assert monthly["time_step"] == "1 month" and "2 steps of 1 month" in stdout and "lead (month)" in stdout
    with h5py.File(data / "valid" / "2001.h5", "a") as f:
        f["fields"].attrs["time_step"] = "1 fortnight"
    expect_error_in_process(capsys, "--checkpoint", str(run), *common, "--out", str(tmp_path / "bad"),
                            script="rollout.py", match="neither hours")


def _sr_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "swinir" / "checkpoints" / "step_00000001.pt"
    path.parent.mkdir(parents=True)
    torch.save({"model": {}, "config": build_config("quickstart").to_dict(), "train_state": {"step": 1}}, path)
    return path


def _without_climatology(tmp_path: Path, root: Path) -> Path:
    data = Path(shutil.copytree(root, tmp_path / "data"))
    (data / "stats" / "time_means.npy").unlink()
    return data


@pytest.mark.parametrize("make_args, match", [
    (lambda tmp, root, run: ["--checkpoint", str(tmp / "nowhere")], "no such checkpoint"),
    (lambda tmp, root, run: ["--checkpoint", str(tmp)], "no checkpoint (step_N.pt or step_N/)"),
    (lambda tmp, root, run: ["--checkpoint", str(_sr_checkpoint(tmp))], "rollout needs a forecaster"),
    (lambda tmp, root, run: ["--checkpoint", str(run), "--steps", "0"], "--steps must be >= 1"),
    (lambda tmp, root, run: ["--checkpoint", str(run), "--steps", "two"], "invalid int value"),
    (lambda tmp, root, run: ["--checkpoint", str(run), "--steps", "6"],
     "6 steps of lead 1 need more than 6 samples in a file, the longest holds 6; use --steps 5 or less"),
    (lambda tmp, root, run: ["--checkpoint", str(run), "--steps", "2", "--data_dir", str(_without_climatology(tmp, root))],
     "time_means.npy: no such file"),
])
def test_bad_input_is_one_line_and_writes_nothing(trained, tmp_path, capsys, make_args, match):
    root, run = trained
    out = tmp_path / "out"
    expect_error_in_process(capsys, *make_args(tmp_path, root, run), "--out", str(out), script="rollout.py",
                            match=match)
    assert not out.exists()


def test_exit_code_and_one_line_as_a_command(tmp_path):
    proc = run_script("rollout.py", "--checkpoint", str(tmp_path / "nowhere"), check=False)
    assert check_error(proc.returncode, proc.stderr, 2, "error: no such checkpoint")
    assert len(proc.stderr.strip().splitlines()) == 1 and not proc.stdout
