"""The install the README gives is the one the pages use: predict.py and evaluate.py (every part's "use the model"
section) run in the environment of the README's setup, `make train`, and nothing more.

That environment is what `make install` puts into a fresh virtualenv: pip's resolution of the requirement files its
recipe names (requirements.txt, with constraints.txt). CI runs the suite in a fuller one (`make test` adds
requirements-data.txt first), where a module the base install lacks is found anyway: that is how `predict.py --out
runs/quickstart/sr.zarr` came to end in a traceback after `make train` (xarray there through a test requirement,
zarr only in requirements-data.txt), unseen.

Building that environment for real takes minutes, the network and 5.7 GB (torch and its CUDA libraries), per run.
This test builds the same environment from what is installed here instead, honestly and in about a second:

1. the requirement files: those the Makefile's install recipe passes to pip (`make -n install`), so a change of
   the recipe is followed;
2. the distributions: those files' requirements and, recursively, what each installed distribution's own metadata
   requires (Requires-Dist, its markers evaluated for this interpreter, extras followed): what pip's resolver
   computes from the same metadata, the pins being those installed here (tests/test_install.py checks that they
   are constraints.txt's). A distribution required but not installed here fails the test: run `make install`;
3. the environment: a new virtualenv (its own interpreter, no system or user site-packages) whose site-packages
   holds links to exactly those distributions' files (each entry their RECORD lists; a folder shared with another
   distribution, a namespace such as google/, is made and linked into file by file) and nothing else. A module of
   any other distribution is not found there, as in the README's environment; import hooks that hide modules
   would also hide them from `importlib.util.find_spec`, which xarray asks before it imports, and would not be
   that environment.

In it, Part I's predict.py (a super-resolution store, tiled), Part II's (a forecast store) and Part II's
evaluate.py (scores.nc and the scorecard), on the tests' tiny runs, each as its own `python SCRIPT` command.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO
from tests.test_install import installed_distributions, make_dry_run, nvidia_smi


def install_requirement_files(tmp_path: Path) -> list[str]:
    """The requirement files `make install` passes to pip (its recipe, printed by make -n; no GPU asked)."""
    recipe = make_dry_run("-B", "install", f"VENV={tmp_path / 'never-made'}", path=nvidia_smi(tmp_path / "smi"))
    files = [name for line in recipe.splitlines() if "-m pip install" in line
             for name in re.findall(r"(?:^|\s)-r\s+(\S+)", line)]
    assert files, f"make -n install runs no `pip install -r FILE`:\n{recipe}"
    return files


def requirements_of(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def resolve(requirements: list[Requirement], dists: dict) -> set[str]:
    """The distributions ``requirements`` bring, by the installed distributions' own metadata (module docstring)."""
    asked: dict[str, set[str]] = defaultdict(set)  # distribution -> what was asked of it: itself (""), its extras
    queue = [(req, "") for req in requirements]  # (a requirement, the extra of the distribution that states it)
    while queue:
        req, extra = queue.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name not in dists:
            pytest.fail(f"{req.name} is required by the base install but not installed here: run make install")
        for new in {"", *req.extras} - asked[name]:
            asked[name].add(new)
            queue += [(Requirement(line), new) for line in dists[name].requires or []]
    return set(asked)


def link_environment(venv: Path, names: set[str], dists: dict) -> None:
    """A virtualenv at ``venv`` whose site-packages links to the files of the distributions ``names``, only."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    assert site.is_dir(), f"no {site}"
    ours: dict[tuple[Path, str], list[Path]] = defaultdict(list)  # (site folder, top entry) -> files under it
    theirs: set[tuple[Path, str]] = set()
    for name, dist in dists.items():
        root = Path(dist.locate_file(""))
        for file in dist.files or []:
            if file.parts[0] != "..":  # scripts in bin/: not modules
                if name in names:
                    ours[(root, file.parts[0])].append(Path(*file.parts))
                else:
                    theirs.add((root, file.parts[0]))
    for (root, top), files in ours.items():
        if (root, top) not in theirs:  # the whole entry is ours: one link
            if not (site / top).exists():
                (site / top).symlink_to(root / top)
            continue
        for file in files:  # shared with a distribution that is not ours: our files alone
            if (root / file).exists() and not (site / file).exists():
                (site / file).parent.mkdir(parents=True, exist_ok=True)
                (site / file).symlink_to(root / file)


@pytest.fixture(scope="module")
def base_python(tmp_path_factory) -> Path:
    """The python of an environment that holds what `make install` installs, and nothing else."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    tmp = tmp_path_factory.mktemp("base_install")
    dists = installed_distributions()
    requirements = [req for file in install_requirement_files(tmp) for req in requirements_of(REPO / file)]
    names = resolve(requirements, dists)
    if "pip" in dists:
        names.add("pip")  # python -m venv installs it, as in the README's environment
    link_environment(tmp / "venv", names, dists)
    return tmp / "venv" / "bin" / "python"


def run_in(python: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return subprocess.run([str(python), *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**env, "OMP_NUM_THREADS": "1"})


def test_a_module_the_base_install_does_not_bring_is_not_found_there(base_python):
    # The converter's further readers (requirements-data.txt), which make test installs here: not there; torch is.
    code = "import importlib.util as u; print([u.find_spec(m) is not None for m in ('cfgrib', 'h5netcdf', 'torch')])"
    said = run_in(base_python, "-c", code)
    assert said.returncode == 0 and said.stdout.strip() == "[False, False, True]", said.stdout + said.stderr


def test_predict_and_evaluate_run_after_the_readmes_install_alone(base_python, reference_run, vit_reference, vit_data,
                                                                  tmp_path):
    commands = [  # Part I: predict (sr, tiled); Part II: predict (a forecast), evaluate (scores.nc, scorecard)
        ["predict.py", "--checkpoint", str(reference_run), "--out", str(tmp_path / "sr.zarr"), "--times", "0:2",
         "--tile", "32", "--overlap", "8", "--progress", "never"],
        ["predict.py", "--checkpoint", str(vit_reference), "--out", str(tmp_path / "forecasts.zarr"), "--steps", "2",
         "--times", "0:4", "--picture", "none", "--progress", "never"],
        ["evaluate.py", "--forecast", str(tmp_path / "forecasts.zarr"), "--truth", str(vit_data), "--out",
         str(tmp_path / "scores.nc"), "--png", str(tmp_path / "scorecard.png")],
    ]
    for command in commands:
        proc = run_in(base_python, *command)
        assert proc.returncode == 0, f"python {' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    for output in ("sr.zarr", "forecasts.zarr", "scores.nc", "scorecard.png"):
        assert (tmp_path / output).exists(), output
