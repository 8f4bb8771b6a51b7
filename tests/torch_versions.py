"""Every script's laptop command, a few steps each, on another torch: the check behind docs/setup.md's version table.

    make test-torch TORCH=2.11.0                                  # = python tests/torch_versions.py --torch 2.11.0
    python tests/torch_versions.py --torch 2.7.1 --venv ../venvs/torch-2.7.1 --only pp_1f1b pp_zbv
    python tests/torch_versions.py --torch 2.15.0 --venv .venv    # the pinned environment as it is
    python tests/torch_versions.py --list                         # the commands, nothing run

It creates (or reuses) a virtualenv with torch==VERSION and, for everything else, the versions of constraints.txt:
torch is installed alone first, so that its own dependencies (sympy, setuptools, the CUDA wheels, ...) follow its
release, and the rest of requirements.txt is then constrained by constraints.txt less what is already there and
torchvision, which pip matches to that torch. Then it runs each command below with tests/smoke.py's runner (each in
its own process group with a time limit, one line per command: ok, refused, FAIL, TIMEOUT; a summary), and exits 1
if any failed or timed out. "refused" is a script declining a feature this torch lacks in one line that names the
torch it needs ("needs torch >= X"): expected on old releases, not a failure. Logs and run folders:
runs/torch-VERSION/.

Standard library only, so any python3 runs it; the commands run with the virtualenv's python. CI runs the test
suite on the pin only; this check is for developers and users with another torch (a site module, a GPU image).
pytest does not collect this file (no test_ prefix); tests/test_torch_versions.py checks the runner in seconds.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script (python tests/torch_versions.py): its folder is not a package then
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.smoke import (REPO, Smoke, add_arguments, error, failed, print_list, project_name, reason, run_all,
                         selected, smoke, summary)

DATA = ("datasets/synthetic_small/valid", "datasets/synthetic_vit/valid/2015.h5")  # make data data-vit
TIMEOUT_S = 300  # per command; the slowest (a pipeline under torchrun) took under a minute on 2 busy cores


def quick(config: str, steps: int = 4, val_samples: int = 4, *more: str) -> list[str]:
    """A few steps, little validation, no progress bar."""
    return ["--config", config, "--max_steps", str(steps), "--val_samples", str(val_samples), "--progress", "never",
            "--log_every", "2", *more]


VIT = quick("vit_quickstart", 4, 4, "--val_every", "0")  # tensor and context parallelism's model, and the rollout's
# SwinIR in 4 RSTBs, as docs/beyond-data-parallel.md's laptop command for the pipelines.
PIPELINE = quick("quickstart", 4, 8, "--pp", "2", "--model_args", "{depths: [1,1,1,1], num_heads: [2,2,2,2]}",
                 "--batch_size", "8", "--pp_microbatches", "8")
# The packages whose versions follow the torch release rather than constraints.txt (besides torch's own tree).
FOLLOW_TORCH = {"torch", "torchvision"}

SMOKES: list[Smoke] = [
    smoke("train", "train.py", *quick("quickstart"), "--run_dir", "{run}"),
    # (no memory timeline: its export alone takes 3 min on 2 cores)
    smoke("profiling", "train_with_profiling.py", *quick("quickstart"), "--breakdown_steps", "2",
          "--profile_active", "1", "--memory_timeline", "false", "--run_dir", "{run}"),
    smoke("ddp", "train_ddp.py", *quick("quickstart"), "--run_dir", "{run}", torchrun=True),
    smoke("fsdp", "train_fsdp.py", *quick("quickstart"), "--ckpt_every", "2", "--run_dir", "{run}", torchrun=True),
    smoke("fsdp_resume", "train_fsdp.py", *quick("quickstart", 6), "--resume", "true", "--run_dir", "{run:fsdp}",
          torchrun=True, needs=["fsdp"]),
    smoke("fsdp_async", "train_fsdp.py", *quick("quickstart"), "--ckpt_async", "true", "--ckpt_every", "2",
          "--run_dir", "{run}", torchrun=True),
    smoke("mp_vit_tp2", "train_mp.py", *VIT, "--tp", "2", "--run_dir", "{run}", torchrun=True),
    smoke("mp_vit_cp2", "train_mp.py", *VIT, "--cp", "2", "--run_dir", "{run}", torchrun=True),
    smoke("mp_swinir_tp2", "train_mp.py", *quick("quickstart"), "--tp", "2", "--run_dir", "{run}", torchrun=True),
    smoke("mp_swinir_cp2", "train_mp.py", *quick("quickstart"), "--cp", "2", "--run_dir", "{run}",
          torchrun=True),  # bands
    *(smoke(f"pp_{schedule}", "train_pp.py", *PIPELINE, "--pp_schedule", schedule, "--run_dir", "{run}",
            torchrun=True) for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")),
    smoke("vit_train", "train.py", *VIT, "--run_dir", "{run}"),
    smoke("rollout", "rollout.py", "--checkpoint", "{run:vit_train}", "--steps", "2", "--samples", "2",
          needs=["vit_train"]),
    smoke("estimate", "estimate_memory.py", "--config", "full_size", "--device", "cuda"),
    smoke("plan", "plan.py", "--config", "vit_mp", "--cluster", "perlmutter-a100-40", "--nodes", "4", "--top", "3"),
    smoke("comm_check", "comm_check.py", "--max-bytes", "1MiB", "--seconds-per-size", "0.2", torchrun=True),
]


# ----------------------------------------------------------------------------------------- the virtualenv

def other_pins(constraints: str, installed: Sequence[str], torch: str) -> str:
    """constraints.txt's pins less the packages already installed with torch (its own dependency tree) and those
    that follow the torch release (torchvision), plus torch==VERSION, so that the second install keeps it."""
    keep = {project_name(line) for line in installed if "==" in line} | FOLLOW_TORCH
    pins = [line.strip() for line in constraints.splitlines()
            if "==" in line and not line.lstrip().startswith("#") and project_name(line) not in keep]
    return "\n".join([*pins, f"torch=={torch}"]) + "\n"


def probe(python: Path) -> subprocess.CompletedProcess:
    """Import the project's requirements in a virtualenv; its stdout: the torch version."""
    return subprocess.run([str(python), "-c", "import h5py, matplotlib, psutil, tensorboard, timm, torch, tqdm, yaml; "
                           "print(torch.__version__)"], capture_output=True, text=True)


