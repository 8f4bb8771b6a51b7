"""The teaching pictures: drawn from the code's own layouts (docs/make_figures.py) and from measured records
(benchmarks/bench_pp.py --timeline), so that a picture cannot drift from what the scripts do."""

import importlib.util
import json

import pytest

from benchmarks.bench_pp import draw_timelines
from tests.conftest import REPO


@pytest.fixture(scope="module")
def make_figures():
    spec = importlib.util.spec_from_file_location("make_figures", REPO / "docs" / "make_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_mesh_picture_has_the_groups_of_the_page_and_of_train_mp(make_figures):
    # docs/beyond-data-parallel.md, "The mesh: who shares what": 8 ranks, --tp 2 --cp 2, tp-cp-dp
    assert make_figures.mesh_groups(8, 2, 2) == {"dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
                                                 "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
                                                 "tp": [[0, 1], [2, 3], [4, 5], [6, 7]]}
    assert make_figures.mesh_groups(8, 2, 2, "dp-cp-tp")["dp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_every_picture_is_drawn(make_figures, tmp_path):
    runs = []
    for name, offset in (("single", 0.0), ("cp2", 0.01)):
        records = [{"kind": "train", "step": s, "loss": 1 / s + offset} for s in range(1, 5)]
        records.append({"kind": "val", "step": 4, "rmse": [1.0 + offset, 2.0]})  # per channel, as train.py logs it
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
        runs.append(str(tmp_path / name / "metrics.jsonl"))
    assert make_figures.main(["--out", str(tmp_path / "png"), "--drift", *runs]) == 0
    for name in ("parallelism", "launch_tree", "layers", "mesh", "bands", "job_chain", "layout_drift"):
        assert (tmp_path / "png" / f"{name}.png").stat().st_size > 10_000, name
    assert make_figures.main(["--out", str(tmp_path / "png"), "--drift", runs[0], str(tmp_path / "none")]) == 2


def test_the_pipeline_timeline_draws_each_rank_chunks(tmp_path):
    record = {"schedule": "1f1b", "stages": 2, "microbatches": 2, "bubble_per_rank": [0.3, 0.2], "bubble_theory": 0.33,
              "timeline_ms": [[["F", 0, 0.0, 1.0], ["F", 0, 1.0, 2.0], ["B", 0, 4.0, 6.0], ["B", 0, 8.0, 10.0]],
                              [["F", 1, 1.5, 2.5], ["B", 1, 2.5, 4.5], ["F", 1, 4.5, 5.5], ["B", 1, 5.5, 7.5]]]}
    draw_timelines([record, {**record, "schedule": "gpipe"}], tmp_path / "timeline.png")
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
