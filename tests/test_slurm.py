"""The SLURM scripts, submitted with sbatch to a real SLURM cluster of two emulated nodes on this host
(tests/slurm_cluster.py). The nodes have no GPU, so jobs run CPU processes with gloo."""

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, VIT_STEPS, read_metrics, run_script, tiny_args, vit_args, weights_at
from tests import slurm_cluster as cluster_module
from tests.slurm_cluster import skip_or_fail, slurm_cluster  # noqa: F401  (slurm_cluster is a fixture)
from tests.test_comm_check import assert_complete_correct_table
from tests.test_ddp import assert_same_weights, train_losses
from tests.test_fsdp import exported

# The emulated nodes have no GPU: ask for none, which makes submit_multinode.sh fall back to gloo on CPU.
CPU_NODES = ["--gpus-per-node=0"]
SCRIPTS = ["submit_singlegpu.sh", "submit_multinode.sh", "tests/install_slurm.sh"]


def job_env() -> dict:
    """The jobs use the Python environment running these tests (CI: the checkout's .venv)."""
    in_venv = sys.prefix != sys.base_prefix
    return {"PYTHON_ENV": sys.prefix if in_venv else "", "PYTHONUNBUFFERED": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        skip_or_fail("shellcheck is not installed (Debian package shellcheck; tests/install_slurm.sh installs it)")
    proc = subprocess.run([shellcheck, *SCRIPTS], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_without_root_the_cluster_tests_skip_but_fail_under_ci(monkeypatch):
    monkeypatch.setattr(cluster_module.os, "geteuid", lambda: 1000)
    reason = cluster_module.unavailable_reason()
    assert reason and "needs root" in reason
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        skip_or_fail(reason)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        skip_or_fail(reason)


def test_comm_check_runs_on_two_nodes(slurm_cluster):
    job = slurm_cluster.sbatch("submit_multinode.sh", "comm_check.py", "--max-bytes", "4MiB",
                               "--seconds-per-size", "0.1", options=CPU_NODES, env=job_env())
    assert job.returncode == 0, job.report
    assert "2 nodes (n[1-2]) x 2 processes, 0 GPUs per node" in job.output, job.report
    assert "world_size=4 nodes=2" in job.output, job.report
    # torchrun numbers the nodes in the order they join the rendezvous: n1 is not always node 0.
    assert sorted(re.findall(r"#   node [01]: (n[12]) ", job.output)) == ["n1", "n2"], job.report
    assert_complete_correct_table(job.output, 4 * 2**20, world_size=4)


def test_ddp_training_on_two_nodes(slurm_cluster, tiny_data, tmp_path):
    run = tmp_path / "run"
    job = slurm_cluster.sbatch("submit_multinode.sh", "train_ddp.py", *tiny_args(tiny_data, run, "--max_steps", "4"),
                               options=CPU_NODES, env=job_env(), timeout=300)
    assert job.returncode == 0, job.report
    assert "world_size=4 nodes=2" in job.output, job.report
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train and train[-1]["step"] == 4 and train[-1]["loss"] > 0, records


def assert_trains_as_one_device(slurm_cluster, script: str, flags: list[str], banner: str, vit_data, vit_reference,
                                run) -> None:
    """``script`` with ``flags`` as a 2-node job of the miniature ViT for 4 steps: it succeeds, prints ``banner``,
    and its losses are the first 4 of train.py on one process."""
    job = slurm_cluster.sbatch("submit_multinode.sh", script, *vit_args(vit_data, run, *VIT_STEPS, *flags,
                                                                        "--max_steps", "4"),
                               options=CPU_NODES, env=job_env(), timeout=300)
    assert job.returncode == 0, job.report
    assert banner in job.output, job.report
    losses = [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]
    reference = [r["loss"] for r in read_metrics(vit_reference) if r["kind"] == "train"][:4]
    assert losses == pytest.approx(reference, rel=1e-4)


def test_model_parallel_job_on_two_nodes_trains_as_one_device(slurm_cluster, vit_data, vit_reference, tmp_path):
    # 2 nodes x 2 ranks, --tp 2: each tensor-parallel pair inside a node (consecutive ranks), data parallel
    # across the nodes; the first 4 losses are those of train.py on one process.
    assert_trains_as_one_device(slurm_cluster, "train_mp.py", ["--tp", "2"],
                                "world_size=4 nodes=2 backend=gloo | mesh dp 2 x cp 1 x tp 2",
                                vit_data, vit_reference, tmp_path / "run")


def test_pipeline_job_on_two_nodes_trains_as_one_device(slurm_cluster, vit_data, vit_reference, tmp_path):
    # 2 nodes x 2 ranks, --pp 2: a 2-stage pipeline inside each node, FSDP2 across the nodes (dp 2); the
    # first 4 losses are those of train.py on one process.
    assert_trains_as_one_device(slurm_cluster, "train_pp.py", ["--pp", "2", "--pp_microbatches", "2"],
                                "world_size=4 nodes=2 backend=gloo | mesh dp 2 x pp 2",
                                vit_data, vit_reference, tmp_path / "run")


def test_singlegpu_passes_arguments_through(slurm_cluster, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import json, sys\nprint('ARGS=' + json.dumps(sys.argv[1:]))\nprint('PYTHON=' + sys.prefix)\n")
    job = slurm_cluster.sbatch("submit_singlegpu.sh", str(probe), "--config", "two words", "*",
                               options=[*CPU_NODES, "--cpus-per-task=1"], env=job_env(), timeout=60)
    assert job.returncode == 0, job.report
    assert 'ARGS=["--config", "two words", "*"]' in job.output, job.report
    assert f"PYTHON={sys.prefix}" in job.output, job.report


def test_a_failing_rank_fails_the_job_instead_of_hanging(slurm_cluster, tmp_path):
    # Rank 2 dies while the others wait for it in init_process_group: the job must end, and fail.
    script = tmp_path / "rank2_dies.py"
    script.write_text("import datetime, os, sys\n"
                      "if os.environ['RANK'] == '2':\n"
                      "    sys.exit(3)\n"
                      "import torch.distributed as dist\n"
                      "dist.init_process_group('gloo', timeout=datetime.timedelta(seconds=300))\n")
    job = slurm_cluster.sbatch("submit_multinode.sh", str(script), options=CPU_NODES, env=job_env(), timeout=120)
    assert job.returncode != 0, job.report


@pytest.mark.parametrize("script, settings, message", [
    ("no_such_script.py", {}, "error: no_such_script.py not found"),
    ("comm_check.py", {"PYTHON_ENV": "/no/such/env"}, "PYTHON_ENV=/no/such/env"),
    ("comm_check.py", {"SITE": "mars"}, "error: SITE=mars is not one of kestrel, perlmutter, generic"),
])
def test_bad_settings_are_clear_errors(slurm_cluster, script, settings, message):
    job = slurm_cluster.sbatch("submit_multinode.sh", script, options=CPU_NODES, env={**job_env(), **settings},
                               timeout=60)
    assert job.returncode == 2 and message in job.output, job.report


def test_impossible_request_fails_at_submission(slurm_cluster):
    job = slurm_cluster.sbatch("submit_multinode.sh", "comm_check.py", options=[*CPU_NODES, "--nodes=3"],
                               env=job_env(), timeout=30)
    assert job.returncode != 0 and job.job_id is None, job.report


# ------------------------------------------------------------------ long runs: the time limit and requeue

LONG_RUN = ("--max_steps", "40", "--log_every", "1", "--val_every", "0", "--ckpt_every", "0", "--num_workers", "1")


def release_requeued_job(client: dict, job_id: str) -> None:
    """Start a requeued job now instead of after SLURM's hold of about two minutes. The hold exists because
    every node refuses a job whose launch credential is no newer, in whole seconds, than the moment the node
    revoked that job's previous credential ("Job credential revoked"): wait until the nodes have cleaned up
    the previous segment, then for the next second, before letting the job start."""
    deadline = time.monotonic() + 60
    while subprocess.run(["sinfo", "--noheader", "--format=%T"], env=client, capture_output=True, text=True,
                         timeout=30).stdout.split() != ["idle"]:
        assert time.monotonic() < deadline, f"the nodes of job {job_id} did not become idle after its requeue"
        time.sleep(0.2)
    time.sleep(1.1)
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=client, timeout=30)


def submit_and_signal_usr1(slurm_cluster, script: str, run: Path, args: list[str], env: dict,
                           options=(), to_batch_shell: bool = True) -> tuple[str, str]:
    """Submit ``script`` and, once the run has logged a training step, send the batch shell SIGUSR1 as
    ``sbatch --signal=B:USR1@LEAD`` does before the time limit (``to_batch_shell=False``: every process of the
    job's steps instead, as ``--signal=USR1@LEAD`` without ``B:`` does). A job that requeues itself is made eligible
    at once (SLURM holds a requeued job back for about two minutes). Returns the job's final state
    (COMPLETED, FAILED, ...) and its output, every segment's (the job scripts append)."""
    client = slurm_cluster.client_env()
    first = threading.Thread(target=lambda: slurm_cluster.sbatch(script, *args, options=[*CPU_NODES, *options],
                                                                 env=env, timeout=300))
    first.start()  # sbatch --wait returns when the first segment ends; the job is followed below
    metrics, deadline = run / "metrics.jsonl", time.monotonic() + 300
    while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
        assert first.is_alive() and time.monotonic() < deadline, "the job logged no training step"
        time.sleep(0.05)
    job_id = subprocess.run(["squeue", "--noheader", "--format=%i"], env=client, capture_output=True, text=True,
                            timeout=30).stdout.split()[0]
    subprocess.run(["scancel", *(["--batch"] if to_batch_shell else []), "--signal=USR1", job_id], env=client,
                   check=True, timeout=30)
    state, output, ended = "UNKNOWN", None, None
    while time.monotonic() < deadline:
        show = subprocess.run(["scontrol", "show", "job", job_id], env=client, capture_output=True, text=True,
                              timeout=30).stdout
        fields = dict(re.findall(r"(\w+)=(\S+)", show))
        if not fields:  # the record is gone (MinJobAge after the end)
            break
        state, output = fields.get("JobState", state), fields.get("StdOut", output)
        if state == "PENDING" and fields.get("Restarts") == "1" and fields.get("Reason") == "BeginTime":
            release_requeued_job(client, job_id)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            ended = state if ended == state else None  # a requeue passes through an end state: seen twice
            if ended:
                break
            time.sleep(2.0)  # within MinJobAge (4 s): an ended job's record is still there
            continue
        ended = None
        time.sleep(0.3)
    first.join()
    assert state != "UNKNOWN" and output, f"job {job_id} not followed to its end"
    return state, Path(output).read_text(errors="replace")


@pytest.mark.parametrize("script, extra, to_batch_shell", [("train_ddp.py", (), True),
                                                            ("train_fsdp.py", ("--ckpt_async", "true"), False)])
def test_a_job_stopped_before_its_time_limit_requeues_itself_and_ends_as_one_run(slurm_cluster, tiny_data, tmp_path,
                                                                                  script, extra, to_batch_shell):
    # 2 nodes x 2 ranks: SIGUSR1 -> every rank checkpoints the same step and stops -> the job requeues itself ->
    # the same job continues from that checkpoint (--resume auto, added by the job script) to the weights of an
    # uninterrupted train.py run. train_fsdp.py writes its DCP checkpoints in the background (--ckpt_async), and
    # gets the signal as --signal=USR1@N without B: sends it: to torchrun (launch.py) and its workers.
    reference, run = tmp_path / "reference", tmp_path / "run"
    run_script("train.py", *tiny_args(tiny_data, reference, *LONG_RUN), in_process=True)
    state, output = submit_and_signal_usr1(slurm_cluster, "submit_multinode.sh", run,
                                           [script, *tiny_args(tiny_data, run, *LONG_RUN, *extra)], job_env(),
                                           to_batch_shell=to_batch_shell)
    assert state == "COMPLETED", output[-6000:] + slurm_cluster.log_tail(40)
    stop = re.search(rf"stopped at step (\d+) by {'SIGTERM' if to_batch_shell else 'SIGUSR1'}: checkpoint (\S+);",
                     output)
    assert stop and ("SIGUSR1 received" in output) == to_batch_shell, output[-6000:]
    # The job script told the run its time limit (30 minutes, submit_multinode.sh's #SBATCH --time).
    left = re.search(r"; the stop took [\d.]+ s of the (\d+) s left before the job's time limit", output)
    assert left and 1500 < int(left[1]) <= 1800, output[-6000:]
    assert "requeued (segment 2)" in output, output[-6000:]
    assert f"resumed from {stop.group(2)} at step {stop.group(1)}" in output, output[-6000:]
    assert "done: 40 steps" in output, output[-6000:]
    weights = exported(run, 40)["model"] if script == "train_fsdp.py" else weights_at(run, 40)
    assert_same_weights(weights, weights_at(reference, 40))
    torch.testing.assert_close(train_losses(run), train_losses(reference), rtol=1e-4, atol=1e-5)


def test_the_requeue_cap_ends_the_job_with_one_line(slurm_cluster, tiny_data, tmp_path):
    # One process (submit_singlegpu.sh), MAX_REQUEUES=0: the run still checkpoints and stops, the job does not
    # come back, and says so.
    run = tmp_path / "run"
    state, output = submit_and_signal_usr1(slurm_cluster, "submit_singlegpu.sh", run,
                                           ["train.py", *tiny_args(tiny_data, run, *LONG_RUN)],
                                           {**job_env(), "MAX_REQUEUES": "0"}, options=["--cpus-per-task=1"])
    assert state == "FAILED", output[-6000:]
    assert re.search(r"stopped at step \d+ by SIGTERM: checkpoint \S+step_\d+\.pt", output), output[-6000:]
    assert re.search(r"error: job \d+ reached its time limit 1 times \(MAX_REQUEUES=0\): not requeued; submit it "
                     r"again to continue \(the run resumes from its newest checkpoint\)", output), output[-6000:]