def venv_torch(python: Path) -> Optional[str]:
    """The torch version of a virtualenv with the project's requirements, or None if any is missing."""
    found = probe(python)
    return found.stdout.strip() if found.returncode == 0 else None


def ensure_venv(venv: Path, torch: str, index_url: Optional[str] = None) -> Path:
    """The virtualenv's python, with torch==``torch`` and the project's other pins; created if needed."""
    python = venv / "bin" / "python"
    found = venv_torch(python) if python.exists() else None
    if found and found.split("+")[0] == torch:
        return python
    if found:
        raise SystemExit(f"error: {venv} holds torch {found}, not {torch}: name another --venv (or remove it)")
    print(f"installing torch {torch} into {venv} (a few GB with its CUDA wheels)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, f"torch=={torch}", *(["--index-url", index_url] if index_url else [])], check=True)
    installed = subprocess.run([str(python), "-m", "pip", "freeze", "--all"], capture_output=True, text=True,
                               check=True).stdout.splitlines()
    pins = venv / "constraints-others.txt"
    pins.write_text(other_pins((REPO / "constraints.txt").read_text(), installed, torch))
    subprocess.run([*pip, "-r", str(REPO / "requirements.txt"), "-c", str(pins)], check=True)
    found = probe(python)
    if found.returncode:  # e.g. a torchvision built for another torch: "operator torchvision::nms does not exist"
        raise SystemExit(f"error: {venv} does not import the requirements: {reason(found.stderr)}")
    return python


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", help="the torch version to check, e.g. 2.11.0")
    parser.add_argument("--venv", type=Path, help="its virtualenv (default: .venv-torch-VERSION); reused if it "
                                                  "holds that torch, created if missing")
    parser.add_argument("--index-url", help="where torch comes from, if not PyPI (e.g. PyTorch's CPU wheels)")
    add_arguments(parser, TIMEOUT_S)
    args = parser.parse_args(argv)
    smokes = selected(SMOKES, args.only)
    if args.list:
        print_list(smokes, "runs/torch-VERSION")
        return 0
    if not args.torch or not re.fullmatch(r"\d+\.\d+\.\d+", args.torch):
        return error(f"--torch (make test-torch TORCH=...) must be a release such as 2.11.0, got {args.torch!r}")
    missing = [path for path in DATA if not (REPO / path).exists()]
    if missing:
        return error(f"{', '.join(missing)} missing: make data data-vit")
    python = ensure_venv((args.venv or REPO / f".venv-torch-{args.torch}").absolute(), args.torch, args.index_url)
    runs = REPO / "runs" / f"torch-{args.torch}"
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    print(f"torch {venv_torch(python)} ({python}), {len(smokes)} commands, at most {args.timeout:g} s each; "
          f"logs in {runs.relative_to(REPO)}/", flush=True)
    results = run_all(smokes, python, runs, args.timeout, args.jobs)
    print(summary(results, f"torch {args.torch}"))
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
