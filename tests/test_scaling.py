"""benchmarks/scaling.py: the performance model's formulas, and one end-to-end run of 1 and 2 CPU ranks."""

import json
import sys

import pytest

from tests.conftest import REPO, TINY_MODEL, run_script

sys.path.insert(0, str(REPO / "benchmarks"))
import scaling  # noqa: E402
from utils.plan import comm  # noqa: E402

MiB = 2**20


# --- the model: exact numbers ---------------------------------------------------------------------------

def test_ring_all_reduce_time_follows_nccl_tests_definitions():
    # 100 MB over 4 ranks at a bus bandwidth of 100 GB/s: each rank sends 2 x 3/4 x 100 MB = 150 MB -> 1.5 ms.
    assert comm.ring_allreduce_seconds(100e6, 4, 100e9) == pytest.approx(1.5e-3)
    assert comm.ring_allreduce_seconds(100e6, 2, 100e9) == pytest.approx(1.0e-3)
    assert comm.ring_allreduce_seconds(100e6, 1, 100e9) == 0.0
    # with 10 us per ring step: 2 x 3 steps = 60 us more
    assert comm.ring_allreduce_seconds(100e6, 4, 100e9, latency=10e-6) == pytest.approx(1.56e-3)
    # comm_check.py prints busbw = algbw x bus_factor(n), with algbw = bytes / time: the same time back.
    from comm_check import ALL_REDUCE

    algbw = 40e9
    assert comm.ring_allreduce_seconds(8e6, 8, algbw * ALL_REDUCE.bus_factor(8)) == pytest.approx(8e6 / algbw)


def test_buckets_close_at_the_cap_as_ddp_fills_them():
    assert scaling.ddp_buckets([4, 4, 4, 4, 4], 8) == [8, 8, 4]
    assert scaling.ddp_buckets([10, 1, 3], 8) == [10, 4]
    assert scaling.ddp_buckets([1, 2, 3], 100) == [6]


def test_prediction_hides_communication_under_backward_but_not_the_last_bucket():
    # 2 ranks: time = bytes / busbw. Buckets of 40, 40, 20 MB at 1 GB/s: 40 + 40 + 20 = 100 ms of all-reduce.
    buckets, busbw = [40e6, 40e6, 20e6], 1e9
    short_backward = scaling.predict_step(0.1, 0.06, buckets, 2, busbw)
    assert short_backward["comm_s"] == pytest.approx(0.1)
    assert short_backward["exposed_s"] == pytest.approx(0.04)  # 100 ms - 60 ms of backward
    assert short_backward["step_s"] == pytest.approx(0.14)
    assert short_backward["no_overlap_s"] == pytest.approx(0.2)
    long_backward = scaling.predict_step(0.1, 0.2, buckets, 2, busbw)
    assert long_backward["exposed_s"] == pytest.approx(0.02)  # only the last bucket
    one_bucket = scaling.predict_step(0.1, 0.2, [100e6], 2, busbw)
    assert one_bucket["exposed_s"] == pytest.approx(0.1)  # nothing to overlap with
    assert scaling.predict_step(0.1, 0.06, buckets, 1, busbw)["step_s"] == pytest.approx(0.1)


def test_efficiency_and_node_bandwidth():
    assert scaling.efficiency(300.0, 4, 100.0) == pytest.approx(0.75)
    assert scaling.node_busbw(1, 4, 300.0, 100.0) == 300.0
    assert scaling.node_busbw(2, 4, 300.0, 100.0) == 100.0


