"""A full disk and a reused run folder: one line, a dedicated exit code, nothing half-written, every rank stops.

Writes fail on a real, small tmpfs (mounted per test; needs root, as in the project's containers)
filled with a ballast file at the chosen moment; where mounting is refused those tests are skipped
and the classification is still checked with injected errors. Exit codes: 4 a failed write, 2 a
refused run folder (utils/training.py, EXIT_CODES).
"""

import errno
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from tests.conftest import REPO, read_metrics, tiny_args
from tests.test_ddp import TORCHRUN
from tests.test_train import expect_error_in_process
from utils import training
from utils.checkpoint.files import CheckpointError, StorageError, latest_checkpoint, prepare_run_dir, write_failure
from utils.checkpoint.single import save_checkpoint


class SmallDisk:
    """A tmpfs of ``size`` bytes at ``root``; ``fill()`` takes every free byte, ``free_up()`` gives them back."""

    def __init__(self, root: Path, size: int):
        self.root, self.ballast = root, root / "ballast"
        root.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(root)],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'not root'}); the injected-error "
                        "tests still run")

    def fill(self) -> None:
        with open(self.ballast, "ab", buffering=0) as ballast:
            try:
                while True:
                    ballast.write(b"\0" * 4096)
            except OSError as error:
                assert error.errno == errno.ENOSPC

    def free_up(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.root)], check=True, timeout=60)


@pytest.fixture
def small_disk(tmp_path):
    disks = []

    def mount(size: int = 4_000_000) -> SmallDisk:
        disks.append(SmallDisk(tmp_path / f"disk{len(disks)}", size))
        return disks[-1]

    yield mount
    for disk in disks:
        disk.unmount()


def no_partial_files(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if p.name.startswith(".tmp-") or ".partial" in p.name]


# ----------------------------------------------------------------------------- which errors count


def test_only_storage_failures_become_the_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000007").mkdir(parents=True)  # train_fsdp.py's, newer than the file
    (run / "checkpoints" / "step_00000007" / ".metadata").write_bytes(b"")
    (run / "checkpoints" / "step_00000005.pt").write_bytes(b"")
    (run / "checkpoints" / "step_00000009").mkdir()  # incomplete: no metadata
    target = run / "checkpoints" / "step_00000010.pt"
    zip_writer = RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 704 vs 598")
    zip_writer.__context__ = OSError(errno.ENOSPC, "No space left on device")  # torch.save through a file
    for error, reason in [(OSError(errno.ENOSPC, "No space left on device"), "No space left on device"),
                          (OSError(errno.EDQUOT, "Disk quota exceeded"), "Disk quota exceeded"),
                          (OSError(errno.EIO, "Input/output error"), "Input/output error"),
                          (zip_writer, "No space left on device"),
                          (RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 7 vs 5"),
                           "the write failed")]:
        line = str(write_failure(error, "checkpoint", target, run_dir=run))
        assert line.startswith(f"could not write checkpoint {target}: {reason} (") and "\n" not in line
        assert " free of " in line and f"last good checkpoint {run / 'checkpoints' / 'step_00000007'} is intact" in line
        assert "--resume" in line and f"copy {run} to a file system with room" in line
    for other in (OSError(errno.EACCES, "Permission denied"), RuntimeError("CUDA error"), KeyError("x")):
        assert write_failure(other, "checkpoint", target, run_dir=run) is None
    assert "no checkpoint was saved yet" in str(write_failure(OSError(errno.ENOSPC, "full"), "picture",
                                                              tmp_path / "other" / "a.png", run_dir=tmp_path / "other"))


def test_save_checkpoint_turns_torchs_zip_writer_error_into_storage_error(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "checkpoints", 1, {"w": torch.zeros(2)})

    def full_disk(obj, stream):
        stream.write(b"PK")
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:671] . unexpected pos 64 vs 2")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(StorageError, match=r"step_00000002.pt: No space left on device .*/step_00000001.pt is intact"):
        save_checkpoint(tmp_path / "checkpoints", 2, {"w": torch.zeros(2)})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001.pt"]


# ----------------------------------------------------------------------------- train.py, the case


