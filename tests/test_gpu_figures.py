"""The pages' GPU figures come from committed reports (benchmarks/results/), or say where else they come from.

A block of a page (a paragraph, a list, a table, a fenced block) that quotes a figure measured on a GPU carries,
on the line just above it, a marker naming its source:

    <!-- gpu-figures: report benchmarks/results/2026-11-28-h200/gpu_check.json [, more files] -->
    <!-- gpu-figures: published NERSC sc23-dl-tutorial README -->
    <!-- gpu-figures: modelled plan.py -->
    <!-- gpu-figures: unreported 2026-11-27 -->
    <!-- gpu-figures: derived from the table above -->

Blocks are separated by blank lines; a fenced block runs to its closing fence, blank lines included, and the
marker of a fenced block that has an `<!-- output: exact -->` line goes above that line. Every decimal figure of a
`report` block must be one of the named files' values as printed (rounded to the figure's decimals, or as a
percentage, or seconds written as milliseconds); ratios (`1.93×`), versions, dates, parameter counts (`11.75 M parameters`), HTML comments and inline
code are not figures. `modelled` names the script whose model printed the figures (plan.py, estimate_memory.py).
`derived` figures are computed in the page from a `report` block earlier on the same page and from figures it
names (a published peak, a published ladder): the page must hold such a report block before it.
`unreported` marks what an earlier GPU session measured before its reports were kept: their number may only
fall (each later GPU session replaces them with reported figures). A block that names the H200, the GPU this
project measured on, and holds a decimal figure must carry a marker; in a list, what counts is the item that
names it (an item's figures are the item's own).
"""

import json
import math
import re
from pathlib import Path

import pytest

from tests.conftest import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!-- gpu-figures: (report|published|modelled|unreported|derived) (.+?) -->$")
FENCE = re.compile(r"^\s*```")
LIST_ITEM = re.compile(r"^(?:[-*+]|\d+[.)]) ")
FIGURE = re.compile(r"(?<![\w.,/-])(\d{1,3}(?:,\d{3})+|\d+)\.(\d+)(?![\w.]*\d\.\d)(?!\.\d)")
NOT_A_FIGURE_BEFORE = re.compile(r"(?:\b(?:torch|CUDA|cuDNN|driver|Python|version)|\bv|sm_)\s*$")
NOT_A_FIGURE_AFTER = re.compile(r"^(?:\s*[×x](?![A-Za-z])|\s?[kMB]?-?\s?parameters?\b)")  # a ratio, a count
UNREPORTED_AT_MOST = 10  # the unreported blocks today; a later GPU session lowers this


def blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number, its marker line or "", the block's text): blocks are separated by blank lines; a fenced block
    runs to its closing fence."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].strip():
            i += 1
            continue
        marker = lines[i] if MARKER.match(lines[i]) else ""
        start = i = i + bool(marker)
        while i < len(lines) and lines[i].strip():
            if FENCE.match(lines[i]):
                i += 1
                while i < len(lines) and not FENCE.match(lines[i]):
                    i += 1
            i += 1
        found.append((start + 1, marker, "\n".join(lines[start:i])))
    return found


def units(block: str) -> list[str]:
    """What the H200 rule reads as one: a list's items one by one, any other block whole."""
    if not LIST_ITEM.match(block):
        return [block]
    items: list[str] = []
    for line in block.splitlines():
        if LIST_ITEM.match(line) or not items:
            items.append(line)
        else:
            items[-1] += "\n" + line
    return items


def figures(block: str) -> list[str]:
    """The decimal figures of a block, without HTML comments, inline code, versions, dates, ratios and counts of
    parameters (inside a fence, every line is output: nothing is taken out but the fences)."""
    kept, fenced = [], False
    for line in block.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            kept.append("")
        else:
            kept.append(line if fenced else re.sub(r"<!--.*?-->|`[^`\n]*`", " ", line))
    prose = "\n".join(kept)
    found = []
    for match in FIGURE.finditer(prose):
        if NOT_A_FIGURE_BEFORE.search(prose[:match.start()]) or NOT_A_FIGURE_AFTER.match(prose[match.end():]):
            continue
        found.append(match.group(0).replace(",", ""))
    return found


