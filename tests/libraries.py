"""Other libraries' models through every script, each plugged in by its class path alone: the check behind
`make test-libraries` (docs/development.md; docs/part4-your-model.md, "A library's model").

    make test-libraries                                     # = python tests/libraries.py --venv .venv-libraries
    python tests/libraries.py --only neuralop_fno           # one model's commands (and the data they need)
    python tests/libraries.py --list                        # the commands, nothing run

The models, as tests/libraries/libraries.yaml configures them: MONAI's UNet in 3-D on the volume task and in 2-D on
the forecast task, neuraloperator's FNO on the forecast task (complex weights in a class that takes no subclass),
segmentation_models_pytorch's Unet on the diagnostic task. For each: train.py, train_ddp.py, and train_fsdp.py with
activation checkpointing (torchrun, 2 processes, gloo on the CPU); a train_fsdp.py run stopped at step 3 and resumed,
whose last checkpoint must hold the bits of the uninterrupted run's (tests/same_checkpoints.py); estimate_memory.py,
and its traced estimate against the measured peak of real steps, within 10 % (benchmarks/validate_traced_estimate.py,
one process and FSDP on 2); plan.py; check_layouts.py (DDP, FSDP and HSDP against one process); predict.py. The data:
tiny stand-ins it generates first (datasets/make_synthetic_*.py), as the test suite's fixtures do.

The virtualenv (--venv, default .venv-libraries) is made once and reused: the libraries and what they bring beyond
the project's requirements, at the versions of requirements-libraries.txt (constrained by constraints.txt), over the
project's environment — the interpreter that runs this file, `make`'s .venv: its site-packages, torch included, are
read through a .pth file rather than installed again (torch's CUDA wheels are 5 GB). Commands and report: the runner
tests/smoke.py shares with `make test-torch` (one line per command, a summary, exit 1 if any failed or timed out).
Logs and run folders: runs/libraries/. Standard library only; tests/test_libraries_runner.py checks it in seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Optional, Sequence

if __package__ in (None, ""):  # run as a script (python tests/libraries.py): its folder is not a package then
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.smoke import (REPO, Smoke, add_arguments, error, failed, print_list, project_name, reason, run_all,
                         selected, smoke, summary)

PINS = REPO / "requirements-libraries.txt"
CONFIGS = "tests/libraries/libraries.yaml"
JOBS = 2  # commands at a time: CI's 2 cores (most of a command's time is one core importing torch and a library)
TIMEOUT_S = 300  # per command; the slowest (check_layouts.py: three layouts) took 20 to 45 s on 2 busy cores
IMPORTS = {"monai": "monai", "neuraloperator": "neuralop", "segmentation-models-pytorch": "segmentation_models_pytorch"}
"""The libraries (their names in requirements-libraries.txt) and the modules they install."""
STAMP = ".installed-libraries"  # in the virtualenv: what it was made from (pins, lock, the environment under it)

DATA = [
    # The test suite's stand-ins (tests/conftest.py), on the quickstart's 33 x 64 grid (32 x 64 fields: a finer one
    # leaves a group norm of the Unet's second stage too few values, and its rounding differs between layouts): 20
    # channels 6-hourly, 2 training years of 12 samples (5 steps an epoch at batch 4) with their statistics; a 32^3
    # training and validation box.
    smoke("data_fields", "datasets/make_synthetic_era5.py", "--out", "{run}", "--channels", "nersc20",
          "--hours-per-step", "6", "--height", "33", "--width", "64", "--samples-per-year", "12", "--train-years",
          "2008", "2010", "--valid-years", "2015", "--quiet"),
    smoke("data_volume", "datasets/make_synthetic_volume.py", "--out", "{run}", "--train-side", "32",
          "--valid-side", "32", "--quiet"),
]
MODELS = {  # config name in CONFIGS: (its data, whether its task is a forecast)
    "monai_unet3d": ("data_volume", False),
    "monai_unet2d": ("data_fields", True),
    "neuralop_fno": ("data_fields", True),
    "smp_unet": ("data_fields", False),
}


def model_smokes(name: str, data: str, forecast: bool) -> list[Smoke]:
    """One model through every script; its commands are named <config>_<what>."""
    config = ["--config_file", CONFIGS, "--config", name, "--data_dir", f"{{run:{data}}}"]
    ac = ["--ac", "block"]
    fsdp = ["train_fsdp.py", *config, *ac]

    def own(what: str, script: str, *args: str, needs: Sequence[str] = (), torchrun: bool = False) -> Smoke:
        return smoke(f"{name}_{what}", script, *args, torchrun=torchrun, needs=[data, *(f"{name}_{n}" for n in needs)])

    return [
        own("train", "train.py", *config, "--run_dir", "{run}"),
        own("ddp", "train_ddp.py", *config, "--run_dir", "{run}", torchrun=True),
        own("fsdp", *fsdp, "--run_dir", "{run}", torchrun=True),
        own("fsdp_half", *fsdp, "--max_steps", "3", "--run_dir", "{run}", torchrun=True),
        own("fsdp_resumed", *fsdp, "--resume", "true", "--run_dir", f"{{run:{name}_fsdp_half}}", torchrun=True,
            needs=["fsdp_half"]),
        own("same_bits", "tests/same_checkpoints.py", f"{{run:{name}_fsdp}}", f"{{run:{name}_fsdp_half}}",
            needs=["fsdp", "fsdp_resumed"]),
        own("estimate", "estimate_memory.py", *config, *ac, "--world_size", "2", "--strategy", "fsdp"),
        own("plan", "plan.py", *config, "--cluster", "perlmutter-a100-40", "--nodes", "1", "--top", "3"),
        own("layouts", "check_layouts.py", *config, *ac, "--nproc", "2"),
        own("predict", "predict.py", "--checkpoint", f"{{run:{name}_train}}", "--out", "{run}/predictions.zarr",
            "--times", "0:2", *(["--steps", "2"] if forecast else []), needs=["train"]),
    ]


# The traced estimate (estimate_memory.py's for these models) against the measured peak of real steps, every model in
# one command (its processes import each library once): one process, and FSDP on 2, with activation checkpointing.
MEMORY = smoke("estimate_vs_peak", "benchmarks/validate_traced_estimate.py", "--config_file", CONFIGS,
               *(arg for name in MODELS for arg in ("--config", name)), "--layout", "1,none,ac=block", "--layout",
               "2,fsdp,ac=block")
SMOKES: list[Smoke] = [*DATA, *(s for name, (data, forecast) in MODELS.items() for s in model_smokes(name, data,
                                                                                                     forecast)), MEMORY]


# ----------------------------------------------------------------------------------------- the virtualenv

def pinned(text: str) -> dict[str, str]:
    """{name: version} of requirements-libraries.txt's lines."""
    return {project_name(line): line.split("==", 1)[1].strip() for line in text.splitlines()
            if "==" in line and not line.lstrip().startswith("#")}