def test_extrapolation_to_nodes(capsys):
    # The quickstart's SwinIR (its 40,976 fp32 gradients: one bucket); docs/performance.md runs the tutorial's.
    assert scaling.main(["--extrapolate", "quickstart", "--compute-ms", "1", "--nodes", "1", "2",
                         "--inter-busbw", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "quickstart: 40,976 parameters, 0.2 MiB of gradients in 1 buckets" in out
    rows = [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]
    assert [r[:3] for r in rows] == [["1", "1", "300"], ["1", "4", "300"], ["2", "8", "0.01"]]
    assert rows[0][5:] == ["1.0", "1.00", "1.00"]  # one GPU: compute alone
    # 8 GPUs over a 10 MB/s network: 163,904 B x 2 x 7/8 / 1e7 B/s = 28.68 ms, all exposed (one bucket)
    assert rows[2][3:] == ["28.68", "28.68", "29.7", "0.03", "0.03"]


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "2", "4"], "--sizes must start at 1"),
    (["--extrapolate", "baseline"], "one --compute-ms per config"),
    (["--steps", "0"], "--steps, --rounds and --threads must be >= 1"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        scaling.main(argv)
    assert exit_.value.code != 0
    assert message in capsys.readouterr().err


def test_collect_without_results_says_what_to_do(tmp_path):
    with pytest.raises(SystemExit, match="run the --worker jobs first"):
        scaling.main(["--collect", str(tmp_path)])


# --- end to end: the workers of 1 and 2 ranks (as the cluster jobs run them), then the tables --------------

@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    train = ["--config", "quickstart", "--data_dir", str(tiny_data), "--crop_size", "32", "--n_patches", "2",
             "--num_workers", "0", "--batch_size", "2", *TINY_MODEL]
    common = ["benchmarks/scaling.py", "--worker", "--out", str(out), "--steps", "1", "--rounds", "2",
              "--global-batch", "4"]
    run_script(*common, "--", *train, in_process=True)  # one rank: a process group of its own, in memory
    run_script(*common, "--knobs", "--bucket-caps", "0.01", "--", *train, ranks=2, timeout=180)
    return out


def test_end_to_end_json_png_and_consistent_figures(results, capsys):
    assert scaling.main(["--collect", str(results)]) == 0
    printed = capsys.readouterr().out
    assert "weak scaling (per-rank batch 2)" in printed and "strong scaling (global batch 4)" in printed
    assert (results / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((results / "scaling.json").read_text())
    weak, strong = summary["weak"], summary["strong"]
    assert [p["ranks"] for p in weak] == [1, 2] and [p["per_rank_batch"] for p in weak] == [2, 2]
    assert [p["global_batch"] for p in strong] == [4, 4] and [p["per_rank_batch"] for p in strong] == [4, 2]
    for p in weak + strong:
        assert p["step_s"] > 0 and p["no_ddp_step_s"] > 0 and p["predicted_step_s"] >= p["no_ddp_step_s"]
        assert p["samples_per_sec"] == pytest.approx(p["global_batch"] / p["step_s"])
    for points in (weak, strong):
        one = points[0]["samples_per_sec"]
        assert [p["efficiency"] for p in points] == pytest.approx([p["samples_per_sec"] / (p["ranks"] * one)
                                                                  for p in points])
        assert points[0]["efficiency"] == pytest.approx(1.0)
    assert weak[1]["busbw"] > 0 and weak[0]["busbw"] is None


def test_knobs_count_all_reduces_as_ddp_buckets_them(results):
    record = json.loads((results / "world_2.json").read_text())
    variants = record["variants"]
    assert variants["weak no_ddp"]["allreduce_per_step"] == 0 and variants["strong no_ddp"]["allreduce_per_step"] == 0
    default, small = variants["weak"], variants["knob: bucket_cap_mb 0.01"]
    assert default["allreduce_per_step"] == len(default["bucket_bytes"]) == 1  # 48 KB of gradients < 25 MiB
    assert small["allreduce_per_step"] == len(small["bucket_bytes"]) > default["allreduce_per_step"]
    assert sum(small["bucket_bytes"]) == sum(default["bucket_bytes"]) == record["grad_bytes"]
    # The model's buckets: as many as DDP made (DDP orders by when gradients became ready in the first step)
    assert len(scaling.ddp_buckets(record["grad_bytes_ready_order"], 0.01 * MiB)) == len(small["bucket_bytes"])
    # broadcast_buffers re-sends the model's buffers (relative position indices, masks, statistics) every forward
    assert default["broadcast_per_step"] == 0 and variants["knob: broadcast_buffers true"]["broadcast_per_step"] >= 1
    assert variants["knob: static_graph true"]["allreduce_per_step"] == 1
    assert record["allreduce"]["busbw"] == pytest.approx(
        record["allreduce"]["bytes"] / record["allreduce"]["seconds"] * 2 * (2 - 1) / 2)
