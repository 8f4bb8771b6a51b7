"""train_with_profiling.py and utils/observe/profiling.py: trace, memory timeline, summary, breakdown,
off == train.py."""

import gzip
import json
import re
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REFERENCE_STEPS, final_weights, read_metrics, run_script, tiny_args
from tests.test_train import expect_error_in_process
from utils.config import ConfigError, build_config
from utils.observe import profiling
from utils.observe.profiling import RANGES

PROFILE_STEPS = ("--profile_wait", "1", "--profile_warmup", "1", "--profile_active", "2")


def test_profiled_run_writes_trace_timeline_summary_and_breakdown(tiny_data, tmp_path):
    run = tmp_path / "run"
    proc = run_script("train_with_profiling.py", *tiny_args(
        tiny_data, run, "--max_steps", "6", *PROFILE_STEPS, "--breakdown_steps", "2",  # profiling on by default
        "--memory_snapshot", "true"), in_process=True)
    out = proc.stdout

    trace_path = run / "profile" / "rank0_trace.json.gz"
    assert trace_path.read_bytes()[:2] == b"\x1f\x8b"  # gzip, as Perfetto expects from .json.gz
    events = json.loads(gzip.decompress(trace_path.read_bytes()))["traceEvents"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    assert len(steps) == 2, [e["name"] for e in steps]  # profile_active steps, and only those
    for step in steps:
        inside = {e["name"] for e in events if e.get("ph") == "X" and e.get("name") in RANGES
                  and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"]}
        assert inside == set(RANGES), (step["name"], inside)

    html = run / "profile" / "rank0_memory_timeline.html"
    if html.exists():
        text = html.read_text()
        assert "data:image/png;base64," in text and "parameters" in text and "gradients" in text
        assert (run / "profile" / "rank0_memory_timeline.png").read_bytes()[:4] == b"\x89PNG"
    else:  # a PyTorch whose memory timeline broke: one warning, and the run went on
        assert proc.stderr.count("warning: memory timeline not written") == 1, proc.stderr[-2000:]

    assert out.count("memory_snapshot: skipped, CUDA memory history needs a CUDA device") == 1
    assert "profile summary: steps 3-4" in out and "2 step(s) recorded" in out
    for label in ("data", "forward", "backward", "optimizer", "whole step"):
        assert re.search(rf"^  {label} +\d+\.\d+ +\d+\.\d%", out, re.MULTILINE), label
    top = out.split("top 10 ops by self CPU time per step")[1].splitlines()[2:12]
    assert len(top) == 10 and all(re.match(r"^ +\d+\.\d+ +\d+\.\d% +\d+  \S", row) for row in top), top
    assert sum("aten::" in row for row in top) >= 5, top  # mostly ATen ops (the rest: loader, optimizer)
    assert (run / "profile" / "rank0_summary.txt").read_text().startswith("profile summary")

    rows = {name: float(rate) for name, rate in re.findall(r"^  (IO|SYNTHETIC|FULL) .*?([\d.]+)$", out, re.MULTILINE)}
    assert set(rows) == {"IO", "SYNTHETIC", "FULL"} and all(rate > 0 for rate in rows.values()), out[-1500:]
    assert re.search(r"^  -> (bound by|loader and step|inconclusive)", out, re.MULTILINE)
    throughput = [r for r in read_metrics(run) if r["kind"] == "throughput"]
    assert len(throughput) == 1 and throughput[0]["full_samples_per_sec"] == pytest.approx(rows["FULL"], rel=1e-3)


def test_profiling_off_is_train_py(tiny_data, reference_run, tmp_path):
    plain, off = reference_run, tmp_path / "off"
    proc = run_script("train_with_profiling.py", *tiny_args(tiny_data, off, *REFERENCE_STEPS, "--profile", "false"), in_process=True)

    def comparable(records):  # everything but the clock
        return [{k: v for k, v in r.items() if k not in ("time", "samples_per_sec", "mfu", "peak_mem_gb")}
                for r in records]

    assert comparable(read_metrics(off)) == comparable(read_metrics(plain))
    plain_weights, off_weights = final_weights(plain), final_weights(off)
    assert plain_weights.keys() == off_weights.keys()
    for key in plain_weights:
        torch.testing.assert_close(off_weights[key], plain_weights[key], rtol=0, atol=0, msg=key)

    def files(run):
        return sorted(str(p.relative_to(run)) for p in run.rglob("*") if "tfevents" not in p.name)

    assert files(off) == files(plain)
    assert not (off / "profile").exists()
    assert "profile" not in proc.stdout and "throughput" not in proc.stdout


def test_bad_profile_value_stops_with_one_line(tiny_data, tmp_path, capsys):
    last = expect_error_in_process(capsys, *tiny_args(tiny_data, tmp_path / "run", "--profile_active", "0"),
                                   script="train_with_profiling.py")
    assert last == "error: profile_active must be >= 1 (steps recorded), got 0"
    assert not (tmp_path / "run").exists()


def profile_config(tmp_path, **overrides):
    return build_config("quickstart", {"run_dir": str(tmp_path), **overrides})


def test_profile_and_nsys_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot both be on"):
        with profiling.maybe_enable_profiling(profile_config(tmp_path, profile=True, nsys=True), torch.device("cpu")):
            pass


def test_nsys_on_cpu_is_skipped_with_one_message(tmp_path, capsys):
    with profiling.maybe_enable_profiling(profile_config(tmp_path, nsys=True), torch.device("cpu")) as profiler:
        for _ in range(5):
            profiler.step()
    out = capsys.readouterr().out
    assert out.count("nsys: skipped, NVTX ranges and cudaProfilerStart/Stop need a CUDA device") == 1
    assert not (tmp_path / "profile").exists()


def test_nsys_capture_covers_exactly_the_profiled_steps(monkeypatch):
    calls = []

    class FakeNvtx:
        def __enter__(self):
            calls.append("nvtx on")

        def __exit__(self, *exc):
            calls.append("nvtx off")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(torch.autograd.profiler, "emit_nvtx", FakeNvtx)
    capture = profiling._NsysCapture(torch.device("cuda"), first=3, last=4)
    for step in range(1, 7):
        calls.append(f"step {step}")
        capture.step()
    assert calls == ["step 1", "step 2", "start", "nvtx on", "step 3", "step 4", "nvtx off", "stop", "step 5", "step 6"]


def test_profiler_that_never_reaches_its_steps_warns(tmp_path, capsys):
    cfg = profile_config(tmp_path, profile=True, profile_wait=5)
    with profiling.maybe_enable_profiling(cfg, torch.device("cpu")) as profiler:
        for _ in range(2):
            torch.ones(4).sum()
            profiler.step()
    err = capsys.readouterr().err
    assert "the run ended after 2 steps, before the profiled steps 7-9; no trace written" in err
    assert not list(tmp_path.rglob("*trace*"))


def test_broken_memory_timeline_costs_one_warning_not_the_run(tmp_path, capsys):
    class BrokenTimeline:
        def export_memory_timeline(self, path, device=None):
            raise KeyError("a profiler internals change")

    written = profiling._export_memory_timeline(BrokenTimeline(), profile_config(tmp_path), torch.device("cpu"))
    err = capsys.readouterr().err
    assert written == [] and err.count("warning: memory timeline not written (KeyError") == 1
    assert not list(tmp_path.rglob("*memory_timeline*"))


@pytest.mark.parametrize("io, synthetic, full, verdict", [
    (50.0, 100.0, 48.0, "bound by data loading: the loader delivers 50%"),
    (1000.0, 100.0, 70.0, "loader and step slow each other down"),
    (1000.0, 100.0, 97.0, "bound by compute: FULL is 97% of SYNTHETIC and the loader is 10.0x faster"),
    (1000.0, 100.0, 150.0, "inconclusive: FULL is faster than SYNTHETIC alone"),
])
def test_breakdown_names_what_bounds_the_run(io, synthetic, full, verdict):
    table = profiling.format_breakdown({"io_samples_per_sec": io, "synthetic_samples_per_sec": synthetic,
                                        "full_samples_per_sec": full}, batch_size=16, steps=10)
    assert verdict in table.splitlines()[-1]
    assert [line.split()[0] for line in table.splitlines()[1:4]] == ["IO", "SYNTHETIC", "FULL"]


class _SlowSamples(torch.utils.data.Dataset):
    """A sample takes 0.2 s to read: four workers deliver 20 samples/s, in rounds of four."""

    def __len__(self):
        return 1000

    def __getitem__(self, index):
        time.sleep(0.2)
        return torch.zeros(2), torch.zeros(2)


def test_breakdown_times_whole_rounds_of_the_loaders_workers(tmp_path, capsys):
    # 5 timed batches of 4 workers span two rounds (0.4 s) for 5 batches: 12.5 samples/s, 5/8 of the rate, and FULL
    # (which the training step desynchronises) then beat IO: "inconclusive" on an H200 with 8 workers and 10 steps.
    # Whole rounds read 20 samples/s less the workers' wake-ups: on a busy 2-core CI machine 0.1 s samples read 81 %
    # of the rate (46 ms lost per 0.2 s), hence 0.2 s samples and a bound (75 %) well clear of the old 5/8.
    loader = torch.utils.data.DataLoader(_SlowSamples(), batch_size=1, num_workers=4, prefetch_factor=1)
    model = torch.nn.Linear(2, 2)
    rates = profiling.throughput_breakdown(
        profile_config(tmp_path, profile=True, breakdown_steps=5), loader, model, torch.optim.SGD(model.parameters(), lr=0.1),
        torch.nn.functional.mse_loss, torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"))
    assert 0.75 * 20 < rates["io_samples_per_sec"] < 1.05 * 20, rates
    assert "5 timed steps per phase; IO and FULL 8, whole rounds of the loader's workers" in capsys.readouterr().out


@pytest.fixture
def fake_cuda_memory_history(monkeypatch):
    """The CUDA allocator's history API, faked: what was enabled, and the OOM observers attached."""
    record = {"history": [], "observers": []}
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **options: record["history"].append(enabled))
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", lambda name: Path(name).write_bytes(b"snapshot"))
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", record["observers"].append)
    return record


def test_memory_snapshot_is_dumped_at_an_out_of_memory_error(tmp_path, capsys, fake_cuda_memory_history):
    cfg = profile_config(tmp_path, memory_snapshot=True)
    with pytest.raises(torch.OutOfMemoryError):
        with profiling.maybe_enable_memory_snapshot(cfg, torch.device("cuda", 0)) as path:
            on_oom = fake_cuda_memory_history["observers"][0]
            on_oom(0, 2e9, 70e9, 1e9)  # what the allocator calls before it raises
            raise torch.OutOfMemoryError("CUDA out of memory")
    assert path == tmp_path / "profile" / "rank0_memory_snapshot.pickle" and path.read_bytes() == b"snapshot"
    err = capsys.readouterr().err
    assert err.count("memory_snapshot: out of memory on cuda:0 (asked 2.00 GB, 1.00 GB free): wrote") == 1
    assert fake_cuda_memory_history["history"] == ["all", None]  # recording stopped on the way out
    on_oom(0, 1e9, 70e9, 1e9)  # a later OOM (history off) writes nothing more
    assert capsys.readouterr().err == ""


def test_memory_snapshot_is_dumped_at_the_end(tmp_path, capsys, fake_cuda_memory_history):
    with profiling.maybe_enable_memory_snapshot(profile_config(tmp_path, memory_snapshot=True),
                                                torch.device("cuda", 0)) as path:
        assert not path.exists()
    assert path.read_bytes() == b"snapshot" and "memory_snapshot: end of run: wrote" in capsys.readouterr().out
    assert not list(path.parent.glob(".tmp-*"))


@pytest.mark.cuda
def test_cuda_memory_snapshot_at_the_end_and_at_a_forced_out_of_memory_error(tmp_path, capsys):
    import pickle

    device = torch.device("cuda", torch.cuda.current_device())
    with profiling.maybe_enable_memory_snapshot(profile_config(tmp_path / "end", memory_snapshot=True), device) as end:
        torch.randn(1024, 1024, device=device).sum().item()
    snapshot = pickle.loads(end.read_bytes())
    assert snapshot["segments"] and "memory_snapshot: end of run: wrote" in capsys.readouterr().out

    too_much = 2 * torch.cuda.get_device_properties(device).total_memory  # an ordinary cudaMalloc that must fail
    with pytest.raises(torch.OutOfMemoryError):
        with profiling.maybe_enable_memory_snapshot(profile_config(tmp_path / "oom", memory_snapshot=True),
                                                    device) as oom:
            torch.empty(too_much, dtype=torch.uint8, device=device)
    assert "segments" in pickle.loads(oom.read_bytes())  # dumped at the failing allocation
    err = capsys.readouterr().err
    assert err.count(f"memory_snapshot: out of memory on cuda:{device.index}") == 1, err


def test_gpu_column_counts_kernels_launched_from_any_thread():
    """Backward's kernels are launched from autograd's thread: the GPU column counts every op that started while
    the range was open, whatever its thread (the range's device-side copy read 0 for backward on an H200)."""
    from types import SimpleNamespace

    from utils.observe.profiling import kernel_ms_per_range

    def event(name, start, end, device_us=0.0, thread=1):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                               device_type=SimpleNamespace(name="CPU"), self_device_time_total=device_us)

    ranges = [event("## forward ##", 0, 100), event("## backward ##", 100, 300), event("## optimizer ##", 300, 350)]
    ops = [event("aten::mm", 10, 20, 500.0), event("aten::add", 30, 40, 250.0),      # forward, main thread
           event("MmBackward0", 120, 150, 1000.0, thread=2),                           # backward, autograd's thread
           event("aten::mm", 125, 140, 2000.0, thread=2),
           event("aten::_foreach_add_", 310, 320, 100.0),
           event("ProfilerStep#1", 0, 350, 9999.0)]                                    # counted by no range
    assert kernel_ms_per_range([*ranges, *ops], ranges) == {
        "## data ##": 0.0, "## forward ##": 0.75, "## backward ##": 3.0, "## optimizer ##": 0.1}
