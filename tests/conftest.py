"""Shared fixtures: a tiny synthetic data set and a runner for the project's scripts."""

import json
import os
import random
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from utils.checkpoint.files import latest_checkpoint  # noqa: E402
from utils.checkpoint.single import load_checkpoint  # noqa: E402
from utils.parallel.distributed import cleanup_distributed  # noqa: E402

def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device, skipped without one (tests/gpu_check.py runs these "
                                       "on a GPU: python -m pytest -m cuda)")


def pytest_collection_modifyitems(config, items):
    """Tests marked cuda skip where there is no GPU, with one reason; they are not CPU coverage."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (tests/gpu_check.py runs it on a GPU)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


# A SwinIR small enough to train a few steps in seconds on 2 cores; tests add it to script calls.
TINY_MODEL = ["--model_args", "{depths: [2], num_heads: [2], embed_dim: 16, drop_path_rate: 0, window_size: 8}",
              "--img_size", "16"]


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
    run_script("train.py", *tiny_args(tiny_data, run, *REFERENCE_STEPS), in_process=True)
    return run


@pytest.fixture(scope="session")
def ddp_reference_run(tiny_data, tmp_path_factory) -> Path:
    """train_ddp.py on 2 ranks with REFERENCE_STEPS: beside train.py (tests/test_ddp.py) and the uninterrupted
    run that a stopped and resumed DDP run must repeat bit for bit (tests/test_stop.py)."""
    run = tmp_path_factory.mktemp("ddp_reference") / "ddp"
    proc = run_script("train_ddp.py", *tiny_args(tiny_data, run, *REFERENCE_STEPS), ranks=2)
    assert "world_size=2 nodes=1 backend=gloo" in proc.stdout
    return run


# The ViT forecaster in miniature (tests/test_vit_training.py, tests/test_mp.py): 16x32 fields, patch 4.
VIT_MODEL = ["--img_size", "[16, 32]", "--model_args", "{patch_size: 4, embed_dim: 16, depths: [2], num_heads: [2]}"]
# 2 files x 11 pairs / batch 4 = 5 steps per epoch: 7 steps cross the epoch boundary; validations at
# steps 4 and 7; checkpoints at 3, 5 (end of epoch), 6 and 7.
VIT_STEPS = ("--max_steps", "7", "--log_every", "1", "--val_every", "4", "--ckpt_every", "3",
             "--keep_checkpoints", "10")


@pytest.fixture(scope="session")
def vit_data(tmp_path_factory):
    """NERSC's layout in miniature: 20 channels, 6-hourly, 17x32 stored grid, stats/ included."""
    from datasets.make_synthetic_era5 import make_synthetic_era5

    root = tmp_path_factory.mktemp("era5_nersc")
    make_synthetic_era5(root, samples_per_year=12, height=17, width=32, seed=0, train_years=(2008, 2010),
                        valid_years=(2015,), channels="nersc20", hours_per_step=6, stats=True, progress=False)
    return root


def vit_args(data_dir, run_dir, *extra: str) -> list[str]:
    return ["--config", "vit_quickstart", "--data_dir", str(data_dir), "--run_dir", str(run_dir), "--batch_size", "4",
            "--val_samples", "5", "--num_workers", "0", "--progress", "never", *VIT_MODEL, *extra]


@pytest.fixture(scope="session")
def vit_reference(vit_data, tmp_path_factory) -> Path:
    """The miniature ViT under train.py with VIT_STEPS: what every other layout must reproduce."""
    run = tmp_path_factory.mktemp("vit_reference") / "single"
    run_script("train.py", *vit_args(vit_data, run, *VIT_STEPS), in_process=True)
    return run


# SC22's U-Net in miniature (tests/test_unet3d.py): 2 levels of 4 and 8 channels on 16^3 crops of 32^3 boxes,
# 16 crops per epoch / batch 4 = 4 steps per epoch: 6 steps cross the epoch boundary; validations (the 8 crops
# that tile the validation box) at steps 3 and 6; checkpoints at 2, 4 (end of epoch) and 6.
UNET_MODEL = ["--crop_size", "16", "--model_args.widths", "[4, 8]", "--train_samples", "16", "--warmup_steps", "2"]
UNET_STEPS = ("--max_steps", "6", "--log_every", "1", "--val_every", "3", "--ckpt_every", "2",
              "--keep_checkpoints", "10")


