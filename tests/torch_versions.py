"""Every script's laptop command, a few steps each, on another torch: the check behind docs/setup.md's version table.

    make test-torch TORCH=2.11.0                                  # = python tests/torch_versions.py --torch 2.11.0
    python tests/torch_versions.py --torch 2.7.1 --venv ../venvs/torch-2.7.1 --only pp_1f1b pp_zbv
    python tests/torch_versions.py --torch 2.15.0 --venv .venv    # the pinned environment as it is
    python tests/torch_versions.py --list                         # the commands, nothing run

It creates (or reuses) a virtualenv with torch==VERSION and, for everything else, the versions of constraints.txt:
torch is installed alone first, so that its own dependencies (sympy, setuptools, the CUDA wheels, ...) follow its
release, and the rest of requirements.txt is then constrained by constraints.txt less what is already there and
torchvision, which pip matches to that torch. Then it runs each command below in its own process group with a time
limit, prints one line per command (ok, refused, FAIL, TIMEOUT) and a summary, and exits 1 if any failed or timed
out. "refused" is a script declining a feature this torch lacks in one line that names the torch it needs ("needs
torch >= X"): expected on old releases, not a failure. Logs and run folders: runs/torch-VERSION/.

Standard library only, so any python3 runs it; the commands run with the virtualenv's python. CI runs the test
suite on the pin only; this check is for developers and users with another torch (a site module, a GPU image).
pytest does not collect this file (no test_ prefix); tests/test_torch_versions.py checks the runner in seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
DATA = ("datasets/synthetic_small/valid", "datasets/synthetic_vit/valid/2015.h5")  # make data data-vit
TIMEOUT_S = 300  # per command; the slowest (a pipeline under torchrun) took under a minute on 2 busy cores
GRACE_S = 10  # after SIGTERM, before SIGKILL


def quick(config: str, steps: int = 4, val_samples: int = 4, *more: str) -> list[str]:
    """A few steps, little validation, no progress bar."""
    return ["--config", config, "--max_steps", str(steps), "--val_samples", str(val_samples), "--progress", "never",
            "--log_every", "2", *more]


VIT = quick("vit_quickstart", 4, 4, "--val_every", "0")  # tensor and context parallelism's model, and the rollout's
# SwinIR in 4 RSTBs, as docs/beyond-data-parallel.md's laptop command for the pipelines.
PIPELINE = quick("quickstart", 4, 8, "--pp", "2", "--model_args", "{depths: [1,1,1,1], num_heads: [2,2,2,2]}",
                 "--batch_size", "8", "--pp_microbatches", "8")
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
# The packages whose versions follow the torch release rather than constraints.txt (besides torch's own tree).
FOLLOW_TORCH = {"torch", "torchvision"}
REFUSAL = re.compile(r"needs torch >= \S+")
ERROR_LINE = re.compile(r"^(\[rank\d+\]:?\s*)?(\[rank \d+\] )?(error: |[\w.]*(Error|Exception): |\[enforce fail)")


@dataclass(frozen=True)
class Smoke:
    """One command: ``script`` run by python, or under torchrun with 2 processes; ``{run}`` in args is its run
    folder, ``{run:NAME}`` another command's (which then runs first: ``needs``)."""
    name: str
    script: str
    args: tuple = ()
    torchrun: bool = False
    needs: tuple = ()


def _smoke(name: str, script: str, *args: str, torchrun: bool = False, needs: Sequence[str] = ()) -> Smoke:
    return Smoke(name, script, tuple(args), torchrun, tuple(needs))


