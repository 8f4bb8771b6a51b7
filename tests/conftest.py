"""Shared fixtures: a tiny synthetic data set and a runner for the project's scripts."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from utils.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402

# A SwinIR small enough to train a few steps in seconds on 2 cores; tests add it to script calls.
TINY_MODEL = ["--depths", "[2]", "--num_heads", "[2]", "--embed_dim", "16", "--img_size", "16",
              "--drop_path_rate", "0", "--window_size", "8"]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """Synthetic ERA5 stand-in: 2 training years x 8 days and 1 validation year x 4 days of 65x128 fields."""
    from datasets.make_synthetic_era5 import make_synthetic_era5

    root = tmp_path_factory.mktemp("era5")
    make_synthetic_era5(root, samples_per_year=8, height=65, width=128, seed=0,
                        train_years=(2008, 2010), valid_years=(2015,), progress=False)
    return root


def tiny_args(data_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """A quickstart run shrunk to seconds: tiny model, 32x32 crops, no worker processes."""
    return ["--config", "quickstart", "--data_dir", str(data_dir), "--run_dir", str(run_dir),
            "--crop_size", "32", "--n_patches", "2", "--batch_size", "4", "--num_workers", "0",
            "--val_samples", "4", "--log_every", "2", "--progress", "never", *TINY_MODEL, *extra]


# 10 steps cross the epoch boundary (2 files x 8 days x 2 patches / batch 4 = 8 steps per epoch), with
# validations at steps 5 and 10 and checkpoints at steps 3, 6, 8 (end of epoch), 9 and 10.
REFERENCE_STEPS = ("--max_steps", "10", "--log_every", "1", "--val_every", "5", "--ckpt_every", "3",
                   "--keep_checkpoints", "10")


@pytest.fixture(scope="session")
def reference_run(tiny_data, tmp_path_factory) -> Path:
    """One train.py run with REFERENCE_STEPS, shared by every test that compares another script or a
    resumed run with plain single-device training (each launch costs seconds of start-up)."""
    run = tmp_path_factory.mktemp("reference") / "run"
    run_script("train.py", *tiny_args(tiny_data, run, *REFERENCE_STEPS))
    return run


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict:
    """The model weights in a run's latest single-file checkpoint (train.py, train_ddp.py)."""
    return load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))["model"]


def weights_at(run_dir: Path, step: int) -> dict:
    """The model weights in the single-file checkpoint of ``step`` (train.py, train_ddp.py)."""
    return load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}.pt")["model"]


def resume_from(source: Path, step: int, run_dir: Path) -> Path:
    """A run folder whose only checkpoint is a copy of ``source``'s at ``step``: a train.py/train_ddp.py
    file (step_N.pt) or a train_fsdp.py DCP folder (step_N)."""
    name = f"step_{step:08d}"
    (run_dir / "checkpoints").mkdir(parents=True)
    if (source / "checkpoints" / f"{name}.pt").exists():
        shutil.copyfile(source / "checkpoints" / f"{name}.pt", run_dir / "checkpoints" / f"{name}.pt")
    else:
        shutil.copytree(source / "checkpoints" / name, run_dir / "checkpoints" / name)
    return run_dir


def run_script(*args: str, timeout: float = 240, env_extra: dict | None = None, check: bool = True,
               launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run a project script (e.g. "train.py", "--config", ...) in a fresh interpreter from the repo root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    cmd = (launcher or [sys.executable]) + list(args)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-4000:]}")
    return proc