@pytest.fixture(scope="session")
def volume_data(tmp_path_factory) -> Path:
    """SC22's layout in miniature: train.h5 and valid.h5, 32^3 boxes of the synthetic N-body -> hydro fields."""
    from datasets.make_synthetic_volume import make_synthetic_volume

    root = tmp_path_factory.mktemp("volume")
    make_synthetic_volume(root, train_side=32, valid_side=32, seed=0, progress=False)
    return root


def unet_args(data_dir, run_dir, *extra: str) -> list[str]:
    return ["--config", "unet3d_quickstart", "--data_dir", str(data_dir), "--run_dir", str(run_dir), "--batch_size",
            "4", "--num_workers", "0", "--progress", "never", *UNET_MODEL, *extra]


@pytest.fixture(scope="session")
def unet_reference(volume_data, tmp_path_factory) -> Path:
    """The miniature U-Net under train.py with UNET_STEPS (augmentation on the host): what the other layouts,
    augmentation on the device and resumed runs must reproduce."""
    run = tmp_path_factory.mktemp("unet_reference") / "single"
    run_script("train.py", *unet_args(volume_data, run, *UNET_STEPS), in_process=True)
    return run


class FakeMesh:
    """A 1-D mesh of 2 ranks seen from rank 0, for what the techniques read of a mesh before they need a
    process group (its size, this rank, the group)."""

    def size(self):
        return 2

    def get_local_rank(self):
        return 0

    def get_group(self):
        return None


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_weights(run_dir: Path) -> dict:
    """The model weights in a run's latest single-file checkpoint (train.py, train_ddp.py)."""
    return load_checkpoint(latest_checkpoint(run_dir / "checkpoints"))["model"]


def weights_at(run_dir: Path, step: int) -> dict:
    """The model weights in the single-file checkpoint of ``step`` (train.py, train_ddp.py)."""
    return load_checkpoint(run_dir / "checkpoints" / f"step_{step:08d}.pt")["model"]


def as_dcp_checkpoint(checkpoint: Path, ckpt_dir: Path) -> Path:
    """The weights and config of a train.py checkpoint saved as train_fsdp.py saves them (FSDP2 on a one-rank
    process group, a fresh optimizer): the DCP step folder in ``ckpt_dir``, for tests of the tools that read any."""
    import torch
    import torch.distributed as dist

    from models import build_model
    from utils.checkpoint.contents import sharded_payload
    from utils.checkpoint.sharded import save_sharded_checkpoint
    from utils.checkpoint.state import TrainState
    from utils.config import build_config
    from utils.parallel.fsdp import apply_fsdp
    from utils.precision import make_grad_scaler
    from utils.training import build_optimizer

    payload = load_checkpoint(checkpoint)
    flat = dict(payload["config"])
    cfg = build_config(flat.pop("config"), flat)
    cpu, step = torch.device("cpu"), payload["train_state"]["step"]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = build_model(cfg.model)
        model.load_state_dict(payload["model"])
        model = apply_fsdp(model, cfg, cpu)
        optimizer, scheduler = build_optimizer(model, cfg, 1, cpu)
        return save_sharded_checkpoint(ckpt_dir, step, sharded_payload(
            model, optimizer, scheduler, make_grad_scaler(cpu, "none"), TrainState(step=step), cfg))
    finally:
        dist.destroy_process_group()


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


def run_then_resume(root: Path, single: Path, script: str, args: Callable[..., list[str]],
                    first: tuple[str, Sequence[str], Sequence[str]], then: tuple[str, Sequence[str], str],
                    step: int = 3) -> dict[str, Path]:
    """``script`` on 2 ranks in one layout, then its step-``step`` checkpoint resumed in another: each launch
    is (run folder name under ``root``, its flags: ``args(run_dir, *flags)``, what its stdout must hold: a
    list, then one line beside "resumed from"). Returns {"single": ``single``, the two names: their folders}
    for tests that compare them with that single-device reference."""
    (name, flags, says), (resumed, resumed_flags, resumed_says) = first, then
    runs = {"single": single, name: root / name}
    proc = run_script(script, *args(runs[name], *flags), ranks=2)
    for line in says:
        assert line in proc.stdout
    runs[resumed] = resume_from(runs[name], step, root / resumed)
    proc = run_script(script, *args(runs[resumed], *resumed_flags, "--resume"), ranks=2)
    assert resumed_says in proc.stdout and "resumed from" in proc.stdout
    return runs


