"""train_ddp.py under torchrun on CPU (gloo): equals one device, resumes across world sizes, fails fast."""

import json
import os
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch

from tests.conftest import REFERENCE_STEPS as STEPS
from tests.conftest import REPO, read_metrics, resume_from, run_script, tiny_args, weights_at

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def assert_same_weights(a: dict, b: dict, atol: float = 2e-5) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=atol, msg=key)


def train_losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if r["kind"] == "train"]


def rank_indices(cfg, rank: int, world: int, epoch: int) -> list[int]:
    from utils.data import build_loaders

    loader, _ = build_loaders(cfg, rank, world)
    loader.sampler.set_epoch(epoch)
    return list(loader.sampler)


def test_ranks_see_disjoint_samples_that_change_every_epoch(tiny_data):
    from utils.config import build_config

    cfg = build_config("quickstart", {"data_dir": str(tiny_data), "crop_size": 32, "n_patches": 2,
                                      "batch_size": 4, "num_workers": 0})
    for epoch in (0, 1):
        r0, r1 = rank_indices(cfg, 0, 2, epoch), rank_indices(cfg, 1, 2, epoch)
        assert r0 and r1 and not set(r0) & set(r1), f"ranks overlap in epoch {epoch}"
    assert rank_indices(cfg, 0, 2, 0) != rank_indices(cfg, 0, 2, 1), "same order every epoch: set_epoch ignored"


def launch_beside_reference(script: str, name: str, tiny_data, reference_run, tmp_path_factory) -> dict:
    """``script`` on 2 ranks with the reference's arguments (same global batch and seed):
    {"single": the session's train.py reference run, name: this run's folder}."""
    run = tmp_path_factory.mktemp(f"{name}_runs") / name
    proc = run_script(script, *tiny_args(tiny_data, run, *STEPS), ranks=2)
    assert "world_size=2 nodes=1 backend=gloo" in proc.stdout
    return {"single": reference_run, name: run}


@pytest.fixture(scope="module")
def runs(reference_run, ddp_reference_run):
    """Shared by several tests because torchrun's start-up dominates their time."""
    return {"single": reference_run, "ddp": ddp_reference_run}


def test_two_ranks_equal_one_device(runs):
    single, ddp = runs["single"], runs["ddp"]
    for step in (3, 10):
        assert_same_weights(weights_at(single, step), weights_at(ddp, step))
    torch.testing.assert_close(train_losses(ddp), train_losses(single), rtol=1e-4, atol=1e-5)
    val_single = [r for r in read_metrics(single) if r["kind"] == "val"][-1]
    val_ddp = [r for r in read_metrics(ddp) if r["kind"] == "val"][-1]
    torch.testing.assert_close(val_ddp["rmse"], val_single["rmse"], rtol=1e-4, atol=1e-5)
    assert val_ddp["bicubic_rmse"] == pytest.approx(val_single["bicubic_rmse"], rel=1e-6)


def test_no_ddp_really_skips_the_all_reduce():
    # The overhead benchmark's no_ddp variant (run end to end by tests/test_readme.py): the model stays
    # unwrapped, so no DDP hook averages the gradients; without it DDP wraps the model.
    from torch.nn.parallel import DistributedDataParallel

    from utils.config import build_config
    from utils.parallel.techniques import apply_ddp

    model = torch.nn.Linear(2, 2)
    assert apply_ddp(model, build_config("quickstart", {"no_ddp": True}), torch.device("cpu")) is model
    with mock.patch.object(DistributedDataParallel, "__init__", return_value=None) as wrap:
        wrapped = apply_ddp(model, build_config("quickstart"), torch.device("cpu"))
    assert isinstance(wrapped, DistributedDataParallel) and wrap.call_args.args == (model,)


