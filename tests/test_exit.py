"""Every distributed script ends cleanly, run after run (a job that crashes after "done" is FAILED in SLURM).

A train_pp.py --pp_schedule zbv run once printed "done" and then aborted at exit ("terminate called without
an active exception", -6): process groups outlive destroy_process_group (FSDP2's state is held by an
autograd graph that Python's collector cannot free), and tearing them down during interpreter shutdown
races with gloo's and autograd's C++ threads. utils.training.exit_process ends a multi-process rank
without that shutdown. Here each distributed script runs several times in one 2-rank launch
(tests/exit_stress.py forks the runs, so each costs its own seconds only) and must exit 0 every time.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, run_script, tiny_args, vit_args

ONE_STEP = ("--max_steps", "1", "--log_every", "1", "--val_every", "1", "--ckpt_every", "1", "--val_samples", "2")
SWINIR_4 = ("--model_args.depths", "[1,1,1,1]", "--model_args.num_heads", "[2,2,2,2]")
REPEATS = 3


def without_run_dir(args: list[str]) -> list[str]:
    i = args.index("--run_dir")
    return args[:i] + args[i + 2:]


def test_every_distributed_script_exits_0_every_time(tiny_data, vit_data, tmp_path):
    runs = [
        ("train_ddp.py", tiny_args(tiny_data, "-", *ONE_STEP)),
        ("train_fsdp.py", tiny_args(tiny_data, "-", *ONE_STEP)),
        ("train_mp.py", vit_args(vit_data, "-", *ONE_STEP, "--tp", "2")),
        ("train_pp.py", tiny_args(tiny_data, "-", *ONE_STEP, *SWINIR_4, "--pp", "2", "--pp_schedule", "zbv")),
        ("train_pp.py", vit_args(vit_data, "-", *ONE_STEP, "--pp", "2", "--pp_microbatches", "2")),
    ]
    runs = [(script, without_run_dir(args)) for script, args in runs]
    # The other entry points that join a gloo group (no --run_dir): the network check, a scaling worker (DDP)
    runs.append(("comm_check.py", ["--max-bytes", "64KiB", "--seconds-per-size", "0.01"], False))
    worker = ["--worker", "--out", "{run_dir}", "--steps", "1", "--warmup", "2", "--rounds", "1", "--batch", "2",
              "--global-batch", "4", "--bucket-caps", "0.01", "--", *without_run_dir(tiny_args(tiny_data, "-"))]
    runs.append(("benchmarks/scaling.py", worker, False))
    proc = run_script("tests/exit_stress.py", json.dumps(runs), str(REPEATS), str(tmp_path), ranks=2, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == 2 * REPEATS * len(runs), proc.stdout[-2000:] + proc.stderr[-2000:]
    failed = [f"{r['script']} {' '.join(r['args'][-4:])} run {r['repeat']}: exit {r['status']}"
              for r in results if r["status"] != 0]
    assert not failed, "\n".join(failed) + "\n" + proc.stderr[-3000:]


def test_a_rank_of_a_job_ends_without_the_interpreter_shutdown():
    code = ("import atexit; from utils.parallel import distributed; from utils.training import exit_process; "
            "distributed._joined_job = True; "  # as init_distributed sets it for a rank of a job
            "atexit.register(lambda: print('interpreter shutdown')); print('written', flush=False); exit_process(3)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "written\n"  # flushed, and no exit handler ran
