"""train_ddp.py under torchrun on CPU (gloo): equals one device, resumes across world sizes, fails fast."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO, run_script, tiny_args
from tests.test_train import final_weights, read_metrics

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


def test_two_ranks_equal_one_device(tiny_data, tmp_path):
    # Same global batch (4) and seed: 2 ranks x 2 samples must follow the single process's trajectory,
    # across an epoch boundary (8 steps per epoch).
    steps = ("--max_steps", "10", "--log_every", "1")
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    run_script("train.py", *tiny_args(tiny_data, single, *steps))
    proc = run_script("train_ddp.py", *tiny_args(tiny_data, ddp, *steps), launcher=TORCHRUN)
    assert "world_size=2 nodes=1 backend=gloo" in proc.stdout
    assert_same_weights(final_weights(single), final_weights(ddp))
    torch.testing.assert_close(train_losses(ddp), train_losses(single), rtol=1e-4, atol=1e-5)
    val_single = [r for r in read_metrics(single) if r["kind"] == "val"][-1]
    val_ddp = [r for r in read_metrics(ddp) if r["kind"] == "val"][-1]
    torch.testing.assert_close(val_ddp["rmse"], val_single["rmse"], rtol=1e-4, atol=1e-5)
    assert val_ddp["bicubic_rmse"] == pytest.approx(val_single["bicubic_rmse"], rel=1e-6)


def test_compiled_blocks_under_ddp_equal_one_eager_device(tiny_data, tmp_path):
    # The order apply_ac -> apply_compile -> apply_ddp, with inductor on 2 CPU ranks.
    single, compiled = tmp_path / "single", tmp_path / "compiled"
    run_script("train.py", *tiny_args(tiny_data, single, "--max_steps", "3"))
    run_script("train_ddp.py", *tiny_args(tiny_data, compiled, "--max_steps", "3", "--compile", "true"),
               launcher=TORCHRUN)
    assert_same_weights(final_weights(single), final_weights(compiled))


def test_no_ddp_really_skips_the_all_reduce(tiny_data, tmp_path):
    # Without gradient averaging each rank steps on its own half-batch: weights must differ from one device.
    single, no_ddp = tmp_path / "single", tmp_path / "no_ddp"
    run_script("train.py", *tiny_args(tiny_data, single, "--max_steps", "3"))
    run_script("train_ddp.py", *tiny_args(tiny_data, no_ddp, "--max_steps", "3", "--no_ddp"), launcher=TORCHRUN)
    a, b = final_weights(single), final_weights(no_ddp)
    assert any(not torch.allclose(a[k], b[k], atol=1e-4) for k in a if a[k].is_floating_point())


@pytest.mark.parametrize("first, second", [("ddp", "single"), ("single", "ddp")])
def test_checkpoint_moves_between_world_sizes(tiny_data, tmp_path, first, second):
    launch = {"ddp": ("train_ddp.py", TORCHRUN), "single": ("train.py", None)}
    common = ("--ckpt_every", "3", "--keep_checkpoints", "10")
    reference = tmp_path / "reference"
    run_script("train.py", *tiny_args(tiny_data, reference, "--max_steps", "6", *common))
    moved = tmp_path / "moved"
    script, launcher = launch[first]
    run_script(script, *tiny_args(tiny_data, moved, "--max_steps", "3", *common), launcher=launcher)
    script, launcher = launch[second]
    proc = run_script(script, *tiny_args(tiny_data, moved, "--max_steps", "6", *common, "--resume"),
                      launcher=launcher)
    assert "resumed from" in proc.stdout and "step_00000003.pt" in proc.stdout
    assert_same_weights(final_weights(reference), final_weights(moved))


def test_resume_with_stochastic_depth_on_two_ranks_is_exact(tiny_data, tmp_path):
    # Each rank draws its own drop-path masks from (seed, step, rank): nothing rank-specific needs
    # saving, and the resumed run repeats the uninterrupted one.
    common = ("--drop_path_rate", "0.5", "--ckpt_every", "3", "--keep_checkpoints", "10")
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_script("train_ddp.py", *tiny_args(tiny_data, reference, "--max_steps", "6", *common), launcher=TORCHRUN)
    run_script("train_ddp.py", *tiny_args(tiny_data, resumed, "--max_steps", "3", *common), launcher=TORCHRUN)
    run_script("train_ddp.py", *tiny_args(tiny_data, resumed, "--max_steps", "6", *common, "--resume"),
               launcher=TORCHRUN)
    a, b = final_weights(reference), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed weights differ"


def test_overhead_benchmark_prints_both_variants(tiny_data, tmp_path):
    import json

    train_args = tiny_args(tiny_data, tmp_path / "unused", "--max_steps", "6", "--log_every", "2")
    at = train_args.index("--run_dir")
    del train_args[at:at + 2]  # the benchmark gives each run its own temporary run_dir
    proc = run_script("benchmarks/bench_ddp_overhead.py", "--nproc", "2", "--repeats", "1", "--", *train_args)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ddp_samples_per_sec"] > 0 and result["no_ddp_samples_per_sec"] > 0
    assert result["overhead"] == pytest.approx(result["no_ddp_samples_per_sec"] / result["ddp_samples_per_sec"] - 1)


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
            job.wait()


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of the worker with RANK=rank among torchrun's children (read from /proc)."""
    children = subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split()
    for pid in map(int, children):
        environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker with RANK={rank} under torchrun pid {torchrun_pid}")
