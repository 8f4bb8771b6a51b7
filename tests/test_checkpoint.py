"""utils/checkpoint/: atomic saves that survive a crash, pruning, ordering, corruption, RNG, key names."""

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import load as dcp_load

from utils.checkpoint import files, single
from utils.checkpoint.files import CheckpointError, ensure_writable_dir, latest_checkpoint
from utils.checkpoint.sharded import save_sharded_checkpoint
from utils.checkpoint.single import load_checkpoint, save_checkpoint
from utils.checkpoint.state import capture_rng_state, restore_rng_state, strip_wrapper_prefixes


def small_state(value: float) -> dict:
    return {"weights": torch.full((4, 4), value), "step_info": {"step": int(value), "note": "x"}}


def step_files(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("step_"))


def test_save_then_load_round_trip(tmp_path):
    path = save_checkpoint(tmp_path / "ckpt", 7, small_state(7.0))
    assert path.name == "step_00000007.pt"
    loaded = load_checkpoint(path)
    assert torch.equal(loaded["weights"], torch.full((4, 4), 7.0))
    assert loaded["step_info"] == {"step": 7, "note": "x"}
    assert os.listdir(tmp_path / "ckpt") == ["step_00000007.pt"]  # no temp or probe files left


def test_written_files_get_the_umask_permissions_not_private_ones(tmp_path):
    """mkstemp creates 0600 files; a run's outputs must be readable by the project group."""
    old = os.umask(0o027)
    try:
        path = save_checkpoint(tmp_path / "ckpt", 1, small_state(1.0))
        with files.replaced_atomically(tmp_path / "picture.png") as temporary:
            temporary.write_bytes(b"png")
    finally:
        os.umask(old)
    for written in (path, tmp_path / "picture.png"):
        assert written.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("failing", ["torch.save", "os.replace", "keyboard interrupt"])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch, failing):
    directory = tmp_path / "ckpt"
    save_checkpoint(directory, 1, small_state(1.0))

    if failing == "torch.save":
        def crashing_save(obj, stream, *args, **kwargs):
            stream.write(b"PK\x03\x04 half a zip file")  # some bytes reach the disk before the crash
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(single.torch, "save", crashing_save)
    elif failing == "os.replace":
        def crashing_replace(src, dst):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(files.os, "replace", crashing_replace)
    else:
        def interrupted_save(obj, stream, *args, **kwargs):
            stream.write(b"partial")
            raise KeyboardInterrupt

        monkeypatch.setattr(single.torch, "save", interrupted_save)

    expected = KeyboardInterrupt if failing == "keyboard interrupt" else CheckpointError
    with pytest.raises(expected):
        save_checkpoint(directory, 2, small_state(2.0))
    monkeypatch.undo()

    assert os.listdir(directory) == ["step_00000001.pt"]  # no partial step file, no temp file
    assert latest_checkpoint(directory).name == "step_00000001.pt"
    assert torch.equal(load_checkpoint(latest_checkpoint(directory))["weights"], torch.full((4, 4), 1.0))


KILLED_MID_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, sys.argv[2])
from utils.checkpoint import single

def save_then_die(obj, stream, *args, **kwargs):
    stream.write(b"PK\\x03\\x04 the first bytes of a zip")
    stream.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # no except/finally runs, as with a SLURM time-out or OOM kill

single.torch.save = save_then_die
single.save_checkpoint(sys.argv[1], 2, {"weights": torch.zeros(4)})
"""


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    save_checkpoint(directory, 1, small_state(1.0))
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_SAVE, str(directory), str(repo)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert step_files(directory) == ["step_00000001.pt"]  # the partial file never got a step_ name
    assert any(name.startswith(files.TEMP_PREFIX) for name in os.listdir(directory))  # the half-written file
    assert torch.equal(load_checkpoint(latest_checkpoint(directory))["weights"], torch.full((4, 4), 1.0))
    save_checkpoint(directory, 2, small_state(2.0))
    assert sorted(os.listdir(directory)) == ["step_00000001.pt", "step_00000002.pt"]  # temp file cleaned


KILLED_MID_SHARDED_SAVE = """
import os, signal, sys, torch
sys.path.insert(0, sys.argv[2])
from utils.checkpoint import sharded

