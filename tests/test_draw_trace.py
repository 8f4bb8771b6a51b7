"""benchmarks/draw_trace.py: rows found in a small synthetic trace, a PNG written, and a bad file refused in one line."""

import gzip
import json

import pytest

from benchmarks import draw_trace
from benchmarks.draw_trace import COMMUNICATION, KERNELS, STEP, load_events, timeline


def event(name, ts, dur, cat="user_annotation", tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}


def trace_events(start: float, with_gpu: bool) -> list[dict]:
    """Two steps of the training loop as torch.profiler records them, with DDP's all-reduce inside backward."""
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}}]  # metadata: skipped
    for step, t in enumerate((start, start + 10_000)):
        events += [event(f"ProfilerStep#{step + 2}", t, 10_000), event("## data ##", t, 1_000),
                   event("## forward ##", t + 1_000, 3_000), event("## backward ##", t + 4_000, 5_000),
                   event("## optimizer ##", t + 9_000, 900),
                   event("aten::mm", t + 1_500, 500, cat="cpu_op"),  # an op of no row
                   event("aten::broadcast_tensors", t + 1_600, 10, cat="cpu_op"),  # local, despite its name
                   event("gloo:all_reduce", t + 6_000, 2_000, tid=2),
                   event("c10d::allreduce_", t + 6_100, 1_500, cat="cpu_op", tid=2)]
        if with_gpu:
            events += [event("## forward ##", t + 1_200, 2_000, cat="gpu_user_annotation", tid=7),  # GPU shadow
                       event("volta_sgemm_128x64_nn", t + 1_300, 400, cat="kernel", tid=7),
                       event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", t + 6_200, 800, cat="kernel", tid=8)]
    return events


def test_rows_are_found_per_kind_in_ms_from_the_first_step():
    rows = timeline(trace_events(5_000_000.0, with_gpu=True), "rank 0").rows
    assert list(rows) == [STEP, "## data ##", "## forward ##", "## backward ##", "## optimizer ##", COMMUNICATION,
                          KERNELS]
    assert rows[STEP] == [(0.0, 10.0), (10.0, 10.0)]
    assert rows["## forward ##"] == [(1.0, 3.0), (11.0, 3.0)]  # the CPU thread's range, not its GPU shadow
    assert len(rows[COMMUNICATION]) == 6  # gloo's range, c10d's op and NCCL's kernel, per step
    assert all(4.0 <= start and start + dur <= 9.0 for start, dur in rows[COMMUNICATION][:3])  # inside backward
    assert rows[KERNELS] == [(1.3, 0.4), (11.3, 0.4)]
    cpu_only = timeline(trace_events(0.0, with_gpu=False), "rank 1").rows
    assert KERNELS not in cpu_only and len(cpu_only[COMMUNICATION]) == 4  # a missing kind: no row


def test_two_ranks_draw_one_png(tmp_path, capsys):
    paths = []
    for rank, opener in ((0, gzip.open), (1, open)):  # the gzip the profiler writes, and plain JSON
        path = tmp_path / f"rank{rank}_trace.json{'.gz' if rank == 0 else ''}"
        with opener(path, "wt") as f:
            json.dump({"schemaVersion": 1, "traceEvents": trace_events(1e6 * (rank + 1), with_gpu=rank == 0)}, f)
        paths.append(str(path))
    assert draw_trace.main([*paths, "--out", str(tmp_path / "timeline.png")]) == 0
    png = (tmp_path / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(png) < 200_000
    out = capsys.readouterr().out
    assert "rank 0: step 2, data 2, forward 2, backward 2, optimizer 2, communication 6, GPU kernels 2" in out
    assert "rank 1: step 2, data 2, forward 2, backward 2, optimizer 2, communication 4\n" in out


@pytest.mark.parametrize("content, message", [
    (b"not json at all", "is not a Chrome trace"),
    (gzip.compress(b'{"traceEvents": [{"ph": "X"'), "is not a Chrome trace"),  # cut short
    (b'{"schemaVersion": 1}', "no traceEvents list"),
    (json.dumps({"traceEvents": [event("aten::mm", 0, 5, cat="cpu_op")]}).encode(), "no profiled steps"),
])
def test_a_file_that_is_not_a_trace_is_one_error_line(tmp_path, capsys, content, message):
    bad = tmp_path / "rank0_trace.json.gz"
    bad.write_bytes(content)
    assert draw_trace.main([str(bad), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "t.png").exists()


def test_a_missing_file_is_one_error_line(tmp_path, capsys):
    with pytest.raises(draw_trace.TraceError, match="cannot read it"):
        load_events(tmp_path / "none.json")
    assert draw_trace.main([str(tmp_path / "none.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
