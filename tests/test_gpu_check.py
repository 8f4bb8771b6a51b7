"""tests/gpu_check.py: its CPU dry run (every item at tiny sizes; CUDA-only ones skipped with the reason), its report,
and what it does with an item that hangs or no longer fits the budget."""

import json
import re
import subprocess
import sys
from argparse import Namespace

import pytest

from tests import gpu_check
from tests.conftest import REPO

# Run on a CPU, these items must pass; the rest are skipped, each with its reason.
CPU_ITEMS = ["environment", "data", "cuda tests", "full field", "vit_mp", "bench_model", "profiling",
             "ladder: device pipeline"]


def test_dry_run_passes_what_a_cpu_can_run_and_reports_the_rest_as_skipped(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "tests/gpu_check.py", "--tiny", "--jobs", "3", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    markdown = (out / "gpu_check.md").read_text()
    assert proc.returncode == 0, markdown + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert (report["state"], report["mode"], report["format"]) == ("done", "tiny", 1)
    assert {"torch", "device", "python", "cuda_available"} <= report["environment"].keys()
    rows = {row["name"]: row for row in report["rows"]}
    assert len(rows) == len(report["rows"]), "row names are unique"
    assert all(row.keys() == report["rows"][0].keys() and row["status"] in ("pass", "skip") for row in rows.values())
    assert report["counts"] == {s: sum(r["status"] == s for r in rows.values()) for s in ("pass", "fail", "skip")}
    assert [name for name, row in rows.items() if row["status"] == "pass" and (
        ":" not in name or name.startswith("ladder: "))] == CPU_ITEMS  # items, not their per-setting rows
    skipped = {name: row["reason"] for name, row in rows.items() if row["status"] == "skip"}
    assert all(skipped.values()), "every skip says why"
    cuda_tests = [name for name in rows if name.startswith("cuda test: ")]
    assert len(cuda_tests) >= 10 and all(skipped[name].startswith("needs a CUDA device") for name in cuda_tests)
    assert skipped["ladder: tf32"] == skipped["ladder: cuda graphs"] == "needs CUDA"
    # The figures the pages will quote are there, per setting.
    settings = [name for name in rows if name.startswith("full field: ")]
    assert [name.split(": ")[1].split(" 16x32")[0] for name in settings] == ["inference bf16", "inference fp32",
                                                                              "bf16 + AC block", "bf16", "fp32"]
    assert all(rows[name]["figures"]["measured_peak_gb"] > 0 and rows[name]["figures"]["estimate_gb"] > 0
               for name in settings)
    assert len([name for name in rows if name.startswith("vit_mp: ")]) == 2
    assert 0 < rows["bench_model"]["figures"]["mfu_vs_measured_peak"] < 1
    # The roofline's classes: the matmuls carry FLOPs, every class moved bytes, and the kernels' time adds up.
    roof = {name.split(": ")[1]: row["figures"] for name, row in rows.items() if name.startswith("roofline: ")}
    assert {"matmul", "convolution", "elementwise", "optimizer"} <= roof.keys()
    assert roof["matmul"]["gflop"] > 0 and roof["elementwise"]["gflop"] == 0 and all(r["gb"] > 0 for r in roof.values())
    assert sum(r["ms"] for r in roof.values()) == pytest.approx(rows["bench_model"]["figures"]["kernel_ms"], rel=0.01)
    assert rows["profiling"]["figures"]["trace_mb"] > 0
    assert rows["ladder: device pipeline"]["figures"]["samples_per_sec"] > 0
    # The markdown: a title naming device and versions, then one table row per report row.
    env = report["environment"]
    assert markdown.startswith(f"# GPU check: {env['device']}, torch {env['torch']}")
    table = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert table[0] == "| item | status | s | figures | reason |" and len(table) == len(rows) + 2


def test_the_dry_run_gives_every_script_the_gpu_arguments_first():
    """The dry run's arguments are the GPU's, then what shrinks them: a GPU argument that its script no longer takes
    fails the dry run (as --model_args.drop_path_rate did bench_model.py, when its flag was --drop_path_rate)."""
    for name, gpu in gpu_check.GPU_SIZES.items():
        assert gpu_check.SIZES["tiny"][name][:len(gpu)] == gpu, name
    from benchmarks import bench_model

    bench_model.parse_args(gpu_check.SIZES["tiny"]["bench"])
    with pytest.raises(SystemExit):  # what the check passed before: exit 2, while the old dry run was green
        bench_model.parse_args([*gpu_check.SIZES["tiny"]["bench"], "--drop_path_rate", "0"])  # the flag it had


def test_every_test_marked_cuda_is_run_by_the_check():
    marked = sorted(f"tests/{path.name}" for path in (REPO / "tests").glob("test_*.py")
                    if re.search(r"pytest\.mark\.cuda\b", path.read_text()))
    assert marked == sorted(gpu_check.CUDA_TEST_FILES)


def a_check(tmp_path, **options) -> gpu_check.Check:
    args = Namespace(**{"out": str(tmp_path / "out"), "budget_s": 60.0, "tiny": True, "only": None,
                        "work": str(tmp_path / "work"), "jobs": 1, **options})
    check = gpu_check.Check(args)
    check.env = {"torch": "x", "cuda_available": False}
    return check


def test_an_item_that_hangs_is_killed_at_its_timeout_and_the_report_says_so(tmp_path):
    check = a_check(tmp_path)
    hangs = gpu_check.Item("hangs", ["-c", "import time; print('started', flush=True); time.sleep(60)"], 1.0,
                           gpu_check.judge_exit, min_s=0)
    assert check.execute([hangs]) == 1
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    row = report["rows"][0]
    assert (row["status"], row["reason"]) == ("fail", "timed out after 1 s") and row["output_tail"] == "started"
    assert row["seconds"] < 10 and not check.children


def test_an_item_that_no_longer_fits_the_budget_is_not_run(tmp_path):
    check = a_check(tmp_path, budget_s=5.0)
    late = gpu_check.Item("late", ["-c", "raise SystemExit(3)"], 60, gpu_check.judge_exit, min_s=30)
    assert check.execute([late]) == 0
    assert re.fullmatch(r"not run: time budget \(\d s left of 5, needs 30\)", check.rows[0].reason)


def test_only_selects_by_prefix_and_keeps_what_the_others_need(tmp_path):
    check = a_check(tmp_path, only=["ladder: c"], budget_s=600.0)
    reasons = {item.name: check.skip_reason(item) for item in gpu_check.items(check)}
    assert reasons["environment"] == reasons["data"] == reasons["ladder: cuda graphs"] == ""
    assert reasons["profiling"] == reasons["ladder: tf32"] == "not selected (--only)"
    assert reasons["ladder: compile"].startswith("not in the tiny dry run")


def test_on_a_gpu_a_skipped_cuda_test_fails_the_item_with_its_reason(tmp_path):
    check = a_check(tmp_path, tiny=False)
    check.work.joinpath("junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.test_model" name="ok" time="1"/>'
        '<testcase classname="tests.test_ddp" name="nccl" time="0"><skipped message="needs a CUDA device"/>'
        '</testcase></testsuite></testsuites>')
    rows = gpu_check.judge_tests(gpu_check.Ran(0, "", 1.0), check)
    assert (rows[0].status, rows[0].reason) == ("fail", "1 of the cuda tests skipped on a GPU")
    assert [(r.status, r.reason) for r in rows[1:]] == [("pass", ""), ("fail", "skipped on a GPU: needs a CUDA device")]
    check.mode = "tiny"  # the dry run: skips are what a CPU does
    assert gpu_check.judge_tests(gpu_check.Ran(0, "", 1.0), check)[0].status == "pass"


def test_on_a_gpu_torch_cannot_see_the_probe_fails_with_the_driver_and_the_fix(tmp_path):
    from tools import torch_build  # as the probe's child does: it holds the message, the parent reads its JSON

    unseen = torch_build.unseen_gpu(torch_build.Driver("550.54.15"), False, "2.15.0", "13.2", None)
    probe = json.dumps({"torch": "2.15.0", "cuda": "13.2", "cuda_available": False, "driver": "550.54.15",
                        "gpu_unseen": unseen})
    check = a_check(tmp_path, tiny=False)
    row = gpu_check.judge_probe(gpu_check.Ran(0, probe, 1.0), check)[0]
    assert (row.status, row.reason) == ("fail", unseen) and "tools/torch_build.py --install" in unseen
    assert row.figures["driver"] == "550.54.15"
    check.mode = "tiny"  # the dry run hides the GPU on purpose
    assert gpu_check.judge_probe(gpu_check.Ran(0, probe, 1.0), check)[0].status == "pass"


@pytest.mark.parametrize("argv, message", [([], "--out DIR is required"), (["--out", "x", "--budget-s", "0"],
                                                                           "--budget-s must be > 0")])
def test_bad_arguments_stop_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu_check.main(argv)
    assert stop.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]
