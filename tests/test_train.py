"""train.py end to end: outputs, exact resume after a kill, and every bad input."""

import importlib
import os
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

from tests.conftest import REFERENCE_STEPS, REPO, read_metrics, run_script, tiny_args, weights_at
from utils.training import run_cli

TRAIN_KEYS = {"kind", "step", "epoch", "loss", "lr", "samples_per_sec", "mfu", "peak_mem_gb"}
VAL_KEYS = {"kind", "step", "rmse", "bicubic_rmse"}


def test_short_run_writes_every_output(reference_run):
    # REFERENCE_STEPS: 10 steps, a training record every step, validations at steps 5 and 10,
    # checkpoints every 3 steps, at the end of the epoch (step 8) and at the end.
    run = reference_run
    records = read_metrics(run)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == list(range(1, 11)) and all(TRAIN_KEYS <= set(r) for r in train)
    assert [r["epoch"] for r in train] == [0] * 8 + [1] * 2
    assert [r["step"] for r in val] == [5, 10] and all(VAL_KEYS <= set(r) for r in val)
    assert all(len(r["rmse"]) == 3 and len(r["bicubic_rmse"]) == 3 for r in val)
    assert all(r["loss"] > 0 and r["samples_per_sec"] > 0 and r["peak_mem_gb"] > 0 for r in train)
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*.pt"))
    assert saved == [f"step_{step:08d}.pt" for step in (3, 6, 8, 9, 10)]
    assert list(run.rglob("events.out.tfevents.*"))
    for step in (5, 10):
        assert (run / "samples" / f"step_{step}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_killed_run_resumes_to_identical_weights(tiny_data, reference_run, tmp_path):
    # Killed at step 3 or soon after, resumed across the epoch boundary (step 8) to the reference's step 10.
    common = (*REFERENCE_STEPS, "--ckpt_every", "1", "--keep_checkpoints", "20")
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "train.py", *tiny_args(tiny_data, killed, *common)], cwd=REPO,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (killed / "checkpoints" / "step_00000003.pt").exists():
        assert proc.poll() is None and time.time() < deadline, "run ended before it could be killed"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    saved = sorted(p.name for p in (killed / "checkpoints").glob("step_*.pt"))
    assert saved[-1] < "step_00000008.pt", f"the kill came too late to test anything: {saved}"

    proc = run_script("train.py", *tiny_args(tiny_data, killed, *common, "--resume"), in_process=True)
    assert f"resumed from {killed / 'checkpoints' / saved[-1]}" in proc.stdout
    ref, res = weights_at(reference_run, 10), weights_at(killed, 10)
    assert ref.keys() == res.keys()
    for key in ref:
        torch.testing.assert_close(res[key], ref[key], rtol=0, atol=0, msg=key)
    ref_loss = [r["loss"] for r in read_metrics(reference_run) if r["kind"] == "train"][-1]
    res_loss = [r["loss"] for r in read_metrics(killed) if r["kind"] == "train"][-1]
    assert ref_loss == res_loss


def expect_error(*args, code=2, match=""):
    """Run ``python train.py ARGS``; expect exit ``code`` and a last stderr line containing ``match``."""
    proc = run_script("train.py", *args, check=False)
    return check_error(proc.returncode, proc.stderr, code, match)


def expect_error_in_process(capsys, *args, code=2, match="", script="train.py"):
    """The same through the script's main() in this process, which saves the interpreter's start-up
    (seconds). Only for failures that leave nothing later tests depend on: main() at most seeds the
    global RNGs and trains a few steps before it stops."""
    module = importlib.import_module(script.removesuffix(".py"))
    with mock.patch.object(sys, "argv", [script, *args]), pytest.raises(SystemExit) as exit_:
        run_cli(module.main)
    return check_error(exit_.value.code, capsys.readouterr().err, code, match)


def check_error(returncode, stderr: str, code: int, match: str) -> str:
    assert returncode == code, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert match in last, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
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
def test_bad_config(tiny_data, tmp_path, capsys, extra, match):
    run = tmp_path / "run"
    expect_error_in_process(capsys, *tiny_args(tiny_data, run), *extra, match=match)
    assert not run.exists()


def test_resume_without_checkpoint(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    expect_error_in_process(capsys, *tiny_args(tiny_data, run, "--resume"), match="no checkpoint")
    assert not run.exists()


def test_run_dir_not_writable(tiny_data, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    expect_error_in_process(capsys, *tiny_args(tiny_data, blocker / "run"), match="not writable")


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    expect_error_in_process(capsys, *tiny_args(tiny_data, run, "--lr", "1e30", "--max_steps", "8",
                                               "--ckpt_every", "1", "--log_every", "1"), code=3, match="loss is")
    saved = sorted((run / "checkpoints").glob("step_*.pt"))
    assert saved, "the step before divergence should have been saved"
    state = torch.load(saved[-1], map_location="cpu", weights_only=False)["model"]
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_the_model_is_resolved_once_per_process(tiny_data, tmp_path, monkeypatch):
    # Its builder, spec and arguments are found once (models.resolve) and every reader takes them from there: the
    # config's checks, the builder, the task's contract, the techniques' plan, the FLOP count, the checkpoint.
    import models
    import utils.tasks

    calls, real = [], models.load_model_class
    monkeypatch.setattr(models, "_RESOLVED", {})  # what earlier tests in this process resolved
    for module in (models, utils.tasks):
        monkeypatch.setattr(module, "load_model_class", lambda *args, **kw: calls.append(args[0]) or real(*args, **kw))
    run_script("train.py", *tiny_args(tiny_data, tmp_path / "run", "--max_steps", "2", "--val_every", "2"),
               in_process=True)
    assert calls == ["models.swinir:build"]
