"""The house's walls (docs/architecture.md): what `make test` and these tests hold the code to.

- The import contracts of .importlinter (models/ import nothing from utils/; utils/ in layers) hold, and a
  new import that breaks them fails `lint-imports` with a line that names it.
- Imports stand at module top: an import inside a function is allowed only for an optional or heavy
  dependency, with a comment that says why.
- No file in utils/ is longer than a reader takes in at one sitting.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
MAX_LINES = 650


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-logo", "--no-cache"], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


def test_the_import_contracts_hold_and_a_new_upward_import_is_named(tmp_path):
    kept = lint_imports(REPO)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "2 kept, 0 broken" in kept.stdout
    for part in ("utils", "models", ".importlinter"):
        copy = shutil.copytree if (REPO / part).is_dir() else shutil.copy
        copy(REPO / part, tmp_path / part)
    config = tmp_path / "utils" / "config.py"  # the lowest layer reaching up to the training helpers
    config.write_text(config.read_text() + "\nimport utils.training  # noqa: E402\n")
    broken = lint_imports(tmp_path)
    assert broken.returncode != 0
    assert "utils.config -> utils.training" in broken.stdout and "1 broken" in broken.stdout


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