def report_values(paths: list[Path]) -> list[float]:
    values: list[float] = []

    def walk(value):
        if isinstance(value, bool):
            return
        if isinstance(value, (int, float)):
            values.append(float(value))
        elif isinstance(value, str):
            values.extend(float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", value))
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for path in paths:
        text = path.read_text()
        walk(json.loads(text) if path.suffix == ".json" else text)
    return values


def printed(figure: str, values: list[float]) -> bool:
    """Whether some value, rounded to the figure's decimals (or as a percentage, or seconds as ms), is the figure."""
    x, decimals = float(figure), len(figure.split(".")[1])
    half = 0.5 * 10 ** -decimals + 1e-9
    return any(math.isfinite(v) and any(abs(scale * v - x) <= half for scale in (1, 100, 1000, -1)) for v in values)


def marked_blocks():
    for page in PAGES:
        for line, marker, block in blocks(page.read_text()):
            yield page, line, marker, block


def test_every_reported_gpu_figure_is_a_value_of_its_report():
    wrong, checked = [], 0
    for page, line, marker, block in marked_blocks():
        match = MARKER.match(marker)
        if not match or match.group(1) != "report":
            continue
        paths = [REPO / p.strip() for p in match.group(2).split(",")]
        missing = [str(p) for p in paths if not p.is_file()]
        assert not missing, f"{page.name}:{line}: no report {missing}"
        values = report_values(paths)
        for figure in figures(block):
            checked += 1
            if not printed(figure, values):
                wrong.append(f"{page.name}:{line}: {figure} is in none of {match.group(2)}")
    assert not wrong, "\n".join(wrong)
    assert checked >= 40  # the pages quote the reports, or this test checks nothing


def test_a_block_with_h200_figures_says_where_they_come_from():
    unmarked = [f"{page.name}:{line}: {block[:100]!r}" for page, line, marker, block in marked_blocks()
                if not marker and any("H200" in unit and figures(unit) for unit in units(block))]
    assert not unmarked, "\n".join(unmarked)
    unreported = [(page.name, line) for page, line, marker, _ in marked_blocks() if " unreported " in marker]
    assert len(unreported) <= UNREPORTED_AT_MOST, unreported
    reported_before: dict = {}
    for page, line, marker, _ in marked_blocks():
        if " report " in marker:
            reported_before.setdefault(page, line)
        elif " derived " in marker:
            assert reported_before.get(page, line) < line, f"{page.name}:{line}: derived from no report block above it"


def test_every_marker_is_well_formed_and_marks_a_block():
    wrong = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if "gpu-figures" not in line:
                continue
            if not MARKER.match(line):
                wrong.append(f"{page.name}:{i + 1}: {line!r} is not `<!-- gpu-figures: KIND SOURCE -->`")
            elif i + 1 == len(lines) or not lines[i + 1].strip() or MARKER.match(lines[i + 1]):
                wrong.append(f"{page.name}:{i + 1}: the marker marks no block (it goes on the line just above one)")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("text, expected", [
    ("58.45 samples/s, then 1.55× and torch 2.11.0+cu130 on 2026-11-28, `--lr 0.5`", ["58.45"]),
    ("| bf16 | 94.56 | 1.05 x | 4.3 % |", ["94.56", "4.3"]),
    ("40,044.5 events at CUDA 13.0", ["40044.5"]),
    ("a 0.9343 MB trace, −0.3 %, 1.9x, cuDNN 9.19, 2.7.1 up", ["0.9343", "0.3"]),
    ("SwinIR (11.75 M parameters, 11.8M parameters, a 350.1M-parameter ViT) at 99.62 GB", ["99.62"]),
    ("<!-- output: exact -->\n```text\n$ python x.py `a 1.5`\n  total   99.342\n```", ["1.5", "99.342"]),
])
def test_what_counts_as_a_figure(text, expected):
    assert figures(text) == expected


def test_a_figure_matches_a_value_as_printed_and_not_otherwise():
    assert printed("49.25", [49.2513]) and printed("4.3", [0.043]) and printed("0.16", [0.1586])
    assert printed("454.9", [0.45489]) and printed("-0.3", [-0.003])
    assert not printed("49.4", [49.25]) and not printed("210.3", [205.3, 94.56])


def test_a_fence_is_one_block_and_a_list_is_read_item_by_item():
    text = ("<!-- gpu-figures: modelled estimate_memory.py -->\n<!-- output: exact -->\n```text\n$ python a.py\n\n"
            "  total 1.5\n```\n\n- on an H200: 2.5 GB\n- 278.39 K\n")
    (line, marker, fence), (_, bare, listed) = blocks(text)
    assert line == 2 and marker.startswith("<!-- gpu-figures: modelled") and fence.endswith("total 1.5\n```")
    assert not bare and units(listed) == ["- on an H200: 2.5 GB", "- 278.39 K"]

