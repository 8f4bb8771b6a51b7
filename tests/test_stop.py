"""Runs that survive the end of a job.

A stop request becomes a checkpoint: SIGTERM (scancel, preemption) or SIGUSR1 (sbatch --signal, before the
time limit), sent to one process of a run, stops every rank after the same step; the run writes that step's
checkpoint and exits 75 with one line, and `--resume auto` continues it to the weights of an uninterrupted
run: bit-identical for train.py and train_ddp.py, within the fp32 tolerance of the equivalence tests for the
sharded train_fsdp.py. train_with_profiling.py, train_mp.py and train_pp.py stop the same way (exit code,
line, the checkpoint of that step). Bad input is not retried by `torchrun --max-restarts`; a rank that dies or
stops answering is (tests/test_hang.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import (REFERENCE_STEPS, REPO, exit_in_one_process, read_metrics, resume_from, run_script,
                            stop_mid_run, tiny_args, vit_args, weights_at)
from tests.test_ddp import assert_same_weights, train_losses
from tests.test_fsdp import exported
from tests.test_train import check_error
from utils.stopping import END_TIME_VARIABLE, EXIT_STOPPED

STOPPED = re.compile(r"stopped at step (\d+) by (SIGTERM|SIGUSR1): checkpoint (\S+); continue with the same "
                     r"command and --resume auto \(exit code 75\)")


def stopped_at(proc, signal_name: str) -> tuple[int, Path]:
    """The step and checkpoint of the run's one stop line (rank 0's), after checking the exit codes."""
    assert set(proc.returncode) == {EXIT_STOPPED}, proc.stdout[-3000:]
    lines = STOPPED.findall(proc.stdout)
    assert len(lines) == 1, proc.stdout[-3000:]
    step, name, checkpoint = lines[0]
    assert name == signal_name and 1 <= int(step) < 10, lines[0]
    assert Path(checkpoint).name.startswith(f"step_{int(step):08d}") and Path(checkpoint).exists()
    return int(step), Path(checkpoint)


def assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "weights differ"


def test_train_py_stops_on_sigterm_and_resumes_to_identical_weights(tiny_data, reference_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = tiny_args(tiny_data, run, *REFERENCE_STEPS)
    monkeypatch.setenv(END_TIME_VARIABLE, str(int(time.time()) + 3600))  # as the job scripts export it
    stopped = stop_mid_run(["train.py", *args], run)
    step, checkpoint = stopped_at(stopped, "SIGTERM")
    took = re.search(r"; the stop took ([\d.]+) s of the (\d+) s left before the job's time limit\n", stopped.stdout)
    assert took and float(took[1]) < 60 and 3500 < int(took[2]) <= 3600, stopped.stdout[-2000:]
    assert "warning" not in stopped.stdout
    resumed = run_script("train.py", *args, "--resume", "auto", in_process=True)
    assert f"resumed from {checkpoint} at step {step}" in resumed.stdout
    assert_identical(weights_at(run, 10), weights_at(reference_run, 10))
    assert train_losses(run) == train_losses(reference_run)  # every step's loss, both segments


def test_a_lead_shorter_than_a_checkpoint_write_is_named(tiny_data, tmp_path, monkeypatch):
    run = tmp_path / "run"
    monkeypatch.setenv(END_TIME_VARIABLE, str(int(time.time()) - 1))  # the limit is upon it: no lead is enough
    stopped = stop_mid_run(["train.py", *tiny_args(tiny_data, run, "--max_steps", "10", "--ckpt_every", "1")], run)
    stopped_at(stopped, "SIGTERM")  # it still stops with its checkpoint, which here had the time
    warning = re.search(r"warning: 0 s are left before the job's time limit, and this run's last checkpoint took "
                        r"[\d.]+ s to write: .*sbatch --signal=B:USR1@(\d+)\n", stopped.stdout)
    assert warning and int(warning[1]) >= 60, stopped.stdout[-2000:]
    assert re.search(r"left before the job's time limit: ask for a longer lead next time \(sbatch --signal=B:USR1@\d+\)",
                     stopped.stdout)


def test_a_signal_to_the_whole_launch_stops_torchrun_and_its_workers_with_a_checkpoint(tiny_data, ddp_reference_run,
                                                                                       tmp_path):
    # SIGUSR1 to launch.py's process group, torchrun and its workers alike (sbatch --signal=USR1@N without B:):
    # torchrun, which dies of SIGUSR1 by itself, passes it on; every rank checkpoints the same step; exit 75 all
    # the way up; --resume auto continues to the uninterrupted weights, bit for bit.
    run = tmp_path / "run"
    args = tiny_args(tiny_data, run, *REFERENCE_STEPS)
    job = subprocess.Popen([sys.executable, "launch.py", "--standalone", "--nproc-per-node", "2", "train_ddp.py",
                            *args], cwd=REPO, env=RESTARTABLE, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           start_new_session=True)
    try:
        metrics, deadline = run / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
            assert job.poll() is None and time.monotonic() < deadline, "no training step logged"
            time.sleep(0.01)
        workers = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True,
                                                      text=True, timeout=60).stdout.split()]
        for pid in workers:  # paused around the signal: it lands mid-run, whatever the machine's speed
            os.kill(pid, signal.SIGSTOP)
        os.killpg(job.pid, signal.SIGUSR1)
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.2)  # srun's SIGTERM once another node's launcher has exited 75: the stop goes on, still 75
        os.kill(job.pid, signal.SIGTERM)
        output, _ = job.communicate(timeout=120)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == EXIT_STOPPED, output[-3000:]
    stopped = STOPPED.findall(output)
    assert len(stopped) == 1 and stopped[0][1] == "SIGUSR1", output[-3000:]
    assert ("launch.py: SIGUSR1: the workers were asked to checkpoint their step and stop; continue with the same "
            "command and --resume auto (exit code 75)") in output
    run_script("train_ddp.py", *args, "--resume", "auto", ranks=2)
    assert_identical(weights_at(run, 10), weights_at(ddp_reference_run, 10))
    assert train_losses(run) == train_losses(ddp_reference_run)


def test_fsdp_stops_and_resumes_to_the_reference_weights(tiny_data, reference_run, tmp_path):
    # Checkpoints by the clock at every step besides: DCP's save is collective, so rank 0's clock must
    # decide for both ranks (a disagreement would hang). They are written asynchronously, each while the next
    # step runs (its collectives and the save's own, in a background thread, side by side).
    run = tmp_path / "run"
    args = tiny_args(tiny_data, run, *REFERENCE_STEPS, "--ckpt_every_minutes", "1e-9", "--ckpt_async", "true")
    step, checkpoint = stopped_at(stop_mid_run(["train_fsdp.py", *args], run, ranks=2, to_rank=1), "SIGTERM")
    assert checkpoint.is_dir()  # a DCP folder, complete
    assert len(list((run / "checkpoints").glob("step_*"))) == step  # one by the clock at each step
    run_script("train_fsdp.py", *args, "--resume", "auto", ranks=2)
    assert_same_weights(exported(run, 10)["model"], weights_at(reference_run, 10))
    torch.testing.assert_close(train_losses(run), train_losses(reference_run), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("script, layout", [("train_with_profiling.py", ()), ("train_mp.py", ("--tp", "2")),
                                            ("train_pp.py", ("--pp", "2", "--pp_microbatches", "2"))])
def test_every_other_script_stops_at_a_step_with_its_checkpoint(script, layout, vit_data, tmp_path):
    run = tmp_path / "run"
    ranks = 2 if layout else 1
    args = vit_args(vit_data, run, "--max_steps", "10", "--log_every", "1", "--val_every", "0", *layout)
    if script == "train_with_profiling.py":
        args += ["--profile", "false"]
    step, _ = stopped_at(stop_mid_run([script, *args], run, ranks=ranks, to_rank=ranks - 1), "SIGTERM")
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"][-1] == step


def test_checkpoints_by_the_clock_change_nothing_else(tiny_data, reference_run, tmp_path):
    run = tmp_path / "run"
    run_script("train.py", *tiny_args(tiny_data, run, *REFERENCE_STEPS, "--ckpt_every_minutes", "1e-9"),
               in_process=True)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*.pt")) == [f"step_{s:08d}.pt" for s in range(1, 11)]
    assert_identical(weights_at(run, 10), weights_at(reference_run, 10))


# ------------------------------------------------------------------ resumes a restarted job meets


def test_a_resume_with_other_model_settings_names_them(tiny_data, reference_run, tmp_path):
    run = resume_from(reference_run, 3, tmp_path / "run")
    proc = run_script("train.py", *tiny_args(tiny_data, run, "--resume", "--model_args.embed_dim", "24"),
                      in_process=True,
                      check=False)
    last = check_error(proc.returncode, proc.stderr, 2, "holds a model built with other settings: "
                       "model_args.embed_dim 24 "
                       "(checkpoint: 16); a resumed run must use the run's model settings")
    assert "step_00000003.pt" in last


def test_train_py_on_a_dcp_run_says_which_scripts_wrote_it_and_how_to_continue(tiny_data, tmp_path):
    run = tmp_path / "run"
    args = tiny_args(tiny_data, run, "--max_steps", "1", "--val_every", "0")
    run_script("train_fsdp.py", *args, ranks=2)
    for resume in ("true", "auto"):
        proc = run_script("train.py", *args, "--resume", resume, in_process=True, check=False)
        check_error(proc.returncode, proc.stderr, 2, "holds DCP checkpoint folders (step_00000001), which "
                    "train_fsdp.py, train_mp.py and train_pp.py write: resume with the script that wrote them, or "
                    f"turn the newest into this script's format: python -m utils.checkpoint.sharded export "
                    f"{run}/checkpoints/step_00000001 {run}/checkpoints/step_00000001.pt")


def test_resume_auto_starts_fresh_in_an_empty_folder_and_refuses_another_runs_folder(tiny_data, reference_run,
                                                                                     tmp_path):
    run = tmp_path / "run"
    proc = run_script("train.py", *tiny_args(tiny_data, run, "--max_steps", "1", "--resume", "auto"), in_process=True)
    assert "resumed from" not in proc.stdout and (run / "checkpoints" / "step_00000001.pt").exists()
    (run / "checkpoints" / "step_00000001.pt").unlink()  # outputs of a run, but no checkpoint
    proc = run_script("train.py", *tiny_args(tiny_data, run, "--max_steps", "1", "--resume", "auto"), in_process=True,
                      check=False)
    check_error(proc.returncode, proc.stderr, 2, "already holds another run")
    proc = run_script("train.py", *tiny_args(tiny_data, run, "--resume", "maybe"), in_process=True, check=False)
    check_error(proc.returncode, proc.stderr, 2, "resume: expected true, false or auto, got 'maybe'")


def test_resume_auto_sets_a_damaged_newest_checkpoint_aside_and_resume_true_refuses(tiny_data, reference_run,
                                                                                    tmp_path):
    # A job killed while the file system was failing may leave a newest checkpoint that does not load: a person
    # who asked for it (--resume true) is told; a self-requeueing chain (--resume auto) steps over it.
    run = resume_from(reference_run, 9, tmp_path / "run")
    newest = run / "checkpoints" / "step_00000010.pt"
    newest.write_bytes((reference_run / "checkpoints" / newest.name).read_bytes()[:4096])
    args = tiny_args(tiny_data, run, *REFERENCE_STEPS)
    proc = run_script("train.py", *args, "--resume", "true", in_process=True, check=False)
    check_error(proc.returncode, proc.stderr, 2, f"error: checkpoint {newest} is damaged (corrupt or truncated: "
                "RuntimeError): delete it and resume from the previous one (step_00000009.pt), or resume with "
                "--resume auto, which sets it aside itself")
    proc = run_script("train.py", *args, "--resume", "auto", in_process=True)
    assert (f"warning: checkpoint {newest} is damaged (corrupt or truncated: RuntimeError): set aside as "
            f"damaged-step_00000010.pt; resuming from the one before it\nresumed from {newest.parent}/step_00000009.pt "
            "at step 9\n") in proc.stdout, proc.stdout
    assert (run / "checkpoints" / "damaged-step_00000010.pt").stat().st_size == 4096  # kept, not deleted
    assert_identical(weights_at(run, 10), weights_at(reference_run, 10))


# ------------------------------------------------------------------ under torchrun: a lost rank (tests/test_hang.py)


RESTARTABLE = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # as the job script


def torchrun(*args: str, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            f"--max-restarts={max_restarts}", *args]


def test_bad_input_is_not_retried(tiny_data, tmp_path):
    # A batch the ranks cannot share: exit 2 on the first attempt, and torchrun is asked to stop, not to restart.
    proc = subprocess.run(torchrun("train_ddp.py", *tiny_args(tiny_data, tmp_path / "run", "--batch_size", "3"),
                                   max_restarts=3),
                          cwd=REPO, capture_output=True, text=True, timeout=180, env=RESTARTABLE)
    assert proc.returncode != 0
    assert (proc.stdout + proc.stderr).count("error: batch_size 3 is the global batch") == 1, proc.stderr[-4000:]


@pytest.mark.parametrize("args, message", [
    (["--nproc-per-node", "2", "no_such_script.py"], "no_such_script.py: no such script"),
    (["--nproc-per-node", "x", "train_ddp.py"], "--nproc-per-node x: Unsupported nproc_per_node value"),
    ([], "the following arguments are required: training_script"),
])
def test_launch_bad_input_is_one_line(args, message, capsys):
    # Through run_cli, as the training scripts: not torchrun's usage block, traceback, or a report per worker.
    code, err = exit_in_one_process(capsys, "launch.py", *args)
    assert code == 2 and len(err) == 1 and message in err[0], err