def stamp(base: Path) -> str:
    """What a virtualenv is made from: the pins, the lock, and the environment it reads through its .pth file."""
    digest = hashlib.sha256(PINS.read_bytes() + (REPO / "constraints.txt").read_bytes())
    return f"{digest.hexdigest()[:16]} over {base}"


def probe(python: Path) -> subprocess.CompletedProcess:
    """Import the libraries and torch in a virtualenv; its stdout: each library's version, then torch's file."""
    code = ("import importlib.metadata as m, torch; "
            + "".join(f"import {module}; " for module in IMPORTS.values())
            + f"print(*[m.version(n) for n in {list(IMPORTS)}], torch.__file__)")
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True)


def ensure_venv(venv: Path, base: Optional[Path] = None) -> Path:
    """The virtualenv's python, with the pinned libraries over the project's environment (``base``: the site-packages
    of the interpreter running this); made or brought up to date if needed."""
    base = base or Path(sysconfig.get_paths()["purelib"])
    python, made_from = venv / "bin" / "python", stamp(base)
    if not (python.exists() and (venv / STAMP).is_file() and (venv / STAMP).read_text() == made_from):
        print(f"installing {', '.join(IMPORTS)} into {venv} over {base} (its torch is not installed again)",
              flush=True)
        try:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
            purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     capture_output=True, text=True, check=True).stdout.strip()
            (Path(purelib) / "_project_environment.pth").write_text(f"{base}\n")  # after the venv's own packages
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-r", str(PINS), "-c",
                            str(REPO / "constraints.txt")], check=True)
        except subprocess.CalledProcessError as failed:
            raise SystemExit(f"error: could not make {venv} ({' '.join(map(str, failed.cmd[:4]))}... exited "
                             f"{failed.returncode}, its reason above): check the network to PyPI, or remove it")
        (venv / STAMP).write_text(made_from)
    found = probe(python)
    if found.returncode:
        raise SystemExit(f"error: {venv} does not import the libraries: {reason(found.stderr)}")
    *versions, torch_file = found.stdout.split()
    wanted = pinned(PINS.read_text())
    wrong = [f"{n} {v} (pinned {wanted[n]})" for n, v in zip(IMPORTS, versions) if wanted[n] != v]
    if wrong or not Path(torch_file).is_relative_to(base):
        raise SystemExit(f"error: {venv} holds {', '.join(wrong) or f'its own torch ({torch_file})'}: remove it, "
                         "and make test-libraries makes it again")
    return python


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=REPO / ".venv-libraries",
                        help="the libraries' virtualenv (made over this interpreter's environment if missing)")
    add_arguments(parser, TIMEOUT_S, JOBS)
    args = parser.parse_args(argv)
    smokes = selected(SMOKES, args.only)
    if args.list:
        print_list(smokes, "runs/libraries")
        return 0
    if sys.prefix == sys.base_prefix:
        return error("run it with the project's virtualenv (make test-libraries, or .venv/bin/python "
                     "tests/libraries.py): the libraries' virtualenv reads that one's packages")
    python = ensure_venv(args.venv.absolute())
    runs = REPO / "runs" / "libraries"
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    print(f"{', '.join(f'{n} {v}' for n, v in pinned(PINS.read_text()).items() if n in IMPORTS)} ({python}), "
          f"{len(smokes)} commands, at most {args.timeout:g} s each; logs in {runs.relative_to(REPO)}/", flush=True)
    start = time.perf_counter()
    results = run_all(smokes, python, runs, args.timeout, args.jobs)
    print(summary(results, "libraries", time.perf_counter() - start))
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
