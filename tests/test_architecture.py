"""The house's walls (docs/architecture.md): what `make test` and these tests hold the code to.

- The import contracts of .importlinter (models/ import nothing from utils/, utils/ no model's folder; utils/ in
  layers; the techniques (utils/parallel/) nothing of utils/checkpoint/; no circle among the modules of a package;
  nothing imports tests/) hold, and a new import that breaks one fails `lint-imports` with a line that names it.
  The top-level scripts, modules import-linter cannot take as roots, import neither tests/ nor benchmarks/.
- Imports stand at module top: an import inside a function is allowed only for an optional or heavy
  dependency, with a comment that says why.
- No file in utils/ is longer than a reader takes in at one sitting.
"""

from __future__ import annotations

import ast
import configparser
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
MAX_LINES = 650


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}, timeout=300)


def root_packages() -> list[str]:
    config = configparser.ConfigParser()
    config.read(REPO / ".importlinter")
    return config["importlinter"]["root_packages"].split()


def with_import(tmp_path: Path, module: str, imported: str) -> Path:
    """A copy of the packages the contracts name, and the contracts, in which ``module`` (a path from the repository
    root) also imports ``imported``."""
    root = tmp_path / module.replace("/", "_")
    for package in root_packages():
        shutil.copytree(REPO / package, root / package)
    shutil.copy(REPO / ".importlinter", root / ".importlinter")
    path = root / module
    path.write_text(path.read_text() + f"\nimport {imported}  # noqa: E402\n")
    return root


def test_the_import_contracts_hold_and_a_broken_one_names_the_import(tmp_path):
    kept = lint_imports(REPO)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "7 kept, 0 broken" in kept.stdout
    upward = lint_imports(with_import(tmp_path, "utils/config.py", "utils.training"))  # the ground floor reaching up
    assert upward.returncode != 0
    assert "utils.config -> utils.training" in upward.stdout  # (and, as training imports config, a circle)
    circle = lint_imports(with_import(tmp_path, "utils/data/common.py", "utils.data.era5"))  # a circle inside a room
    assert circle.returncode != 0
    assert "No cycles are allowed in utils.data" in circle.stdout and ".common -> .era5" in circle.stdout
    script = lint_imports(with_import(tmp_path, "utils/predict/store.py", "datasets.convert"))  # library on a script
    assert script.returncode != 0 and "utils.predict.store -> datasets.convert" in script.stdout
    suite = lint_imports(with_import(tmp_path, "examples/fno/fno.py", "tests.conftest"))  # a user's model on the tests
    assert suite.returncode != 0 and "examples.fno.fno -> tests.conftest" in suite.stdout
    model = lint_imports(with_import(tmp_path, "utils/memory/estimate.py", "models.vit.memory"))  # a helper on a model
    assert model.returncode != 0 and "utils.memory.estimate -> models.vit.memory" in model.stdout
    timed = lint_imports(with_import(tmp_path, "models/swinir/memory.py", "utils.plan.comm"))  # a description timing
    assert timed.returncode != 0 and "models.swinir.memory -> utils.plan.comm" in timed.stdout  # (its vocabulary only)
    contents = lint_imports(with_import(tmp_path, "utils/parallel/pipeline_parallel.py", "utils.checkpoint.contents"))
    assert contents.returncode != 0  # a technique building checkpoint contents
    assert "utils.parallel.pipeline_parallel -> utils.checkpoint.contents" in contents.stdout


def test_each_built_in_model_is_a_folder_with_its_spec_behind_the_wall():
    """Adding a built-in model is a folder (its network and its spec) and a registration; utils/ may not import it."""
    from models.spec import built_in, built_in_names  # noqa: PLC0415 (imports torch; the other tests here need none)

    contract = (REPO / ".importlinter").read_text().split("[importlinter:contract:built-in]")[1].split("[")[0]
    assert built_in_names() == ["swinir", "unet3d", "vit"]
    for name in built_in_names():
        assert f"    models.{name}\n" in contract, f"models/{name}/ is not behind the wall of .importlinter"
        assert {"network.py", "spec.py"} <= {p.name for p in (REPO / "models" / name).iterdir()}
        spec = built_in(name)
        assert spec.name == name and spec.build.startswith(f"models.{name}:") and spec.memory is not None


def test_the_top_level_scripts_import_no_tests_and_no_benchmarks():
    """train.py, plan.py, ...: what a user runs stands without the test suite and the benchmarks (import-linter
    takes packages only as its roots, so these modules are read here)."""
    scripts = sorted(REPO.glob("*.py"))
    assert {"train.py", "plan.py", "predict.py"} <= {path.name for path in scripts}
    leaning = []
    for path in scripts:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            leaning += [f"{path.name}:{node.lineno}: {name}" for name in names
                        if name.split(".")[0] in ("tests", "benchmarks")]
    assert not leaning, "top-level scripts importing tests/ or benchmarks/:\n" + "\n".join(leaning)


def python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((REPO / folder).rglob("*.py"))]


def test_imports_inside_functions_say_why():
    unexplained = []
    for path in python_files("utils", "models"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    line, above = lines[inner.lineno - 1], lines[inner.lineno - 2].strip()
                    if "#" not in line and not above.startswith("#"):
                        unexplained.append(f"{path.relative_to(REPO)}:{inner.lineno}: {line.strip()}")
    assert not unexplained, "imports inside functions without a comment saying why:\n" + "\n".join(unexplained)


def test_no_helper_file_outgrows_one_sitting():
    long = [f"{path.relative_to(REPO)}: {n} lines" for path in python_files("utils")
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"over {MAX_LINES} lines, split by job: {long}"