_PYTEST_PID = os.getpid()
_REAL_EXIT = os._exit


def _exit_as_system_exit(code: int = 0):
    """os._exit for a script run in this process: SystemExit, so that a script that skips the interpreter's shutdown
    (utils.training.exit_process) does not end pytest itself — with that script's exit code, 0 after a check that
    passed, which CI would read as a whole suite passed. A forked child (a DataLoader worker) still exits for real."""
    if os.getpid() != _PYTEST_PID:
        _REAL_EXIT(code)
    raise SystemExit(code)


def in_this_process():
    """The context in which a script runs as __main__ in this process: os._exit raises SystemExit."""
    return mock.patch.object(os, "_exit", _exit_as_system_exit)


@pytest.fixture(autouse=True)
def _no_joined_job_left_behind():
    """A script run in this process with one rank joins a process group of its own (init_distributed), which marks
    the process as a rank of a job: every later script would then end with os._exit. Each test starts unmarked."""
    yield
    from utils.parallel import distributed

    distributed._joined_job = False


def run_script(*args: str, timeout: float = 240, env_extra: dict | None = None, check: bool = True,
               launcher: list[str] | None = None, ranks: int = 0, in_process: bool = False) -> subprocess.CompletedProcess:
    """Run a project script (e.g. "train.py", "--config", ...) in a fresh interpreter from the repo root.

    ``ranks=N`` starts N processes with the variables torchrun gives its workers (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, ...), without torchrun itself, whose own start-up (an interpreter that
    imports torch, then a rendezvous) costs about 4 s per launch on 2 cores; stdout and stderr are
    the ranks' in rank order. Tests of what torchrun itself does (stopping the other ranks when one
    fails) use ``launcher`` with real torchrun. ``in_process=True`` runs a one-process script in this
    interpreter (as `python SCRIPT`, with 1 thread as OMP_NUM_THREADS=1 gives a subprocess), saving the
    ~3 s of importing torch again: for runs whose results are compared, not their exit as a command.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    cmd = (launcher or [sys.executable]) + list(args)
    if in_process:
        proc = _run_in_process(list(args))
    elif ranks:
        proc = _run_ranks([sys.executable, *args], ranks, env, timeout)
    else:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{getattr(proc, 'ranks_tail', '') or proc.stderr[-4000:]}")
    return proc


def assert_layout_equal(row: dict) -> None:
    """A check_layouts.py row (utils.layouts.equivalence.Comparison.summary) that passes, and within the tighter limits
    the built-in models held before the check existed: gradients within 1e-4 of their largest entry."""
    assert row["passed"] and row["grads_differ"] == [] and row["weights_differ"] == [] and not row["missing"], row
    assert row["grad"] < 1e-4 and row["weight"] < 1e-2, row


def check_layouts(*args: str, ranks: int = 4, check: bool = True) -> tuple[int, list[dict]]:
    """check_layouts.py's rows (--json) for ``args``, its ranks started directly as run_script starts them (the
    launcher's own interpreter is what check_layouts.py adds for a user); the exit code beside them."""
    proc = run_script("check_layouts.py", *args, "--json", ranks=ranks, check=check)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def exit_in_one_process(capsys, script: str, *args: str) -> tuple[int | str | None, list[str]]:
    """``python SCRIPT ARGS`` in this process (no torchrun: 1 rank), as tests/test_script_invariants.py runs the
    scripts, for a command line that must stop (SystemExit): its exit code and the lines of its stderr. The
    one-rank process group it may have started is destroyed whatever happens: later tests start without one."""
    with mock.patch.object(sys, "argv", [script, *args]), in_this_process():
        try:
            with pytest.raises(SystemExit) as exit_info:
                runpy.run_path(str(REPO / script), run_name="__main__")
        finally:
            cleanup_distributed()
    return exit_info.value.code, capsys.readouterr().err.strip().splitlines()


