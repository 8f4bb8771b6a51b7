"""The runner that `make test-torch` (tests/torch_versions.py) and `make test-libraries` (tests/libraries.py) share: a
list of commands, each a project script run as a user runs it (python, or torchrun with 2 processes), each in a
process group of its own with a time limit, one line per command (ok, refused, FAIL, TIMEOUT) and a summary.

"refused" is a script declining a feature this torch lacks in one line that names the torch it needs ("needs torch
>= X"): expected on old releases, not a failure. Standard library only, so any python3 runs it; the commands run
with a virtualenv's python. tests/test_torch_versions.py checks it in seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
GRACE_S = 10  # after SIGTERM, before SIGKILL
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
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


def smoke(name: str, script: str, *args: str, torchrun: bool = False, needs: Sequence[str] = ()) -> Smoke:
    return Smoke(name, script, tuple(args), torchrun, tuple(needs))


@dataclass
class Result:
    name: str
    status: str  # ok, refused, FAIL, TIMEOUT
    seconds: float
    detail: str = ""
    log: Optional[Path] = field(default=None, repr=False)


def project_name(requirement: str) -> str:
    """The normalised project name of 'Name==1.0' (PEP 503: runs of -_. are one -)."""
    return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~;\[ ]", requirement.strip(), maxsplit=1)[0]).lower()


def selected(smokes: Sequence[Smoke], names: Sequence[str]) -> list[Smoke]:
    """The commands named (all if none; a name may be a prefix), with the commands they need, in list order."""
    by_name = {s.name: s for s in smokes}
    unknown = [name for name in names if not any(s.startswith(name) for s in by_name)]
    if unknown:
        raise SystemExit(f"error: no command {', '.join(unknown)}; valid: {', '.join(by_name)} (or a prefix of them)")
    wanted = {s.name for s in smokes if not names or any(s.name.startswith(n) for n in names)}
    while True:  # what they need, and what that needs
        needed = wanted | {need for name in wanted for need in by_name[name].needs}
        if needed == wanted:
            return [s for s in smokes if s.name in wanted]
        wanted = needed


def command(smoke: Smoke, python: Path, runs: Path) -> list[str]:
    def fill(arg: str) -> str:
        return re.sub(r"\{run(?::(\w+))?\}", lambda m: str(runs / (m[1] or smoke.name)), arg)
    return [str(python), *(TORCHRUN if smoke.torchrun else []), smoke.script, *map(fill, smoke.args)]


def shown(smoke: Smoke, runs: str) -> str:
    """The command as a user types it (torchrun for python -m torch.distributed.run)."""
    return " ".join(command(smoke, Path("python"), Path(runs))).replace("python -m torch.distributed.run", "torchrun")


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


def run_all(smokes: Sequence[Smoke], python: Path, runs: Path, timeout_s: float, jobs: int = 1) -> list[Result]:
    """Each command once what it needs has passed, ``jobs`` at a time (a command that imports torch spends most of its
    seconds on one core: two at a time keep two cores busy), in list order as far as they are ready; one line each
    as it ends. The results in list order."""
    results: dict[str, Result] = {}
    pending, running = list(smokes), {}
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        while pending or running:
            for smoke in [s for s in pending if all(need in results for need in s.needs)]:
                if len(running) >= max(1, jobs):
                    break
                pending.remove(smoke)
                failed = [need for need in smoke.needs if results[need].status != "ok"]
                if failed:
                    results[smoke.name] = Result(smoke.name, "FAIL", 0.0, f"not run: {', '.join(failed)} did not pass")
                    print(report_line(results[smoke.name]), flush=True)
                    continue
                running[pool.submit(run_one, smoke.name, command(smoke, python, runs), timeout_s,
                                    runs / f"{smoke.name}.log")] = smoke
            if not running:  # every ready one was told "not run": the next round takes what that readied
                if not any(all(need in results for need in s.needs) for s in pending) and pending:
                    raise SystemExit(f"error: {pending[0].name} needs a command that is not in the list")
                continue
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                results[running.pop(future).name] = future.result()
                print(report_line(future.result()), flush=True)
    return [results[smoke.name] for smoke in smokes]


def summary(results: Sequence[Result], what: str, seconds: Optional[float] = None) -> str:
    """The counts, and ``seconds`` (the wall time of them all; by default the commands' own times added up)."""
    counts = {status: sum(r.status == status for r in results) for status in ("ok", "refused", "FAIL", "TIMEOUT")}
    minutes, rest = divmod(round(sum(r.seconds for r in results) if seconds is None else seconds), 60)
    return (f"{what}: {counts['ok']} ok, {counts['refused']} refused, {counts['FAIL']} failed, "
            f"{counts['TIMEOUT']} timed out ({minutes} min {rest} s)")


def failed(results: Sequence[Result]) -> bool:
    return any(r.status in ("FAIL", "TIMEOUT") for r in results)


def add_arguments(parser: argparse.ArgumentParser, timeout_s: float, jobs: int = 1) -> None:
    """The options every runner has: --only, --timeout, --jobs, --list."""
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="these commands (or name prefixes)")
    parser.add_argument("--timeout", type=float, default=timeout_s, help="seconds per command")
    parser.add_argument("--jobs", type=int, default=jobs, help="commands run at a time")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")


def print_list(smokes: Sequence[Smoke], runs: str) -> None:
    for s in smokes:
        print(f"{s.name:22} {shown(s, runs)}")


def error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2
