"""tests/page_outputs.py: blocks marked exact are found, compared line by line and rewritten; a misplaced marker
is one line."""

import pytest

from tests.conftest import REPO
from tests.page_outputs import MARKER, PageError, differences, exact_blocks, rewrite

PAGE = f"""# A page

{MARKER}
```text
$ python plan.py --config x
total   10.52   
why: fits
```

```text
$ python train.py --config quickstart
step 1 | loss 0.5
```
"""


def test_a_marked_block_is_compared_whole_and_rewritten_alone(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    [block] = exact_blocks(page)  # the unmarked block is compared by shape elsewhere
    assert (block.command, block.line) == ("python plan.py --config x", 5)
    assert block.shown == ["total   10.52   ", "why: fits"]
    assert differences(block, "total   10.52\nwhy: fits\n\n") == ""  # trailing spaces and blank lines do not count
    diff = differences(block, "total   11.48\nwhy: fits\n")
    assert "-total   10.52" in diff and "+total   11.48" in diff
    rewrite(page, {block.fence: "total   11.48  \nwhy: fits\nnew line\n"})
    assert page.read_text() == PAGE.replace("total   10.52   \nwhy: fits", "total   11.48\nwhy: fits\nnew line")
    assert differences(exact_blocks(page)[0], "total   11.48\nwhy: fits\nnew line") == ""


@pytest.mark.parametrize("text, problem", [
    (f"{MARKER}\n\n```text\n$ python plan.py\n```\n", "must come right before a ```text block"),
    (f"{MARKER}\n```text cluster\n$ python plan.py\n```\n", "must come right before a ```text block"),
    (f"{MARKER}\n```text\n$ python plan.py\nrow\n...\n```\n", "shows the whole output"),
    (f"{MARKER}\n```text\n$ python plan.py\nrow\n", "is not closed"),
])
def test_a_misplaced_marker_is_one_line(tmp_path, text, problem):
    page = tmp_path / "page.md"
    page.write_text(text)
    with pytest.raises(PageError, match=f"page.md:1: .*{problem[:20]}"):
        exact_blocks(page)


def test_the_command_reports_stale_blocks_and_rewrites_them_with_write(tmp_path, capsys):
    from types import SimpleNamespace

    from tests.page_outputs import rewrite_all, workspace

    page = tmp_path / "page.md"
    page.write_text(PAGE)
    ws = workspace(REPO, tmp_path / "scratch")
    assert (ws / "plan.py").resolve() == REPO / "plan.py" and not list((ws / "datasets").glob("synthetic*"))
    ran = []

    def run(command, where):
        ran.append((command, where))
        return SimpleNamespace(returncode=0, output="total   11.48\nwhy: fits\n", ran=command)

    assert rewrite_all([page], False, ws, run) == 1 and page.read_text() == PAGE  # without --write: only listed
    assert "page.md:5: python plan.py --config x" in capsys.readouterr().out
    assert rewrite_all([page], True, ws, run) == 0 and "total   11.48\nwhy: fits\n```" in page.read_text()
    assert ran == [("python plan.py --config x", ws)] * 2