def test_full_disk_at_a_checkpoint_names_the_last_good_one_and_resume_continues(tiny_data, small_disk,
                                                                                  capsys, monkeypatch):
    import train

    disk = small_disk()
    run = disk.root / "run"
    args = tiny_args(tiny_data, run, "--max_steps", "2", "--ckpt_every", "1")
    real_save, saves = train.save_checkpoint, []

    def fill_before_the_second(*call, **kwargs):
        saves.append(call[1])
        if len(saves) == 2:
            disk.fill()
        return real_save(*call, **kwargs)

    monkeypatch.setattr(train, "save_checkpoint", fill_before_the_second)
    last = expect_error_in_process(capsys, *args, code=4, match="could not write checkpoint")
    ckpts = run / "checkpoints"
    assert re.fullmatch(re.escape(f"error: could not write checkpoint {ckpts / 'step_00000002.pt'}: No space left on "
                                  "device (") + r"\S+ \S*B free of 4.0 MB" + re.escape(
        f" on that file system); the last good checkpoint {ckpts / 'step_00000001.pt'} is intact: free space and "
        f"rerun with --resume, or copy {run} to a file system with room and rerun with --run_dir <the copy> --resume"),
        last), last
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001.pt"] and no_partial_files(run)

    disk.free_up()
    monkeypatch.setattr(train, "save_checkpoint", real_save)
    with mock.patch.object(sys, "argv", ["train.py", *args, "--resume"]), pytest.raises(SystemExit) as done:
        training.run_cli(train.main)
    assert done.value.code == 0 and "resumed from" in capsys.readouterr().out
    assert latest_checkpoint(ckpts).name == "step_00000002.pt"
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [2, 2]  # the failed step, then again


# ----------------------------------------------------------------------------- the other writes of a run


def run_with_checkpoint(root: Path) -> Path:
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000005.pt").write_bytes(b"checkpoint")
    return run


def test_metrics_jsonl_and_tensorboard_keep_whole_records_and_say_one_line(small_disk, capfd):
    from utils.observe.logger import MetricsLogger

    disk = small_disk(1_000_000)
    run = run_with_checkpoint(disk.root)
    logger = MetricsLogger(run, console=None)
    logger.log({"kind": "train", "step": 1, "loss": 1.0})
    disk.fill()
    with pytest.raises(StorageError) as failed:  # longer than the slack of the file's last page
        logger.log({"kind": "train", "step": 2, "loss": 1.0, "note": "x" * 10_000})
    assert str(failed.value).startswith(f"could not write metrics {run / 'metrics.jsonl'}: No space left")
    assert "step_00000005.pt is intact" in str(failed.value)
    assert [r["step"] for r in read_metrics(run)] == [1]  # the half-written record was cut off again
    logger.close()  # nothing left to flush

    # TensorBoard writes from a thread; its error surfaces in the main thread, once, as the same one line.
    with pytest.raises(StorageError, match=r"could not write TensorBoard events in .*run: No space left"):
        MetricsLogger(run, console=None)  # the first event of a new event file
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err


def test_sample_picture_on_a_full_disk(small_disk):
    from utils.observe.pictures import save_sample_png

    disk = small_disk(1_000_000)
    run = run_with_checkpoint(disk.root)
    disk.fill()
    lr, hr = torch.rand(1, 8, 8), torch.rand(1, 16, 16)
    with pytest.raises(StorageError, match=r"picture .*step_3.png: No space .*step_00000005.pt is intact"):
        save_sample_png(run / "samples" / "step_3.png", lr, hr, hr, hr)
    assert not list(run.rglob("*.png")) and no_partial_files(run)


def test_profiler_trace_on_a_full_disk(small_disk):
    from utils.config import build_config
    from utils.observe import profiling

    disk = small_disk(1_000_000)
    run = run_with_checkpoint(disk.root)
    cfg = build_config("quickstart", {"run_dir": str(run), "profile": True, "profile_wait": 0, "profile_warmup": 1,
                                      "profile_active": 1, "memory_timeline": False})
    disk.fill()
    with pytest.raises(StorageError, match=r"could not write profile file .*rank0_trace.json.gz: No space"):
        with profiling.maybe_enable_profiling(cfg, torch.device("cpu")) as profiler:
            for _ in range(3):
                torch.ones(8).sum()
                profiler.step()
    assert not list(run.rglob("*trace*")) and no_partial_files(run)


@pytest.fixture
def one_rank():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_sharded_checkpoint_on_a_full_disk(one_rank, small_disk):
    from utils.checkpoint.sharded import save_sharded_checkpoint

    disk = small_disk(1_000_000)
    ckpts = disk.root / "run" / "checkpoints"
    save_sharded_checkpoint(ckpts, 1, {"w": torch.zeros(1000)})
    disk.fill()
    expected = (re.escape(f"could not write checkpoint {ckpts / 'step_00000002'}: No space left") + ".*"
                + re.escape(f"the last good checkpoint {ckpts / 'step_00000001'} is intact"))
    with pytest.raises(StorageError, match=expected):
        save_sharded_checkpoint(ckpts, 2, {"w": torch.zeros(100_000)})
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001"]


