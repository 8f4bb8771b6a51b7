"""Which build of the pinned torch this node's NVIDIA driver can run: PyPI's default wheel or PyTorch's CUDA 12.6 one.

    python3 tools/torch_build.py                # one line: the build, and why
    python3 tools/torch_build.py --index-url    # the index URL alone (empty: PyPI), for the Makefile's install
    python3 tools/torch_build.py --install      # in an existing environment (conda): the pinned torch of that build
    python3 tools/torch_build.py --install --dry-run   # the pip commands --install would run, not run

It reads the driver version from `nvidia-smi` and looks it up in BUILDS. `make install` runs it when TORCH_INDEX is
not given (a TORCH_INDEX you set wins); `--install` fixes an environment that exists (conda-env.yml's, or one whose
torch does not see the GPU), with the python that runs it. Standard library only, and it never imports torch: it
decides before torch is there, and must not depend on the torch it may replace.

A driver older than every CUDA build of the pin (< 525) stops every mode: one `error:` line, exit 1 (`make install`
then stops before its stamp). No GPU here (no nvidia-smi, or it lists none): PyPI's wheel, with one `warning:` line,
since a login node without a GPU cannot say which build the GPU nodes need. The CUDA 12 build replaces torch and
torchvision together (torchvision refuses a torch of another CUDA major) and first removes the CUDA 13 libraries
that PyPI's torch pulled in (its nvidia-* and cuda-* requirements, followed through cuda-toolkit's).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "constraints.txt"
PYPI = ""  # no --index-url: PyPI's default wheel
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
SMI = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
SMI_TIMEOUT_S = 10  # a hung driver must not hang `make install`
FIX = "python3 tools/torch_build.py --install"
MODULE_HINT = (f"use the site's PyTorch module (docs/setup.md), or the CPU build: "
               f"make install TORCH_INDEX={CPU_INDEX}")


@dataclass(frozen=True)
class Build:
    """A build of the pinned torch: its CUDA, where pip finds it, and the oldest driver branch that runs it."""
    cuda: str
    index: str
    min_driver: int


# Newest first; the first row whose driver branch this node's driver reaches is installed. CUDA 13.x runs on drivers
# >= 580 and CUDA 12.x on drivers >= 525 (minor-version compatibility: a CUDA 12.6 build runs on a driver made for
# 12.4, such as 550). Source: NVIDIA's table, https://docs.nvidia.com/deploy/cuda-compatibility/ (Minor Version
# Compatibility). Below 525 no CUDA build of the pinned torch runs. The CUDA of PyPI's wheel changes with the pin
# (torch.version.cuda of the lock's torch): refresh this row with `make lock`.
BUILDS = (
    Build(cuda="13.2", index=PYPI, min_driver=580),
    Build(cuda="12.6", index="https://download.pytorch.org/whl/cu126", min_driver=525),
)


@dataclass(frozen=True)
class Driver:
    """What nvidia-smi said: the driver version of the first GPU it lists, or why there is none."""
    version: Optional[str]
    why_none: str = ""


@dataclass(frozen=True)
class Choice:
    build: Optional[Build]  # None: PyPI's default wheel, with no GPU to serve or a driver too old for any CUDA build
    line: str  # the one line that says which and why
    too_old: bool = False  # a GPU whose driver no CUDA build of the pin runs on

    @property
    def index(self) -> str:
        return self.build.index if self.build else PYPI


def query_driver(timeout: float = SMI_TIMEOUT_S) -> Driver:
    try:
        proc = subprocess.run(SMI, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return Driver(None, "no nvidia-smi here")
    except (OSError, subprocess.TimeoutExpired) as error:
        return Driver(None, f"nvidia-smi did not answer ({type(error).__name__})")
    if proc.returncode:
        said = (proc.stdout + proc.stderr).strip().splitlines()
        return Driver(None, f"nvidia-smi failed (exit {proc.returncode}{': ' + said[0] if said else ''})")
    versions = proc.stdout.split()  # one line per GPU; every GPU of a node runs the same driver
    if not versions:
        return Driver(None, "nvidia-smi lists no GPU")
    if not re.fullmatch(r"\d+(\.\d+)*", versions[0]):
        return Driver(None, f"nvidia-smi's driver version {versions[0]!r} is not a version number")
    return Driver(versions[0])


def branch(version: str) -> int:
    return int(version.split(".")[0])  # NVIDIA's table speaks of branches: 550.54.15 is branch 550


def choose(driver: Driver) -> Choice:
    if driver.version is None:
        return Choice(None, f"warning: torch build: PyPI's default wheel (CUDA {BUILDS[0].cuda}, driver >= "
                            f"{BUILDS[0].min_driver}), unchecked: {driver.why_none}; for GPU jobs run this on a GPU "
                            f"node, whose driver decides the build")
    newest = BUILDS[0]
    for build in BUILDS:
        if branch(driver.version) >= build.min_driver:
            where = "PyPI (the default wheel)" if build.index == PYPI else build.index
            why = (f">= {build.min_driver}, which CUDA {major(build.cuda)} needs" if build is newest else
                   f"< {newest.min_driver}, which CUDA {major(newest.cuda)} needs")
            return Choice(build, f"torch build: CUDA {build.cuda} from {where}: the driver is {driver.version} ({why})")
    oldest = BUILDS[-1]
    return Choice(None, f"error: the NVIDIA driver is {driver.version} (< {oldest.min_driver}, which CUDA "
                        f"{major(oldest.cuda)} needs): no CUDA build of torch {pin('torch')} runs on it, nothing "
                        f"installed; {MODULE_HINT}", too_old=True)


def major(cuda: Optional[str]) -> Optional[str]:
    return cuda.split(".")[0] if cuda else None


def pin(name: str, lock: Path = LOCK) -> str:
    pins = re.findall(rf"^{re.escape(name)}==(\S+)\s*$", lock.read_text(), re.MULTILINE)
    if len(pins) != 1:
        raise SystemExit(f"error: {lock.name} should pin {name} once ({name}==VERSION), found {len(pins)} pins")
    return pins[0]


def torch_pin(lock: Path = LOCK) -> str:
    return pin("torch", lock)


def unseen_gpu(driver: Driver, cuda_available: bool, torch_version: str, torch_cuda: Optional[str],
               visible_devices: Optional[str]) -> str:
    """Empty when torch sees the GPU nvidia-smi lists (or none is listed, or CUDA_VISIBLE_DEVICES hides it on
    purpose); else one message naming the driver, torch's CUDA and what to do."""
    if cuda_available or driver.version is None or visible_devices in ("", "-1"):
        return ""
    choice = choose(driver)
    said = (f"torch {torch_version} (torch.version.cuda: {torch_cuda}) sees no GPU, but nvidia-smi lists one "
            f"with driver {driver.version}")
    if choice.build is None:
        return f"{said}; no CUDA build of torch {torch_pin()} runs on that driver: {MODULE_HINT}"
    if major(torch_cuda) == major(choice.build.cuda):
        shown = "unset" if visible_devices is None else repr(visible_devices)
        return (f"{said}; that torch's CUDA suits the driver, so look at the node: CUDA_VISIBLE_DEVICES "
                f"({shown}), the GPUs the job was given (--gpus)")
    return f"{said}; CUDA {choice.build.cuda} suits it: {FIX} (or make install in a fresh clone)"