def test_overhead_benchmark_alternates_variants_and_flags_noise(monkeypatch, capsys):
    import benchmarks.bench_ddp_overhead as bench

    measured = iter([10.0, 12.0, 11.0, 12.5, 9.0, 11.5])  # ddp, no_ddp, ddp, ...
    variants = []

    def fake_samples_per_sec(nproc, train_args, no_ddp):
        variants.append(no_ddp)
        return next(measured)

    monkeypatch.setattr(bench, "samples_per_sec", fake_samples_per_sec)
    monkeypatch.setattr(sys, "argv", ["bench_ddp_overhead.py", "--repeats", "3", "--", "--config", "quickstart"])
    bench.main()
    out = capsys.readouterr().out
    assert variants == [False, True] * 3
    # Medians 10 (ddp) and 12 (no_ddp): +20%; ddp's own runs differ by 11/9 - 1 = 22%, more than that.
    assert "DDP overhead: +20.0% time per step" in out
    assert "below this machine's noise: runs of the same variant differ by up to 22%" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"ddp_samples_per_sec": 10.0, "no_ddp_samples_per_sec": 12.0, "overhead": pytest.approx(0.2)}


@pytest.mark.cuda
@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp.py"])
def test_one_gpu_rank_runs_on_nccl(script, tiny_data, tmp_path):
    """What torchrun --nproc-per-node 1 starts on a GPU node: the nccl backend, a finite loss, a checkpoint."""
    run = tmp_path / "run"
    proc = run_script(script, *tiny_args(tiny_data, run, "--max_steps", "2", "--log_every", "1"), ranks=1)
    assert "world_size=1 nodes=1 backend=nccl" in proc.stdout
    losses = train_losses(run)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert list((run / "checkpoints").iterdir())


def test_ddp_checkpoint_resumes_on_one_device(runs, tiny_data, tmp_path):
    moved = resume_from(runs["ddp"], 3, tmp_path / "moved")
    proc = run_script("train.py", *tiny_args(tiny_data, moved, *STEPS, "--max_steps", "6", "--resume"), in_process=True)
    assert "resumed from" in proc.stdout and "step_00000003.pt" in proc.stdout
    assert_same_weights(weights_at(runs["single"], 6), weights_at(moved, 6))


def test_one_device_checkpoint_resumes_in_compiled_ddp(runs, tiny_data, tmp_path):
    # Also the order apply_ac -> apply_compile -> apply_ddp on 2 CPU ranks: compiled blocks under DDP
    # must continue eager train.py's trajectory. aot_eager traces what inductor would (dynamo, AOT
    # autograd, DDP's graph splitting) without generating CPU kernels, which GPUs do not use anyway.
    moved = resume_from(runs["single"], 3, tmp_path / "moved")
    proc = run_script("train_ddp.py", *tiny_args(tiny_data, moved, *STEPS, "--max_steps", "6", "--resume",
                                                 "--compile", "true", "--compile_backend", "aot_eager"), ranks=2)
    assert "resumed from" in proc.stdout and "step_00000003.pt" in proc.stdout
    assert_same_weights(weights_at(runs["single"], 6), weights_at(moved, 6))


def test_resume_with_stochastic_depth_on_two_ranks_is_exact(tiny_data, tmp_path):
    # Each rank draws its own drop-path masks from (seed, step, rank): nothing rank-specific needs
    # saving, and the resumed run repeats the uninterrupted one.
    common = (*STEPS, "--max_steps", "6", "--model_args.drop_path_rate", "0.5")
    reference = tmp_path / "reference"
    run_script("train_ddp.py", *tiny_args(tiny_data, reference, *common), ranks=2)
    resumed = resume_from(reference, 3, tmp_path / "resumed")
    run_script("train_ddp.py", *tiny_args(tiny_data, resumed, *common, "--resume"), ranks=2)
    a, b = weights_at(reference, 6), weights_at(resumed, 6)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"
    assert train_losses(resumed) == train_losses(reference)[3:]


def test_one_rank_dying_ends_the_job_quickly(tiny_data, tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen([*TORCHRUN, "train_ddp.py", *tiny_args(tiny_data, run, "--max_steps", "100000",
                                                                   "--log_every", "1")],
                           cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().strip()):
            assert job.poll() is None and time.time() < deadline, "training never started"
            time.sleep(0.2)
        victim = rank_pid(job.pid, rank=1)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        job.wait(timeout=60)
        assert job.returncode != 0
        assert time.time() - killed_at < 60
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=60)


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of the worker with RANK=rank among torchrun's children (read from /proc)."""
    children = subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True,
                              timeout=60).stdout.split()
    for pid in map(int, children):
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {torchrun_pid}")
