"""A hang always ends: a rank that stops answering anywhere in a step ends the others within 2 x dist_timeout_s.

A rank is frozen (tests/freeze_at.py) inside the forward, the backward (DDP's all-reduce, FSDP2's
reduce-scatter, tensor/context parallel collectives, a pipeline's receive), the optimizer step or a checkpoint
write (single-file, DCP, DCP in the background). The live ranks end with one line naming the wait and the
rank that did not arrive, and under `torchrun --max-restarts` the run goes on to the weights of an
uninterrupted run. A wait that ignores its timeout (here: a rank sleeping in Python, or in a C call that holds
Python's lock) is ended by the step watchdog at 1.5 (its thread) or 1.9 x dist_timeout_s (faulthandler).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REFERENCE_STEPS, REPO, _free_port, tiny_args, vit_args, weights_at
from tests.test_ddp import assert_same_weights, train_losses
from tests.test_fsdp import exported

TIMEOUT_S = 5
ENDED = re.compile(r"\[rank (\d)\] error: (.+?) (timed out after 5 s|has not returned for \d+ s \(1.5 x "
                   r"--dist_timeout_s 5\))(: rank (\d) did not arrive)?; ")


def children(pid: int) -> dict[int, str]:
    """{pid: state} of the processes whose parent is ``pid`` (state "T": stopped)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
            if int(ppid) == pid:
                found[int(entry.name)] = state
    return found


def freezing(specs: list[str], script: str, *args: str) -> list[str]:
    return [sys.executable, "tests/freeze_at.py", *[a for spec in specs for a in ("--freeze", spec)], script, *args]