PAIR = ("torch", "torchvision")  # installed together from one index: torchvision checks that its CUDA is torch's
CUDA_PREFIXES = ("nvidia-", "cuda-")  # the CUDA libraries a torch wheel pulls in (PyPI's: cuda-toolkit, nvidia-*)


def installed(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_torch() -> Optional[str]:
    return installed("torch")


def cuda_libraries(root: str = "torch", version_of: Callable[[str], Optional[str]] = installed,
                   requires_of: Callable[[str], Optional[list]] = importlib.metadata.requires) -> list[str]:
    """The installed nvidia-* / cuda-* distributions ``root`` requires, directly or through one another (PyPI's torch:
    cuda-toolkit, which requires nvidia-cublas, ...): what a torch of another CUDA leaves behind."""
    found, todo = set(), [root]
    while todo:
        try:
            requires = requires_of(todo.pop()) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            name = re.split(r"[\s\[;<>=!~(]", line.strip(), maxsplit=1)[0].lower().replace("_", "-")
            if name.startswith(CUDA_PREFIXES) and name not in found and version_of(name) is not None:
                found.add(name)
                todo.append(name)
    return sorted(found)


def install_commands(choice: Choice, versions: dict, cuda_libs: Sequence[str] = (),
                     python: str = sys.executable) -> list[list[str]]:
    """The pip commands that put the chosen build of the pinned torch and torchvision in place (none when they are
    there). ``versions``: the installed versions of PAIR (None: not installed); ``cuda_libs``: cuda_libraries()."""
    pins = [f"{name}=={pin(name)}" for name in PAIR]
    pip = [python, "-m", "pip"]
    if choice.index != PYPI:
        # With the local label (+cu126): PyPI's 2.15.0 already satisfies torch==2.15.0, and pip would keep it.
        label = choice.index.rstrip("/").rsplit("/", 1)[-1]
        if all((versions.get(name) or "").endswith(f"+{label}") for name in PAIR):
            return []
        present = [name for name in PAIR if versions.get(name)]
        remove = [pip + ["uninstall", "-y", *present, *cuda_libs]] if present else []
        return remove + [pip + ["install", *(f"{p}+{label}" for p in pins), "--index-url", choice.index]]
    if versions.get("torch") is None:
        return [pip + ["install", *pins, "-c", str(LOCK)]]
    if any("+" in (versions.get(name) or "") for name in PAIR):
        # Another index's build (+cpu, +cu126) where PyPI's fits: PyPI's wheels again, with the lock's dependencies.
        return [pip + ["install", "--force-reinstall", *pins, "-c", str(LOCK)]]
    return []


def install(choice: Choice, versions: dict, cuda_libs: Sequence[str] = (),
            run: Callable[[Sequence[str]], int] = subprocess.call, dry_run: bool = False) -> int:
    """``--install``: the chosen build into this python's environment; exit 1 where none can serve the GPU."""
    if choice.too_old:
        print(choice.line, file=sys.stderr)
        return 1
    print(choice.line, flush=True)
    commands = install_commands(choice, versions, cuda_libs)
    if not commands:
        shown = ", ".join(f"{name} {versions.get(name)}" for name in PAIR)
        print(f"{shown}: the build that fits: nothing to do")
        return 0
    for command in commands:
        print(("would run: " if dry_run else "$ ") + " ".join(command), flush=True)
        code = 0 if dry_run else run(command)
        if code:
            where = choice.index or "PyPI"
            print(f"error: pip could not install torch {torch_pin()} from {where} (its reason above); {MODULE_HINT}",
                  file=sys.stderr)
            return code
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--index-url", action="store_true",
                      help="print the index URL alone (empty: PyPI); the one line goes to stderr")
    what.add_argument("--install", action="store_true",
                      help="install the chosen build of the pinned torch and torchvision into this python")
    parser.add_argument("--dry-run", action="store_true", help="with --install: print the pip commands, run none")
    args = parser.parse_args(argv)
    if args.dry_run and not args.install:
        parser.error("--dry-run goes with --install")
    choice = choose(query_driver())
    if choice.too_old:  # every mode: one line, exit 1 (make install stops before its stamp)
        print(choice.line, file=sys.stderr)
        return 1
    if args.install:
        return install(choice, {name: installed(name) for name in PAIR}, cuda_libraries(), dry_run=args.dry_run)
    if args.index_url:
        print(choice.line, file=sys.stderr)  # the Makefile shows the why; stdout is what it uses
        print(choice.index)
        return 0
    print(choice.line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
