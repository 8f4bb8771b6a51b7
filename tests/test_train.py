"""train.py end to end: outputs, exact resume after a kill, and every bad input."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, run_script, tiny_args

TRAIN_KEYS = {"kind", "step", "epoch", "loss", "lr", "samples_per_sec", "mfu", "peak_mem_gb"}
VAL_KEYS = {"kind", "step", "rmse", "bicubic_rmse"}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict:
    latest = sorted((run_dir / "checkpoints").glob("step_*.pt"))[-1]
    return torch.load(latest, map_location="cpu", weights_only=False)["model"]


def test_short_run_writes_every_output(tiny_data, tmp_path):
    run = tmp_path / "run"
    run_script("train.py", *tiny_args(tiny_data, run, "--max_steps", "4", "--val_every", "2"))
    records = read_metrics(run)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == [2, 4] and all(TRAIN_KEYS <= set(r) for r in train)
    assert [r["step"] for r in val] == [2, 4] and all(VAL_KEYS <= set(r) for r in val)
    assert all(len(r["rmse"]) == 3 and len(r["bicubic_rmse"]) == 3 for r in val)
    assert all(r["loss"] > 0 and r["samples_per_sec"] > 0 and r["peak_mem_gb"] > 0 for r in train)
    assert list((run / "checkpoints").glob("step_00000004.pt"))
    assert list(run.rglob("events.out.tfevents.*"))
    png = run / "samples" / "step_4.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_killed_run_resumes_to_identical_weights(tiny_data, tmp_path):
    # 2 files x 8 days x 2 patches / batch 4 = 8 steps per epoch: 12 steps cross an epoch boundary.
    common = ("--max_steps", "12", "--ckpt_every", "1", "--keep_checkpoints", "20")
    reference = tmp_path / "reference"
    run_script("train.py", *tiny_args(tiny_data, reference, *common))

    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "train.py", *tiny_args(tiny_data, killed, *common)], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step_00000005.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = sorted(p.name for p in (killed / "checkpoints").glob("step_*.pt"))
    assert saved[-1] < "step_00000012.pt", f"the kill came too late to test anything: {saved}"

    run_script("train.py", *tiny_args(tiny_data, killed, *common, "--resume"))
    ref, res = final_weights(reference), final_weights(killed)
    assert ref.keys() == res.keys()
    for key in ref:
        torch.testing.assert_close(res[key], ref[key], rtol=0, atol=0, msg=key)
    ref_loss = [r["loss"] for r in read_metrics(reference) if r["kind"] == "train"][-1]
    res_loss = [r["loss"] for r in read_metrics(killed) if r["kind"] == "train"][-1]
    assert ref_loss == res_loss


def expect_error(*args, code=2, match=""):
    proc = run_script("train.py", *args, check=False)
    assert proc.returncode == code, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert match in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return last


def test_missing_data_dir(tmp_path):
    run = tmp_path / "run"
    expect_error(*tiny_args(tmp_path / "nowhere", run), match="make_synthetic_era5")
    assert not run.exists()


@pytest.mark.parametrize("extra, match", [
    (("--config", "nope"), "unknown config"),
    (("--batchsize", "4"), "unrecognized arguments"),
    (("--batch_size", "0"), "batch_size must be > 0"),
    (("--crop_size", "33"), "divisible by upscale"),
])
def test_bad_config(tiny_data, tmp_path, extra, match):
    run = tmp_path / "run"
    expect_error(*tiny_args(tiny_data, run), *extra, match=match)
    assert not run.exists()


def test_resume_without_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "run"
    expect_error(*tiny_args(tiny_data, run, "--resume"), match="no checkpoint")
    assert not run.exists()


def test_run_dir_not_writable(tiny_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    expect_error(*tiny_args(tiny_data, blocker / "run"), match="not writable")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "run"
    expect_error(*tiny_args(tiny_data, run, "--lr", "1e30", "--max_steps", "8", "--ckpt_every", "1",
                            "--log_every", "1"), code=3, match="loss is")
    saved = sorted((run / "checkpoints").glob("step_*.pt"))
    assert saved, "the step before divergence should have been saved"
    state = torch.load(saved[-1], map_location="cpu", weights_only=False)["model"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