def write_a_shard_then_die(payload, checkpoint_id):
    os.makedirs(checkpoint_id, exist_ok=True)
    with open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb") as shard:
        shard.write(b"the first bytes of rank 0's shard")
    os.kill(os.getpid(), signal.SIGKILL)

sharded.dcp.save = write_a_shard_then_die
sharded.save_sharded_checkpoint(sys.argv[1], 2, {"weights": torch.zeros(4)})
"""


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process without a group
def test_process_killed_mid_sharded_save_keeps_previous_checkpoint(tmp_path):
    # train_fsdp.py's checkpoints (DCP folders): a job killed while its ranks write step 2 resumes from step 1,
    # and the next save removes the half-written folder.
    directory = tmp_path / "ckpt"
    save_sharded_checkpoint(directory, 1, {"weights": torch.ones(4)})
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_SHARDED_SAVE, str(directory), str(repo)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert sorted(os.listdir(directory)) == [f"{files.TEMP_PREFIX}00000002", "step_00000001"]
    resumed = files.checkpoint_to_resume(directory, "auto", sharded=True)
    state = {"weights": torch.zeros(4)}
    dcp_load(state, checkpoint_id=resumed)
    assert resumed.name == "step_00000001" and torch.equal(state["weights"], torch.ones(4))
    save_sharded_checkpoint(directory, 2, {"weights": torch.full((4,), 2.0)})
    assert sorted(os.listdir(directory)) == ["step_00000001", "step_00000002"]  # the hidden folder is gone


def test_write_failure_message_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(files.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(CheckpointError, match=r"No space left on device.*no checkpoint was saved yet") as info:
        save_checkpoint(tmp_path, 3, small_state(3.0))
    assert "\n" not in str(info.value)


def test_stale_temp_files_are_ignored_and_cleaned(tmp_path):
    save_checkpoint(tmp_path, 5, small_state(5.0))
    stale = tmp_path / f"{files.TEMP_PREFIX}00000009-abc.pt"  # left by a job killed while writing step 9
    stale.write_bytes(b"half written")
    assert latest_checkpoint(tmp_path).name == "step_00000005.pt"
    save_checkpoint(tmp_path, 6, small_state(6.0))
    assert not stale.exists()
    assert step_files(tmp_path) == ["step_00000005.pt", "step_00000006.pt"]


def test_keep_prunes_oldest(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, small_state(float(step)), keep=2)
    assert step_files(tmp_path) == ["step_00000030.pt", "step_00000040.pt"]
    save_checkpoint(tmp_path, 50, small_state(50.0), keep=0)  # keep < 1: keep everything
    assert step_files(tmp_path) == ["step_00000030.pt", "step_00000040.pt", "step_00000050.pt"]
    save_checkpoint(tmp_path, 60, small_state(60.0), keep=1)
    assert step_files(tmp_path) == ["step_00000060.pt"]


def test_file_just_written_is_never_pruned(tmp_path):
    # An older run left higher steps; a new save must survive pruning.
    for step in (100, 200):
        save_checkpoint(tmp_path, step, small_state(1.0), keep=5)
    save_checkpoint(tmp_path, 3, small_state(3.0), keep=2)
    assert step_files(tmp_path) == ["step_00000003.pt", "step_00000200.pt"]


def test_latest_checkpoint_orders_numerically_beyond_eight_digits(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    assert latest_checkpoint(tmp_path) is None
    for step in (99_999_999, 100_000_000, 7):  # 9 digits sorts before 8 as text
        save_checkpoint(tmp_path, step, small_state(0.0), keep=0)
    (tmp_path / "step_abc.pt").write_bytes(b"not a checkpoint name")
    (tmp_path / "step_00000005.pt.bak").write_bytes(b"")
    assert latest_checkpoint(tmp_path).name == "step_100000000.pt"


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_checkpoint_raises_checkpoint_error(tmp_path, damage):
    save_checkpoint(tmp_path, 1, small_state(1.0), keep=0)
    path = save_checkpoint(tmp_path, 2, {"big": torch.randn(1000)}, keep=0)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00garbage" * 50, "empty": b""}[damage])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "delete it" in message and "step_00000001.pt" in message
    assert "\n" not in message


def test_missing_checkpoint_raises_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "step_00000001.pt")


def test_state_that_would_not_load_weights_only_is_rejected_at_save(tmp_path):
    with pytest.raises(CheckpointError, match=r"state\['metrics'\]\['best'\] is a numpy.float64"):
        save_checkpoint(tmp_path, 1, {"metrics": {"best": np.float64(0.5)}})
    assert os.listdir(tmp_path) == []


def test_full_training_state_loads_with_weights_only(tmp_path):
    """Model, AdamW, scheduler, GradScaler, RNG and a plain config survive a weights_only round trip."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": torch.amp.GradScaler("cpu", enabled=True).state_dict(),
        "rng": capture_rng_state(),
        "config": {"lr": 1e-3, "model_args": {"depths": [6, 6]}, "amp_dtype": "none", "max_steps": 0},
        "dtype": torch.bfloat16,
    }
    loaded = load_checkpoint(save_checkpoint(tmp_path, 1, state))
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fresh.load_state_dict(loaded["optimizer"])
    assert torch.equal(fresh.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert loaded["config"] == state["config"] and loaded["dtype"] is torch.bfloat16


def draw_all() -> tuple:
    return (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(3).tolist())


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    draw_all()
    np.random.randn()  # leaves a cached Gaussian in NumPy's legacy state
    path = save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    expected = draw_all()
    draw_all()  # move every generator on
    restore_rng_state(load_checkpoint(path)["rng"])
    assert draw_all() == expected


def test_strip_wrapper_prefixes():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    plain_state = inner.state_dict()
    wrapped = {
        "module._orig_mod.0.weight": 1,
        "_orig_mod.module.0.bias": 2,
        "layers.0._checkpoint_wrapped_module.attn.qkv.weight": 3,
        "submodule.module_norm.weight": 4,  # "module" only inside a name: untouched
    }
    assert strip_wrapper_prefixes(wrapped) == {
        "0.weight": 1,
        "0.bias": 2,
        "layers.0.attn.qkv.weight": 3,
        "submodule.module_norm.weight": 4,
    }
    assert list(strip_wrapper_prefixes(wrapped)) == ["0.weight", "0.bias", "layers.0.attn.qkv.weight",
                                                     "submodule.module_norm.weight"]
    # A real state_dict of a compiled DDP-style wrapper loads into the plain model, metadata kept.
    wrapper = torch.nn.Module()
    wrapper.module = torch.nn.Module()
    wrapper.module._orig_mod = inner
    stripped = strip_wrapper_prefixes(wrapper.state_dict())
    assert list(stripped) == list(plain_state)
    assert "1" in stripped._metadata
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    fresh.load_state_dict(stripped)
    with pytest.raises(ValueError, match="collide"):
        strip_wrapper_prefixes({"module.w": 1, "w": 2})


def test_ensure_writable_dir(tmp_path):
    created = ensure_writable_dir(tmp_path / "a" / "b")
    assert created.is_dir() and os.listdir(created) == []
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match=r"run directory .*file/sub is not writable .*--run_dir"):
        ensure_writable_dir(blocker / "sub")


def test_ensure_writable_dir_read_only(tmp_path, monkeypatch):
    # Simulated (chmod does not stop root, which runs these tests in containers).
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(files.tempfile, "NamedTemporaryFile", refuse)
    with pytest.raises(CheckpointError, match=r"is not writable \(Permission denied\): choose another with --run_dir"):
        ensure_writable_dir(tmp_path)


def test_foreign_object_in_file_gets_its_own_message(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save({"best": np.float64(0.5)}, path)  # written without save_checkpoint's check
    with pytest.raises(CheckpointError, match=r"holds a numpy\S*scalar.*weights_only=False"):
        load_checkpoint(path)
    assert load_checkpoint(path, weights_only=False)["best"] == 0.5