def run_frozen(specs: list[str], script: str, *args: str, ranks: int = 2, timeout: float = 120):
    """The ranks started directly (as tests/conftest.py's run_script does), one of them frozen per ``specs``:
    (each rank's exit code, None for one left stopped; the output; seconds from the freeze to the end of the
    last rank that ended on its own)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks)}
    with tempfile.TemporaryFile("w+") as out:
        procs = [subprocess.Popen(freezing(specs, script, *args), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                  env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(ranks)]
        deadline, frozen_at, ended_at = time.monotonic() + timeout, None, None
        try:
            while True:
                states = children(os.getpid())
                said = Path(f"/proc/self/fd/{out.fileno()}").read_text()  # a description of its own: no seek
                if frozen_at is None and "freeze_at:" in said:
                    frozen_at = time.monotonic()
                running = [p for p in procs if p.poll() is None and states.get(p.pid) != "T"]
                if not running:
                    break
                assert time.monotonic() < deadline, "the ranks did not end"
                time.sleep(0.02)
            ended_at = time.monotonic()
        finally:
            codes = [p.poll() for p in procs]
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=60)
        out.seek(0)
        return codes, out.read(), ended_at - frozen_at


@pytest.mark.parametrize("script, layout, spec", [
    ("train_mp.py", ("--tp", "2"), "0:1:forward:3"),  # the tensor-parallel collectives of the forward
    ("train_mp.py", ("--cp", "2"), "0:1:backward:3"),  # context parallel's reduce-scatter of dK/dV
    ("train_pp.py", ("--pp", "2", "--pp_microbatches", "2"), "0:1:backward:3"),  # a stage's receive
])
def test_a_rank_frozen_in_a_model_parallel_step_is_named_within_the_bound(script, layout, spec, vit_data, tmp_path):
    args = vit_args(vit_data, tmp_path / "run", "--max_steps", "50", "--log_every", "1", "--val_every", "0",
                    "--dist_timeout_s", str(TIMEOUT_S), *layout)
    codes, output, took = run_frozen([spec], script, *args)
    assert codes == [1, None] and took < 2 * TIMEOUT_S, (took, output[-3000:])
    lines = ENDED.findall(output)
    assert len(lines) == 1 and lines[0][0] == "0" and lines[0][4] == "1" and "Traceback" not in output, output[-3000:]


@pytest.mark.parametrize("how", ["sleep", "hold"])
def test_a_wait_that_never_returns_ends_its_rank(how, tiny_data, tmp_path):
    # Rank 0 waits forever outside any collective: in Python in its forward (the watchdog's thread ends it at 1.5 x
    # the timeout, with its line), or in a C call that holds Python's lock in its optimizer step (faulthandler
    # ends it at 1.9 x, with the stacks). Rank 1, in a collective that honours its timeout, ends at 1 x and names
    # rank 0.
    run = tmp_path / "run"
    args = tiny_args(tiny_data, run, "--max_steps", "50", "--log_every", "1", "--val_every", "0",
                     "--dist_timeout_s", str(TIMEOUT_S))
    point = "forward" if how == "sleep" else "optimizer"
    codes, output, took = run_frozen([f"0:0:{point}:3:{how}"], "train_ddp.py", *args)
    assert codes == [1, 1] and took < 2 * TIMEOUT_S, (took, output[-3000:])
    lines = {rank: (where, why, missing) for rank, where, why, _, missing in ENDED.findall(output)}
    assert lines["1"][1] == "timed out after 5 s" and lines["1"][2] == "0", output[-3000:]
    stacks = (run / "stacks" / "rank0.txt").read_text()
    assert "freeze_at.py" in stacks and "train_ddp.py" in stacks, stacks
    if how == "sleep":
        assert re.fullmatch(r"a wait \(tests/freeze_at.py:\d+: time.sleep\(10\*\*6\)\)", lines["0"][0]), output[-3000:]
    else:  # no Python ran in that process: the stacks are faulthandler's, and its exit code
        assert "0" not in lines and stacks.startswith("Timeout (0:00:09.500000)!"), stacks[:300]


# ------------------------------------------------------------------ under torchrun --max-restarts


# As the job script sets it: each attempt's store is hosted by its rank 0, so a frozen rank 0 freezes the store too
# (a request to it is not bounded by the store's timeout: utils/stopping.py bounds it).
RESTARTABLE = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.mark.parametrize("script, specs, extra", [
    # DDP: a rank killed in the backward (its peer's all-reduce fails at once), then the store's host, rank 0,
    # frozen in torch.save after the restart
    ("train_ddp.py", ["0:1:backward:4:kill", "1:0:checkpoint:3"], ()),
    # FSDP2: the store's host frozen in the backward's reduce-scatter before any restart, then the other rank
    # inside a DCP shard write in the background (a save at every step: the one two steps before the freeze is
    # then surely complete, as the next save waits for it)
    ("train_fsdp.py", ["0:0:backward@12:5", "1:1:checkpoint:3"], ("--ckpt_async", "true", "--ckpt_every", "1")),
])
def test_frozen_ranks_are_restarted_and_the_run_ends_at_the_uninterrupted_weights(script, specs, extra, tiny_data,
                                                                                   reference_run, ddp_reference_run,
                                                                                   tmp_path):
    run = tmp_path / "run"
    args = tiny_args(tiny_data, run, *REFERENCE_STEPS, "--dist_timeout_s", str(TIMEOUT_S), "--resume", "auto", *extra)
    log = open(tmp_path / "job.log", "w+")  # a file, not a pipe: nobody reads until the end, and a full pipe blocks
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            f"--max-restarts={len(specs)}", *freezing(specs, script, *args)[1:]],
                           cwd=REPO, env=RESTARTABLE, text=True, stdout=log, stderr=subprocess.STDOUT)
    took, frozen = [], {}
    try:
        deadline = time.monotonic() + 300
        while job.poll() is None:
            assert time.monotonic() < deadline, "the job did not end"
            workers = children(job.pid)
            for pid, state in workers.items():
                if state == "T":
                    frozen.setdefault(pid, time.monotonic())
            for pid, since in list(frozen.items()):
                if pid in workers and not set(workers) - set(frozen):  # the live ranks have ended: torchrun would
                    took.append(time.monotonic() - since)  # now wait 30 s before its SIGKILL: send it now
                    os.kill(pid, signal.SIGKILL)
                    del frozen[pid]
            time.sleep(0.02)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=60)
        log.seek(0)
        output = log.read()
        log.close()
    assert job.returncode == 0, output[-4000:]
    assert len(took) == sum(not spec.endswith(":kill") for spec in specs) and max(took) < 2 * TIMEOUT_S, took
    assert len(re.findall(r"resumed from \S+ at step \d+", output)) == len(specs), output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    for frozen_rank, line in zip([s.split(":")[1] for s in specs if not s.endswith(":kill")],
                                 [m for m in ENDED.findall(output)][-len(took):]):
        assert line[4] == frozen_rank, line  # the live rank names the frozen one
    if script == "train_ddp.py":  # bit for bit, as any resume of train_ddp.py
        assert all(torch.equal(a, b) for a, b in zip(weights_at(run, 10).values(),
                                                     weights_at(ddp_reference_run, 10).values()))
    else:  # within the fp32 tolerance of the equivalence tests, as an uninterrupted train_fsdp.py run
        assert_same_weights(exported(run, 10)["model"], weights_at(reference_run, 10))
    assert len(train_losses(run)) >= 10
