"""The pages' deterministic outputs: a block marked exact shows what its command prints, numbers included.

In README.md, docs/*.md and datasets/README.md, the line

    <!-- output: exact -->

right before a ```text block says that its command's output does not depend on timing, the machine or the data
(the memory estimate, plan.py on a cluster of config/clusters/clusters.yaml, the modelled scaling): the block
shows the whole output, every line as printed. tests/test_readme.py runs the command and compares the block with
it line by line; other output blocks keep their machine's figures and are compared by shape, numbers masked.
After a change that moves such a figure, one command rewrites every marked block from a fresh run:

    python -m tests.page_outputs --write      # make docs-outputs; without --write: list what differs, exit 1
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "<!-- output: exact -->"


class PageError(ValueError):
    """A marker that marks no output block (one line: where, and what is wrong)."""


@dataclass
class ExactBlock:
    page: Path
    fence: int  # index of the ```text line
    end: int  # index of the closing ```
    command: str  # as written after "$ "
    shown: list[str]  # the output lines under it

    @property
    def line(self) -> int:
        """The 1-based line of ``$ command``: tests/test_readme.py's Command.line."""
        return self.fence + 2


def exact_blocks(page: Path) -> list[ExactBlock]:
    lines, blocks = page.read_text().splitlines(), []
    for index, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        where = f"{page.name}:{index + 1}"
        if index + 2 >= len(lines) or lines[index + 1] != "```text" or not lines[index + 2].startswith("$ "):
            raise PageError(f"{where}: {MARKER} must come right before a ```text block that starts with `$ command`")
        if lines[index + 2].rstrip().endswith("\\"):
            raise PageError(f"{where}: an exact block's command is one line")
        end = next((k for k in range(index + 3, len(lines)) if lines[k].startswith("```")), None)
        if end is None:
            raise PageError(f"{where}: the marked block is not closed")
        shown = lines[index + 3:end]
        if any(line.strip() == "..." for line in shown):
            raise PageError(f"{where}: an exact block shows the whole output (no `...`)")
        blocks.append(ExactBlock(page, index + 1, end, lines[index + 2][2:], shown))
    return blocks


def printed_lines(output: str) -> list[str]:
    """The output as a page shows it: trailing spaces and trailing blank lines dropped."""
    lines = [line.rstrip() for line in output.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def differences(block: ExactBlock, output: str) -> str:
    """A unified diff of the block against the output ('' when they agree)."""
    shown = [line.rstrip() for line in block.shown]
    return "\n".join(difflib.unified_diff(shown, printed_lines(output), "page", "printed now", lineterm=""))


def rewrite(page: Path, outputs: dict[int, str]) -> None:
    """Replace the output of the marked blocks (by fence index) with ``outputs``; the rest of the page stays."""
    lines = page.read_text().splitlines()
    for block in sorted(exact_blocks(page), key=lambda b: -b.fence):  # from the end: indices stay valid
        if block.fence in outputs:
            lines[block.fence + 2:block.end] = printed_lines(outputs[block.fence])
    page.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the marked blocks that differ")
    args = parser.parse_args(argv)
    from tests.test_readme import PAGES, REPO, canonical, run_command  # it imports this module: not at the top

    with tempfile.TemporaryDirectory() as scratch:
        ws = workspace(REPO, Path(scratch))
        return rewrite_all(PAGES, args.write, ws, lambda command, where: run_command(canonical(command), where))


def workspace(repo: Path, scratch: Path) -> Path:
    """A copy of the repository layout as tests/test_readme.py runs the pages in (links), without data sets: a
    command that reads the data (the estimate's field size) prints here what it prints there."""
    ws = scratch / "repo"
    (ws / "datasets").mkdir(parents=True)
    for entry in repo.iterdir():
        if entry.name not in ("runs", "datasets", ".git"):
            (ws / entry.name).symlink_to(entry)
    for entry in (repo / "datasets").iterdir():
        if entry.is_file():  # the scripts, not the data
            (ws / "datasets" / entry.name).symlink_to(entry)
    return ws


def rewrite_all(pages: list[Path], write: bool, ws: Path, run) -> int:
    """Run every marked block's command in ``ws``; print what differs, rewrite it with ``write``."""
    here, stale = os.getcwd(), 0
    os.chdir(ws)  # the commands run as the pages write them, from the repository root
    try:
        for page in pages:
            stale += check_page(page, write, ws, run)
    finally:
        os.chdir(here)
    action = "rewrote" if write else "differ; `make docs-outputs` rewrites them"
    print(f"{stale} marked output block(s) {action}" if stale else
          "every marked output block equals its command's output")
    return 1 if stale and not write else 0


def check_page(page: Path, write: bool, ws: Path, run) -> int:
    stale, outputs, name = 0, {}, page.name
    for block in exact_blocks(page):
        result = run(block.command, ws)
        diff = differences(block, result.output)
        if result.returncode:  # a crash's traceback is no output to show
            stale += 1
            print(f"{name}:{block.line}: `{result.ran}` exited {result.returncode}; not rewritten\n"
                  f"{result.output[-2000:]}")
        elif diff:
            stale += 1
            outputs[block.fence] = result.output
            print(f"{name}:{block.line}: {block.command}\n{diff}\n")
    if outputs and write:
        rewrite(page, outputs)
    return stale


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PageError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