def test_synthetic_data_on_a_full_disk_is_one_line(small_disk):
    disk = small_disk(1_000_000)
    proc = subprocess.run([sys.executable, "datasets/make_synthetic_era5.py", "--out", str(disk.root / "data"),
                           "--samples-per-year", "8", "--height", "65", "--width", "128", "--train-years", "2008",
                           "2010", "--valid-years", "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "error: cannot write under" in proc.stderr and "No space left on device (" in proc.stderr
    assert no_partial_files(disk.root / "data")


# ----------------------------------------------------------------------------- torchrun


def torchrun(args, timeout: float = 180):
    """train_ddp.py under torchrun: (return code, stderr, seconds from the first "error:" line to the end)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen([*TORCHRUN, "train_ddp.py", *args], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    lines, first_error = [], []

    def read() -> None:  # in a thread: the deadline holds also while no line comes
        for line in job.stderr:
            lines.append(line)
            if not first_error and "error: " in line:
                first_error.append(time.time())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError("".join(lines)) from None
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=60)
        reader.join(timeout=60)
    return job.returncode, "".join(lines), (time.time() - first_error[0]) if first_error else None


def test_rank_zero_write_failure_ends_the_ddp_job_promptly_with_one_line(tiny_data, small_disk):
    # Room for the start-up files and the first checkpoint (~0.35 MB), not for the second.
    disk = small_disk(600_000)
    run = disk.root / "run"
    code, err, after_error = torchrun(tiny_args(tiny_data, run, "--max_steps", "100", "--ckpt_every", "1",
                                                "--val_every", "0", "--log_every", "1"))
    assert code != 0 and after_error is not None and after_error < 15, err
    errors = [line for line in err.splitlines() if "error: " in line]
    assert len(errors) == 1 and errors[0].startswith("error: could not write checkpoint"), err
    assert "step_00000001.pt is intact" in errors[0]
    # Rank 1's barrier broke when rank 0 exited: it stayed silent until torchrun stopped it.
    assert "[rank1]" not in err and err.count("Traceback") == 1 and "<NO_OTHER_FAILURES>" in err, err
    assert latest_checkpoint(run / "checkpoints").name == "step_00000001.pt" and no_partial_files(run)


def test_refused_run_dir_under_torchrun_is_one_line_and_nothing_is_written(tiny_data, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    before = sorted(p.name for p in run.iterdir())
    code, err, _ = torchrun(tiny_args(tiny_data, run, "--max_steps", "2"))
    errors = [line for line in err.splitlines() if "error: " in line]
    assert code != 0 and len(errors) == 1, err
    assert errors[0] == (f"error: run directory {run} already holds another run (metrics.jsonl): choose another "
                         "--run_dir, or delete it (it has no checkpoint to --resume from)")
    assert "<NO_OTHER_FAILURES>" in err  # rank 1 was stopped without a failure of its own
    assert len(err.splitlines()) <= 40, err  # torchrun's own report of rank 0's exit included (36 lines here)
    assert sorted(p.name for p in run.iterdir()) == before


# ----------------------------------------------------------------------------- the run folder


def test_fresh_run_into_another_runs_folder_is_refused(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare_run_dir(empty, resume=False) == empty  # an empty (or new) folder is fine
    assert prepare_run_dir(tmp_path / "new", resume=False).is_dir()
    (empty / "metrics.jsonl").write_text("")  # a run that died before its first record
    prepare_run_dir(empty, resume=False)

    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000003").mkdir(parents=True)
    (run / "checkpoints" / "step_00000003" / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError) as refused:
        prepare_run_dir(run, resume=False)
    assert str(refused.value) == (f"run directory {run} already holds another run (checkpoints up to step_00000003): "
                                  "continue it with --resume, choose another --run_dir, or delete it")
    assert prepare_run_dir(run, resume=True) == run


def test_train_py_refuses_a_fresh_run_into_a_used_folder(tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002.pt").write_bytes(b"x")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 2}\n')
    listing = sorted(str(p) for p in run.rglob("*"))
    last = expect_error_in_process(capsys, *tiny_args(tiny_data, run, "--max_steps", "2"), code=2)
    assert last == (f"error: run directory {run} already holds another run (metrics.jsonl and checkpoints up to "
                    "step_00000002.pt): continue it with --resume, choose another --run_dir, or delete it")
    assert sorted(str(p) for p in run.rglob("*")) == listing


def test_other_ranks_keep_a_shared_error_to_themselves(monkeypatch, capsys):
    def fails():
        raise StorageError("could not write checkpoint x")

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(training, "RANK_ERROR_GRACE_S", 0.0)  # not stopped by the launcher within the grace
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as exit_:
            training.run_cli(fails)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert exit_.value.code == 4 and capsys.readouterr().err == "[rank 1] error: could not write checkpoint x\n"