def _run_in_process(args: list[str]) -> subprocess.CompletedProcess:
    import contextlib
    import io

    import torch

    out, err, code = io.StringIO(), io.StringIO(), 0
    threads, cwd = torch.get_num_threads(), os.getcwd()
    torch.set_num_threads(1)
    os.chdir(REPO)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                mock.patch.object(sys, "argv", list(args)), in_this_process():
            runpy.run_path(str(REPO / args[0]), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        torch.set_num_threads(threads)
        os.chdir(cwd)
    return subprocess.CompletedProcess(["(in process)", *args], code, out.getvalue(), err.getvalue())


def stop_mid_run(script_args: list[str], run_dir: Path, ranks: int = 1, signum: int = signal.SIGTERM,
                 to_rank: int = 0, timeout: float = 240) -> subprocess.CompletedProcess:
    """Start ``python SCRIPT ARGS`` (as ``ranks`` ranks, as run_script does), and once run_dir's metrics.jsonl
    records a training step, send ``signum`` to rank ``to_rank`` alone, as scancel or sbatch --signal would.
    The ranks are paused (SIGSTOP) around the signal, so it lands in the middle of a later step, whatever
    the machine's speed; SIGSTOP leaves that rank stopped (a rank that no longer answers), and it is killed
    once the others have ended. Returns the exit codes of the ranks that ran on (``returncode``: a list), their
    output, and ``ended_after``: seconds from the signal to their end."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if ranks > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(ranks),
                   LOCAL_WORLD_SIZE=str(ranks), GROUP_RANK="0")
    with tempfile.TemporaryDirectory() as tmp:
        outs = [open(f"{tmp}/{r}.out", "w+") for r in range(ranks)]
        procs = [subprocess.Popen([sys.executable, *script_args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                  env={**env, **({"RANK": str(r), "LOCAL_RANK": str(r)} if ranks > 1 else {})})
                 for r, out in enumerate(outs)]
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
        try:
            while not (metrics.exists() and '"kind": "train"' in metrics.read_text()):
                assert all(p.poll() is None for p in procs), "a rank ended before the signal"
                assert time.monotonic() < deadline, "no training step logged in time"
                time.sleep(0.01)
            for p in procs:
                p.send_signal(signal.SIGSTOP)
            procs[to_rank].send_signal(signum)
            running = [p for p in procs if not (signum == signal.SIGSTOP and p is procs[to_rank])]
            for p in running:
                p.send_signal(signal.SIGCONT)
            sent = time.monotonic()
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in running]
            ended_after = time.monotonic() - sent
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        texts = []
        for out in outs:
            out.seek(0)
            texts.append(out.read())
            out.close()
    proc = subprocess.CompletedProcess(script_args, codes, "".join(texts), "")
    proc.ended_after = ended_after
    return proc


_PORTS = random.Random()  # its own generator: the training code seeds the global one, runs in this process too


def _free_port() -> int:
    """A port free now, drawn below the kernel's ephemeral range: port 0 would hand out one from that range, which
    the kernel gives to outgoing connections too (gloo's, a store client's), and one of them could take it between
    this check and the job's bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = _PORTS.randrange(10000, max(low, 10001))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _run_ranks(cmd: list[str], n: int, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` as ranks 0..n-1 of one job on this machine; a rank that fails stops the others (as torchrun)."""
    common = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(n),
              "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0"}
    with tempfile.TemporaryDirectory() as tmp:
        outs = [(open(f"{tmp}/{r}.out", "w+"), open(f"{tmp}/{r}.err", "w+")) for r in range(n)]
        procs = [subprocess.Popen(cmd, cwd=REPO, env={**common, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  stdout=out, stderr=err, text=True) for r, (out, err) in enumerate(outs)]
        deadline = time.monotonic() + timeout
        first = None  # the rank that failed first: the others' errors often only follow from its end
        while any([p.poll() is None for p in procs]):  # a list: every rank polled, so each return code is read
            first = next((r for r, p in enumerate(procs) if p.returncode not in (None, 0)), None)
            if first is not None or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.05)
        codes = [p.wait(timeout=60) for p in procs]
        texts = []
        for out, err in outs:
            out.seek(0), err.seek(0)
            texts.append((out.read(), err.read()))
            out.close(), err.close()
    code = codes[first] if first is not None else next((c for c in codes if c != 0), 0)
    proc = subprocess.CompletedProcess([f"RANK=0..{n - 1}", *cmd], code, "".join(t[0] for t in texts),
                                       "".join(t[1] for t in texts))
    # A failure message keeps the end of stderr, which is the last rank's: give it every rank's own end, the rank
    # that failed first first (the others' errors often only follow from its end).
    order = ([first] if first is not None else []) + [r for r in range(n) if r != first]
    proc.ranks_tail = "".join(f"\n--- rank {r} exited {codes[r]}{' (failed first)' if r == first else ''}\n"
                              f"{texts[r][1][-1200:]}" for r in order) if code else ""
    return proc