SMOKES: list[Smoke] = [
    _smoke("train", "train.py", *quick("quickstart"), "--run_dir", "{run}"),
    _smoke("profiling", "train_with_profiling.py", *quick("quickstart"), "--breakdown_steps", "2", "--profile_active", "1",
           "--memory_timeline", "false", "--run_dir", "{run}"),  # the timeline's export alone takes 3 min on 2 cores
    _smoke("ddp", "train_ddp.py", *quick("quickstart"), "--run_dir", "{run}", torchrun=True),
    _smoke("fsdp", "train_fsdp.py", *quick("quickstart"), "--ckpt_every", "2", "--run_dir", "{run}", torchrun=True),
    _smoke("fsdp_resume", "train_fsdp.py", *quick("quickstart", 6), "--resume", "true", "--run_dir", "{run:fsdp}",
           torchrun=True, needs=["fsdp"]),
    _smoke("fsdp_async", "train_fsdp.py", *quick("quickstart"), "--ckpt_async", "true", "--ckpt_every", "2", "--run_dir", "{run}",
           torchrun=True),
    _smoke("mp_vit_tp2", "train_mp.py", *VIT, "--tp", "2", "--run_dir", "{run}", torchrun=True),
    _smoke("mp_vit_cp2", "train_mp.py", *VIT, "--cp", "2", "--run_dir", "{run}", torchrun=True),
    _smoke("mp_swinir_tp2", "train_mp.py", *quick("quickstart"), "--tp", "2", "--run_dir", "{run}", torchrun=True),
    _smoke("mp_swinir_cp2", "train_mp.py", *quick("quickstart"), "--cp", "2", "--run_dir", "{run}", torchrun=True),  # bands
    *(_smoke(f"pp_{schedule}", "train_pp.py", *PIPELINE, "--pp_schedule", schedule, "--run_dir", "{run}",
             torchrun=True) for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")),
    _smoke("vit_train", "train.py", *VIT, "--run_dir", "{run}"),
    _smoke("rollout", "rollout.py", "--checkpoint", "{run:vit_train}", "--steps", "2", "--samples", "2",
           needs=["vit_train"]),
    _smoke("estimate", "estimate_memory.py", "--config", "full_size", "--device", "cuda"),
    _smoke("plan", "plan.py", "--config", "vit_mp", "--cluster", "perlmutter-a100-40", "--nodes", "4", "--top", "3"),
    _smoke("comm_check", "comm_check.py", "--max-bytes", "1MiB", "--seconds-per-size", "0.2", torchrun=True),
]


@dataclass
class Result:
    name: str
    status: str  # ok, refused, FAIL, TIMEOUT
    seconds: float
    detail: str = ""
    log: Optional[Path] = field(default=None, repr=False)


# ----------------------------------------------------------------------------------------- the virtualenv

def _name(requirement: str) -> str:
    """The normalised project name of 'Name==1.0' (PEP 503: runs of -_. are one -)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~;\[ ]", requirement.strip(), maxsplit=1)[0]).lower()


def other_pins(constraints: str, installed: Sequence[str], torch: str) -> str:
    """constraints.txt's pins less the packages already installed with torch (its own dependency tree) and those
    that follow the torch release (torchvision), plus torch==VERSION, so that the second install keeps it."""
    keep = {_name(line) for line in installed if "==" in line} | FOLLOW_TORCH
    pins = [line.strip() for line in constraints.splitlines()
            if "==" in line and not line.lstrip().startswith("#") and _name(line) not in keep]
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


# ----------------------------------------------------------------------------------------- the commands

def selected(names: Sequence[str]) -> list[Smoke]:
    """The commands named (all if none), with the commands they need, in SMOKES order."""
    by_name = {smoke.name: smoke for smoke in SMOKES}
    unknown = [name for name in names if name not in by_name and not any(s.startswith(name) for s in by_name)]
    if unknown:
        raise SystemExit(f"error: no command {', '.join(unknown)}; valid: {', '.join(by_name)} (or a prefix: pp)")
    wanted = {s.name for s in SMOKES if not names or any(s.name == n or s.name.startswith(n) for n in names)}
    wanted |= {need for name in wanted for need in by_name[name].needs}
    return [smoke for smoke in SMOKES if smoke.name in wanted]


def command(smoke: Smoke, python: Path, runs: Path) -> list[str]:
    def fill(arg: str) -> str:
        return re.sub(r"\{run(?::(\w+))?\}", lambda m: str(runs / (m[1] or smoke.name)), arg)
    return [str(python), *(TORCHRUN if smoke.torchrun else []), smoke.script, *map(fill, smoke.args)]


def reason(output: str) -> str:
    """The line that says why a command failed: the first error line (torchrun's own report comes after the
    worker's), else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line) and "ChildFailedError" not in line]
    return (errors or lines or ["(no output)"])[0 if errors else -1][:300]


def end_group(process: subprocess.Popen) -> None:
    """SIGTERM to the process group (torchrun passes it on to its workers), then SIGKILL to whatever is left: a
    worker that hangs in a collective may ignore SIGTERM."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            pass


def run_one(name: str, argv: Sequence[str], timeout_s: float, log: Path, cwd: Path = REPO) -> Result:
    """Run argv in a process group of its own (torchrun's workers included), so that a hang ends with the
    whole group."""
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            code = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            end_group(process)
            return Result(name, "TIMEOUT", time.perf_counter() - start, f"timed out after {timeout_s:g} s", log)
    seconds, output = time.perf_counter() - start, log.read_text(errors="replace")
    if code == 0:
        return Result(name, "ok", seconds, "", log)
    refusal = next((line for line in output.splitlines() if REFUSAL.search(line)), None)
    if refusal:
        return Result(name, "refused", seconds, refusal.strip()[:300], log)
    return Result(name, "FAIL", seconds, f"exit {code}: {reason(output)}", log)


def report_line(result: Result) -> str:
    return f"{result.status:8} {result.name:22} {result.seconds:6.1f} s  {result.detail}".rstrip()


def run_all(smokes: Sequence[Smoke], python: Path, runs: Path, timeout_s: float) -> list[Result]:
    results: dict[str, Result] = {}
    for smoke in smokes:
        failed = [need for need in smoke.needs if results[need].status != "ok"]
        if failed:
            result = Result(smoke.name, "FAIL", 0.0, f"not run: {', '.join(failed)} did not pass")
        else:
            result = run_one(smoke.name, command(smoke, python, runs), timeout_s, runs / f"{smoke.name}.log")
        results[smoke.name] = result
        print(report_line(result), flush=True)
    return list(results.values())


def summary(results: Sequence[Result], torch: str) -> str:
    counts = {status: sum(r.status == status for r in results) for status in ("ok", "refused", "FAIL", "TIMEOUT")}
    minutes, seconds = divmod(round(sum(r.seconds for r in results)), 60)
    return (f"torch {torch}: {counts['ok']} ok, {counts['refused']} refused, {counts['FAIL']} failed, "
            f"{counts['TIMEOUT']} timed out ({minutes} min {seconds} s)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torch", help="the torch version to check, e.g. 2.11.0")
    parser.add_argument("--venv", type=Path, help="its virtualenv (default: .venv-torch-VERSION); reused if it "
                                                  "holds that torch, created if missing")
    parser.add_argument("--index-url", help="where torch comes from, if not PyPI (e.g. PyTorch's CPU wheels)")
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="these commands (or name prefixes)")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per command")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    smokes = selected(args.only)
    if args.list:
        for smoke in smokes:
            shown = command(smoke, Path("python"), Path("runs/torch-VERSION"))
            print(f"{smoke.name:22} {' '.join(shown).replace('python -m torch.distributed.run', 'torchrun')}")
        return 0
    if not args.torch or not re.fullmatch(r"\d+\.\d+\.\d+", args.torch):
        print(f"error: --torch (make test-torch TORCH=...) must be a release such as 2.11.0, got {args.torch!r}",
              file=sys.stderr)
        return 2
    missing = [path for path in DATA if not (REPO / path).exists()]
    if missing:
        print(f"error: {', '.join(missing)} missing: make data data-vit", file=sys.stderr)
        return 2
    python = ensure_venv((args.venv or REPO / f".venv-torch-{args.torch}").absolute(), args.torch, args.index_url)
    runs = REPO / "runs" / f"torch-{args.torch}"
    shutil.rmtree(runs, ignore_errors=True)
    runs.mkdir(parents=True)
    print(f"torch {venv_torch(python)} ({python}), {len(smokes)} commands, at most {args.timeout:g} s each; "
          f"logs in {runs.relative_to(REPO)}/", flush=True)
    results = run_all(smokes, python, runs, args.timeout)
    print(summary(results, args.torch))
    return 1 if any(r.status in ("FAIL", "TIMEOUT") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
