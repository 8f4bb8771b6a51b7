"""Step 0b — profiling: where the time and the memory of a training step go.

``train_with_profiling.py`` is ``train.py`` plus a few lines that use this module. Everything here
is off unless its key in ``cfg.profile`` (utils/config.py, ProfileConfig) turns it on, and every
file goes to ``<run_dir>/profile/rank<r>_*`` (``r`` = global rank, 0 for one process):

- :func:`maybe_enable_profiling` (``--profile true``): ``torch.profiler`` over a few steps
  (``profile_wait`` skipped, ``profile_warmup`` recorded and dropped, ``profile_active`` kept), CPU
  and CUDA activities. Writes ``rank<r>_trace.json.gz`` (gzip Chrome-trace JSON: ui.perfetto.dev),
  ``rank<r>_memory_timeline.html`` / ``.png`` (memory by the profiler's categories: parameters,
  gradients, optimizer state, activations, ...; with ``memory_timeline``) and ``rank<r>_summary.txt``
  (top-10 ops by self time, time split over the ranges :data:`RANGES`), printed at the end.
  ``--nsys true`` instead: NVTX ranges and cudaProfilerStart/Stop around the same steps, for
  ``nsys profile --capture-range=cudaProfilerApi`` (command in train_with_profiling.py).
- :func:`maybe_enable_memory_snapshot` (``--memory_snapshot true``, CUDA): the allocator's history
  with Python stacks, dumped to ``rank<r>_memory_snapshot.pickle`` at the end *and* at an
  out-of-memory error (drag it onto pytorch.org/memory_viz).
- :func:`throughput_breakdown` (with ``--profile true``, after training): samples/s of the data
  loader alone (IO), of the training step on one cached batch (SYNTHETIC) and of both together
  (FULL), after NERSC's benchy: the smallest of IO and SYNTHETIC bounds FULL.
"""

from __future__ import annotations

import base64
import bisect
import contextlib
import io
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional

import numpy as np
import torch
from torch.profiler import ProfilerActivity

from utils.checkpoint.files import (StorageError, find_run_dir, replaced_atomically, reporting_write_failures,
                                    write_failure)
from utils.config import Config, ConfigError, ProfileConfig
from utils.parallel.distributed import read_dist_env
from utils.precision import autocast

RANGES = ("## data ##", "## forward ##", "## backward ##", "## optimizer ##")
"""The record_function ranges of the training loop, in step order (also NVTX ranges under nsys)."""

PROFILE_DIR = "profile"

# The profiler's memory categories (torch.profiler._memory_profiler.Category), in its plotting order.
_CATEGORY_LABELS = {"PARAMETER": "parameters", "OPTIMIZER_STATE": "optimizer state", "INPUT": "inputs",
                    "TEMPORARY": "temporaries", "ACTIVATION": "activations", "GRADIENT": "gradients",
                    "AUTOGRAD_DETAIL": "autograd detail", None: "unknown"}
_CATEGORY_COLORS = {"PARAMETER": "#2e7d32", "OPTIMIZER_STATE": "#f9a825", "INPUT": "#424242",
                    "TEMPORARY": "#9575cd", "ACTIVATION": "#e53935", "GRADIENT": "#1e88e5",
                    "AUTOGRAD_DETAIL": "#80deea", None: "#bdbdbd"}


def profile_path(cfg: Config, name: str, rank: Optional[int] = None) -> Path:
    """``<run_dir>/profile/rank<r>_<name>`` for this process's global rank (or ``rank``)."""
    rank = read_dist_env().rank if rank is None else rank
    return Path(cfg.train.run_dir) / PROFILE_DIR / f"rank{rank}_{name}"


def check_profile_config(p: ProfileConfig) -> None:
    """Value checks for the profile keys (one-line ConfigError, as utils.config.validate)."""
    for key in ("profile_wait", "profile_warmup", "breakdown_steps"):
        if getattr(p, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(p, key)}")
    if p.profile_active < 1:
        raise ConfigError(f"profile_active must be >= 1 (steps recorded), got {p.profile_active}")
    if p.memory_snapshot_entries < 1:
        raise ConfigError(f"memory_snapshot_entries must be >= 1, got {p.memory_snapshot_entries}")
    if p.profile and p.nsys:
        raise ConfigError("profile and nsys cannot both be on (torch.profiler and NVTX mode share the profiler "
                          "hooks): run --profile true first, then --nsys true under nsys")


def _say(message: str) -> None:
    """One message from rank 0 only: ranks share the console, the files are per rank."""
    if read_dist_env().rank == 0:
        print(message, flush=True)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write_atomically(path: Path, write: Callable[[str], None]) -> Path:
    """``write(temporary path)`` then rename, so a crash never leaves a half-written file behind.

    A full disk (or quota, or an I/O error) raises StorageError: one line, and the run stops like any
    other failed write of the run.
    """
    with reporting_write_failures("profile file", path, run_dir=find_run_dir(path)):
        path.parent.mkdir(parents=True, exist_ok=True)
        with replaced_atomically(path) as temporary:
            write(str(temporary))
    return path


def _file_size(path: Path) -> str:
    size = path.stat().st_size
    return f"{size / 1e6:.1f} MB" if size >= 1e6 else f"{size / 1e3:.0f} kB"


# ----------------------------------------------------------------------------- torch.profiler


class _NoProfiler:
    """What maybe_enable_profiling yields when profiling is off: ``step()`` does nothing."""

    def step(self) -> None:
        pass


class _TorchProfiler:
    """A trace of steps ``first..last``, then (with memory_timeline) the memory of step ``last + 1``.

    Two passes because the memory timeline needs ``with_stack`` (Python function events), which
    make a trace ~20x larger: 3 steps of the baseline model wrote 60 MB gzipped with stacks (1 GB
    of JSON, too big for Perfetto), 3.2 MB without. So the trace has no stacks, and the memory
    pass records one step and exports no trace.
    """

    def __init__(self, cfg: Config, device: torch.device):
        p = cfg.profile
        self.cfg, self.device = cfg, device
        self.first = p.profile_wait + p.profile_warmup + 1
        self.last = self.first + p.profile_active - 1
        self.done = 0
        self.written: list[Path] = []
        self.summary = ""
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.trace = torch.profiler.profile(
            activities=self.activities,
            schedule=torch.profiler.schedule(wait=p.profile_wait, warmup=p.profile_warmup, active=p.profile_active,
                                             repeat=1),
            on_trace_ready=self._on_trace_ready,
            record_shapes=True,  # input shapes in Perfetto's op details: cheap
        )
        self.steps_label = f"step {self.first}" if self.first == self.last else f"steps {self.first}-{self.last}"
        self.memory: Optional[torch.profiler.profile] = None
        self.memory_done = False

    def _on_trace_ready(self, prof) -> None:
        self.written.append(_write_atomically(profile_path(self.cfg, "trace.json.gz"), prof.export_chrome_trace))
        self.summary = summarize(prof, self.device, f"{self.steps_label} of this run on {self.device}")
        self.written.append(_write_atomically(
            profile_path(self.cfg, "summary.txt"), lambda name: Path(name).write_text(self.summary + "\n")))

    def step(self) -> None:
        """End of a training step: advances the trace's schedule, runs the memory pass."""
        self.done += 1
        self.trace.step()  # at step `last` this stops the trace and writes it
        if self.done == self.last and self.cfg.profile.memory_timeline:
            self.memory = torch.profiler.profile(activities=self.activities, record_shapes=True,
                                                 profile_memory=True, with_stack=True)
            self.memory.start()
        elif self.done == self.last + 1 and self.memory is not None:
            self.memory.stop()
            self.written += _export_memory_timeline(self.memory, self.cfg, self.device, step=self.done)
            self.memory, self.memory_done = None, True

    def close(self) -> None:
        if self.memory is not None:  # the run ended inside the memory pass: nothing complete to show
            self.memory.stop()
            self.memory = None


@contextlib.contextmanager
def maybe_enable_profiling(cfg: Config, device: torch.device) -> Iterator:
    """Profile a few training steps, or do nothing; yields an object whose ``step()`` ends a step.

    Call ``step()`` once at the end of every loop iteration. With ``--profile true``: steps
    ``profile_wait + 1`` .. ``+ profile_warmup`` warm the profiler up (discarded), the next
    ``profile_active`` steps are traced (CPU and CUDA activities, input shapes) and exported when
    they end; with ``memory_timeline`` the step after them is recorded again with ``profile_memory``
    and ``with_stack`` for the memory timeline (see :class:`_TorchProfiler`). The summary prints
    when the context closes. With ``--nsys true``: NVTX ranges and cudaProfilerStart/Stop around
    the same steps (CUDA only).
    """
    p = cfg.profile
    check_profile_config(p)
    if p.nsys:
        with _nsys_capture(cfg, device) as capture:
            yield capture
        return
    if not p.profile:
        yield _NoProfiler()
        return

    if device.type == "cpu":
        # CUDA builds of torch log "gpuGetDeviceCount failed" from Kineto on machines without a GPU.
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    profiler = _TorchProfiler(cfg, device)
    memory = f", memory timeline of step {profiler.last + 1}" if p.memory_timeline else ""
    _say(f"profile: trace of {profiler.steps_label} (profile_wait {p.profile_wait}, profile_warmup "
         f"{p.profile_warmup}, profile_active {p.profile_active}){memory} -> {profile_path(cfg, '*').parent}")
    with profiler.trace:
        try:
            yield profiler
        finally:
            profiler.close()
    if not profiler.written:
        _warn(f"profile: the run ended after {profiler.done} steps, before the profiled {profiler.steps_label}; "
              "no trace written: raise max_steps or lower profile_wait / "
              "profile_warmup")
        return
    if p.memory_timeline and not profiler.memory_done:
        _warn(f"profile: no memory timeline: it records step {profiler.last + 1}, after the traced steps, and the "
              f"run ended after step {profiler.done}; raise max_steps")
    files = ", ".join(f"{path.name} ({_file_size(path)})" for path in profiler.written)
    _say(f"{profiler.summary}\nprofile files in {profiler.written[0].parent}: {files}")


def _range_events(prof) -> tuple[list, list]:
    """(ProfilerStep events, range events) on the host; the ranges' device-side copies are separate."""
    events = prof.events()
    steps = [e for e in events if e.name.startswith("ProfilerStep") and e.device_type.name == "CPU"]
    ranges = [e for e in events if e.name in RANGES]
    return steps, ranges


def kernel_ms_per_range(events, ranges) -> dict[str, float]:
    """Per range name: the kernel time (ms, all profiled steps) of the ops launched while that range was open on
    the host, on any thread. The range's own device-side copy spans only the kernels its thread launched, and
    backward's are launched from autograd's thread: it read 0 on an H200 (torch 2.11)."""
    ops = sorted((e for e in events if e.device_type.name == "CPU" and e.name not in RANGES
                  and not e.name.startswith("ProfilerStep")), key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in ops]
    totals = dict.fromkeys(RANGES, 0.0)
    for r in ranges:
        if r.device_type.name == "CPU":
            first, last = bisect.bisect_left(starts, r.time_range.start), bisect.bisect_left(starts, r.time_range.end)
            totals[r.name] += sum(e.self_device_time_total for e in ops[first:last]) / 1e3
    return totals


def summarize(prof, device: torch.device, title: str, top: int = 10) -> str:
    """Time split over :data:`RANGES` per profiled step, and the top ops by self time, as text.

    Host times are the Python thread's time inside each range. On CUDA, kernels run after their
    launch, so the GPU column (:func:`kernel_ms_per_range`) is the one that shows the device's work;
    a range that waits for the GPU (a sync) shows that wait on the host.
    """
    steps, ranges = _range_events(prof)
    n = max(1, len(steps))
    cuda = device.type == "cuda"
    kernel_ms = kernel_ms_per_range(prof.events(), ranges) if cuda else {}

    def per_step_ms(name: str, device_type: str) -> float:
        total = sum(e.time_range.elapsed_us() for e in ranges if e.name == name and e.device_type.name == device_type)
        return total / n / 1e3

    step_ms = sum(e.time_range.elapsed_us() for e in steps) / n / 1e3
    lines = [f"profile summary: {title}, {len(steps)} step(s) recorded",
             "time split per step    host ms   share" + ("    GPU ms" if cuda else "")]
    host_total = 0.0
    for name in RANGES:
        host = per_step_ms(name, "CPU")
        host_total += host
        label = name.strip("# ")
        gpu = f"  {kernel_ms[name] / n:8.2f}" if cuda else ""
        lines.append(f"  {label:<18} {host:9.2f}  {host / step_ms if step_ms else 0:6.1%}{gpu}")
    other = step_ms - host_total
    lines.append(f"  {'other':<18} {other:9.2f}  {other / step_ms if step_ms else 0:6.1%}"
                 "   (zero_grad, logging, validation, checkpoints)")
    lines.append(f"  {'whole step':<18} {step_ms:9.2f}  {1:6.1%}")

    # Rows: ops and (on CUDA) kernels; the ranges and ProfilerStep only add up their children.
    averages = [a for a in prof.key_averages() if a.key not in RANGES and not a.key.startswith("ProfilerStep")]
    metric = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(a, metric) for a in averages) or 1.0
    averages.sort(key=lambda a: getattr(a, metric), reverse=True)
    kind = "CUDA time (kernels)" if cuda else "CPU time"
    lines.append(f"top {top} ops by self {kind} per step")
    lines.append(f"  {'self ms':>9}  {'share':>6}  {'calls':>6}  op")
    for a in averages[:top]:
        lines.append(f"  {getattr(a, metric) / n / 1e3:9.2f}  {getattr(a, metric) / total:6.1%}  "
                     f"{a.count / n:6.0f}  {a.key[:90]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- memory timeline


def _export_memory_timeline(prof, cfg: Config, device: torch.device, step: int = 0) -> list[Path]:
    """rank<r>_memory_timeline.html and .png from the profiler's memory timeline; one warning if it fails.

    ``export_memory_timeline`` is deprecated and fragile (field notes): any failure costs the
    timeline, never the run.
    """
    html_path, png_path = profile_path(cfg, "memory_timeline.html"), profile_path(cfg, "memory_timeline.png")
    try:
        from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX  # private: imported only where it is used

        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            # Its deprecation notice; docs/part1-swinir.md (Step 0b, Limits) explains.
            warnings.simplefilter("ignore", FutureWarning)
            data_path = os.path.join(tmp, "timeline.json")
            prof.export_memory_timeline(data_path, device=_indexed(device))
            with open(data_path) as f:
                times_us, rows = json.load(f)
        if not times_us:
            raise RuntimeError(f"no memory events on {device}")
        # Row layout: [0, bytes of category 0, bytes of category 1, ...] in _CATEGORY_TO_INDEX order.
        categories = [None if c is None else c.name for c in _CATEGORY_TO_INDEX]
        sizes = [row[1:] for row in rows]
        peak = max(sizes, key=sum)
        note = ""
        if peak[categories.index(None)] > 0.5 * sum(peak):
            note = "most memory at the peak is uncategorised ('unknown')"
            if device.type == "cpu" and cfg.data.num_workers > 0:
                note += ("; on CPU this happens with DataLoader worker processes (torch 2.14): rerun with "
                         "--num_workers 0 for the categories")
            _say(f"profile: {note}")
        start_us = _trace_start_us(prof)
        spans = _host_spans(prof, start_us) if start_us is not None else []
        title = f"memory by category during step {step}, rank {read_dist_env().rank} ({device})"
        figure = plot_memory_timeline(times_us, sizes, categories, spans, title=title)
        png = io.BytesIO()
        figure.savefig(png, format="png", dpi=100)
        _write_atomically(png_path, lambda name: Path(name).write_bytes(png.getvalue()))
        html = _timeline_html(png.getvalue(), peak, categories, device, step, note)
        _write_atomically(html_path, lambda name: Path(name).write_text(html, encoding="utf-8"))
        return [html_path, png_path]
    except StorageError:
        raise  # the disk, not the API: stop the run as any failed write does
    except Exception as error:  # noqa: BLE001 — a private, deprecated API: anything may break
        failure = write_failure(error, "memory timeline", html_path, run_dir=find_run_dir(html_path))
        if failure is not None:  # e.g. its temporary JSON on a full /tmp
            raise failure from None
        reason = str(error).splitlines()[0] if str(error) else ""
        _warn(f"memory timeline not written ({type(error).__name__}: {reason}); the trace is unaffected. "
              "Set --memory_timeline false to skip it, or use --memory_snapshot true on CUDA")
        return []


def _indexed(device: torch.device) -> str:
    """"cuda:<n>" (the timeline matches devices exactly: "cuda" is not "cuda:0"), or "cpu"."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if device.index is None else device.index}"
    return str(device)


def _trace_start_us(prof) -> Optional[float]:
    """Absolute start of the trace in µs: the memory timeline is absolute, the events are relative to it."""
    try:
        return prof.profiler.kineto_results.trace_start_ns() / 1e3
    except AttributeError:
        return None


def _host_spans(prof, start_us: float) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs), absolute, of every host-side range."""
    _, ranges = _range_events(prof)
    return [(e.name, start_us + e.time_range.start, start_us + e.time_range.end)
            for e in ranges if e.device_type.name == "CPU"]


def plot_memory_timeline(times_us, sizes, categories, spans=(), title: str = ""):
    """Stacked memory by category over time, with the ranges of the step shaded.

    ``times_us``: absolute µs; ``sizes``: one row per time, bytes per category (in ``categories``
    order, names of torch.profiler._memory_profiler.Category or None); ``spans``: (name, start µs,
    end µs) of :data:`RANGES`. Returns a matplotlib Figure.
    """
    # Imported on first use: matplotlib is heavy; no pyplot: no global state, Agg canvas on save.
    from matplotlib.figure import Figure

    t0 = min([times_us[0]] + [start for _, start, _ in spans])
    t_end = max([times_us[-1]] + [end for _, _, end in spans])
    # Memory held before the first event (parameters, optimizer state) and after the last one stays drawn.
    sizes = np.asarray([sizes[0], *sizes, sizes[-1]], dtype=float)
    t_ms = (np.asarray([t0, *times_us, t_end], dtype=float) - t0) / 1e3
    scale, unit = (1e9, "GB") if sizes.sum(axis=1).max() >= 1e9 else (1e6, "MB")
    # Stacked in the profiler's order: parameters and optimizer state, the steady part, at the bottom.
    stacked = np.cumsum(np.hstack([np.zeros((len(sizes), 1)), sizes]), axis=1) / scale
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    ax = fig.subplots()
    for i, category in enumerate(categories):
        if sizes[:, i].any():
            ax.fill_between(t_ms, stacked[:, i], stacked[:, i + 1], step="post", linewidth=0,
                            color=_CATEGORY_COLORS.get(category, "#bdbdbd"),
                            label=_CATEGORY_LABELS.get(category, str(category)))
    top = stacked[:, -1].max() * 1.12 or 1.0
    range_shades = dict(zip(RANGES, ("#eeeeee", "#fff3e0", "#e3f2fd", "#f1f8e9")))
    right = t_ms[-1] or 1.0
    for name, start, end in spans:
        x0, x1 = (start - t0) / 1e3, (end - t0) / 1e3
        ax.axvspan(x0, x1, color=range_shades[name], zorder=0)
        if x1 - x0 > 0.04 * right:  # label only the ranges wide enough to hold one
            ax.text((x0 + x1) / 2, top * 0.98, name.strip("# "), ha="center", va="top", fontsize=7, color="#555555")
    ax.set_ylim(0, top)
    ax.set_xlim(0, right)
    ax.set_xlabel("time (ms); shaded: the ranges data, forward, backward, optimizer; after them: logging, "
                  "validation, checkpoints")
    ax.set_ylabel(f"allocated ({unit})")
    ax.set_title(f"{title}; peak {stacked[:, -1].max():.2f} {unit}", fontsize=10)
    fig.legend(loc="outside right upper", fontsize=8, frameon=False)
    return fig


def _timeline_html(png: bytes, peak, categories, device: torch.device, step: int, note: str = "") -> str:
    """The PNG embedded in one self-contained page, with the split at the peak as a table."""
    rows = "".join(f"<tr><td>{_CATEGORY_LABELS.get(c, c)}</td><td align='right'>{size / 1e6:,.1f}</td></tr>"
                   for c, size in zip(categories, peak) if size)
    encoded = base64.b64encode(png).decode("ascii")
    note = f"<p><b>Note:</b> {note}.</p>" if note else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>memory timeline, rank {read_dist_env().rank}"
            f"</title></head><body><h3>Memory by category during step {step} ({device})</h3>"
            f"<img alt='memory timeline' src='data:image/png;base64,{encoded}'>{note}"
            f"<h4>At the peak ({sum(peak) / 1e6:,.1f} MB)</h4>"
            f"<table><tr><th>category</th><th>MB</th></tr>{rows}</table>"
            "<p>From torch.profiler's memory timeline (categories of torch.profiler._memory_profiler.Category), "
            "drawn by utils/observe/profiling.py.</p></body></html>")


# ----------------------------------------------------------------------------- nsys


class _NsysCapture:
    """cudaProfilerStart + NVTX ranges (every op and record_function) over steps first..last (1-based)."""

    def __init__(self, device: torch.device, first: int, last: int):
        self.device, self.first, self.last = device, first, last
        self.done = 0
        self._nvtx: Optional[contextlib.AbstractContextManager] = None
        if first == 1:
            self._start()

    def _start(self) -> None:
        _synchronize(self.device)  # earlier steps' kernels stay out of the capture
        torch.cuda.profiler.start()
        self._nvtx = torch.autograd.profiler.emit_nvtx()
        self._nvtx.__enter__()
        _say(f"nsys: capture on for steps {self.first}-{self.last} (cudaProfilerStart, NVTX ranges)")

    def _stop(self) -> None:
        if self._nvtx is None:
            return
        _synchronize(self.device)  # the last step's kernels land inside the capture
        self._nvtx.__exit__(None, None, None)
        self._nvtx = None
        torch.cuda.profiler.stop()
        _say("nsys: capture off (cudaProfilerStop)")

    def step(self) -> None:
        self.done += 1
        if self.done == self.first - 1:
            self._start()
        elif self.done == self.last:
            self._stop()


@contextlib.contextmanager
def _nsys_capture(cfg: Config, device: torch.device):
    p = cfg.profile
    if device.type != "cuda":
        _say(f"nsys: skipped, NVTX ranges and cudaProfilerStart/Stop need a CUDA device (this run is on {device}); "
             "use --profile true for a torch.profiler trace")
        yield _NoProfiler()
        return
    profile_path(cfg, "").parent.mkdir(parents=True, exist_ok=True)  # a home for nsys -o <run_dir>/profile/...
    first = p.profile_wait + p.profile_warmup + 1
    capture = _NsysCapture(device, first, first + p.profile_active - 1)
    try:
        yield capture
    finally:
        capture._stop()


# ----------------------------------------------------------------------------- memory snapshot


@contextlib.contextmanager
def maybe_enable_memory_snapshot(cfg: Config, device: torch.device) -> Iterator[Optional[Path]]:
    """Record CUDA allocator history; dump ``rank<r>_memory_snapshot.pickle`` at the end or at an OOM.

    Enter it before the model is built, so parameters and optimizer state appear with their
    Python stacks. An out-of-memory error dumps the snapshot at the failing allocation (an OOM
    observer, so it works however the error is handled later), then the error goes on. Yields
    the snapshot path, or None when off or on CPU (one message says why).
    """
    p = cfg.profile
    check_profile_config(p)
    if not p.memory_snapshot:
        yield None
        return
    if device.type != "cuda":
        _say(f"memory_snapshot: skipped, CUDA memory history needs a CUDA device (this run is on {device}); "
             "use --profile true for the CPU memory timeline")
        yield None
        return
    path = profile_path(cfg, "memory_snapshot.pickle")
    state = {"recording": True, "dumped_on_oom": False}

    def dump(reason: str) -> None:
        _write_atomically(path, torch.cuda.memory._dump_snapshot)
        stream = sys.stderr if reason.startswith("out of memory") else sys.stdout  # next to the OOM traceback
        print(f"memory_snapshot: {reason}: wrote {path} ({_file_size(path)}); "
              "open it at https://pytorch.org/memory_viz", file=stream, flush=True)

    def on_out_of_memory(device_index, requested, device_allocated, device_free) -> None:
        if state["recording"] and not state["dumped_on_oom"]:
            state["dumped_on_oom"] = True
            try:
                dump(f"out of memory on cuda:{device_index} (asked {requested / 1e9:.2f} GB, "
                     f"{device_free / 1e9:.2f} GB free)")
            except StorageError as error:  # called from the allocator: warn, the OOM error follows
                _warn(f"memory_snapshot: {error}")

    torch.cuda.memory._record_memory_history(max_entries=p.memory_snapshot_entries, stacks="python", device=device)
    torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)
    ending = "end of run"
    try:
        yield path
    except BaseException as error:
        ending = f"stopped by {type(error).__name__}"
        raise
    finally:
        try:
            if not state["dumped_on_oom"]:
                try:
                    dump(ending)
                except StorageError as error:
                    if ending == "end of run":
                        raise
                    _warn(f"memory_snapshot: {error}")  # the error that stopped the run stays the one reported
        finally:
            state["recording"] = False  # observers cannot be detached: this one just stops acting
            torch.cuda.memory._record_memory_history(enabled=None, device=device)


# ----------------------------------------------------------------------------- throughput breakdown


def _endless(loader) -> Iterator:
    """The loader's batches, epoch after epoch (new crops each time), for as long as asked."""
    epoch = 0
    while True:
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _samples_per_sec(run_one: Callable[[], int], steps: int, warmup: int, device: torch.device) -> float:
    """Samples per second of ``run_one()`` (returns its batch size) over ``steps`` calls after ``warmup``."""
    for _ in range(warmup):
        run_one()
    _synchronize(device)
    start, samples = time.perf_counter(), 0
    for _ in range(steps):
        samples += run_one()
    _synchronize(device)
    return samples / (time.perf_counter() - start)


def throughput_breakdown(cfg: Config, loader, model, optimizer, loss_fn, scaler,
                         device: torch.device) -> Optional[dict[str, float]]:
    """IO / SYNTHETIC / FULL samples/s of this rank, printed as one table; None unless profiling.

    Runs after training (``breakdown_steps`` timed steps per phase; 0 skips it), so the run itself
    is untouched; its extra optimizer steps change only the weights in memory, never a checkpoint.

    - IO: batches from the training loader, nothing else.
    - SYNTHETIC: the training step (as in train.py's loop) on one batch kept on the device.
    - FULL: loader, copy to the device and training step, as in the real loop.

    Warm-up: the loader's queue (num_workers x prefetch_factor batches) fills before timing starts,
    so FULL measures the steady state; IO and FULL time whole rounds of the workers (steps rounded up
    to a multiple of num_workers). Reads of data read during training may come from the page
    cache, making IO optimistic against a cold parallel file system.
    """
    p, amp_dtype = cfg.profile, cfg.train.amp_dtype
    check_profile_config(p)
    if not p.profile or p.breakdown_steps == 0:
        return None
    steps = p.breakdown_steps
    queue = max(1, loader.num_workers * (loader.prefetch_factor or 1))
    # Workers started together deliver their batches in rounds of num_workers; timing part of a round
    # counts a round's wait for a fraction of its batches (10 steps of 8 workers: 5/8 of the rate).
    workers = max(1, loader.num_workers)
    loader_steps = -(-steps // workers) * workers

    def to_device(batch):
        return [tensor.to(device, non_blocking=True) for tensor in batch]

    def train_step(inputs, target) -> int:  # the compute of one step of train.py's loop; keep the two alike
        optimizer.zero_grad(set_to_none=True)
        with autocast(device, amp_dtype):
            pred = model(inputs)
        loss = loss_fn(pred.float(), target)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return inputs.shape[0]

    batches = _endless(loader)
    io_rate = _samples_per_sec(lambda: len(next(batches)[0]), loader_steps, queue, device)
    cached = to_device(next(batches))
    synthetic_rate = _samples_per_sec(lambda: train_step(*cached), steps, 2, device)
    batches = _endless(loader)  # a fresh iterator: its queue fills during FULL's own warm-up
    full_rate = _samples_per_sec(lambda: train_step(*to_device(next(batches))), loader_steps, queue, device)
    batches = cached = None  # free the loader's workers and the cached batch (a del here trips pyflakes: lambdas)

    rates = {"io_samples_per_sec": io_rate, "synthetic_samples_per_sec": synthetic_rate,
             "full_samples_per_sec": full_rate}
    _say(format_breakdown(rates, batch_size=loader.batch_size, steps=steps, loader_steps=loader_steps))
    return rates


def format_breakdown(rates: dict[str, float], batch_size: int, steps: int, loader_steps: Optional[int] = None) -> str:
    """The IO / SYNTHETIC / FULL table and which one bounds the run."""
    io_rate, synthetic, full = (rates[f"{k}_samples_per_sec"] for k in ("io", "synthetic", "full"))
    if full > 1.1 * min(io_rate, synthetic):
        verdict = (f"inconclusive: FULL is faster than {'IO' if io_rate < synthetic else 'SYNTHETIC'} alone, so the "
                   "machine's speed changed between phases (other processes?); rerun on an idle node or with more "
                   "breakdown_steps")
    elif io_rate < synthetic:
        verdict = (f"bound by data loading: the loader delivers {io_rate / synthetic:.0%} of what the step can "
                   "take; raise num_workers, read less per sample, or use faster storage")
    elif full < 0.9 * synthetic:
        verdict = (f"loader and step slow each other down: each is fast alone, together {full / synthetic:.0%} "
                   "of SYNTHETIC (shared CPU cores, host-to-device copies without pin_memory, syncs)")
    else:
        verdict = (f"bound by compute: FULL is {full / synthetic:.0%} of SYNTHETIC and the loader is "
                   f"{io_rate / synthetic:.1f}x faster; speed up the step (AMP, torch.compile), not the loader")
    return "\n".join([
        f"throughput breakdown (samples/s on this rank, batch {batch_size}, {steps} timed steps per phase"
        + (f"; IO and FULL {loader_steps}, whole rounds of the loader's workers" if loader_steps not in (None, steps)
           else "") + "):",
        f"  IO         data loader alone                 {io_rate:10.1f}",
        f"  SYNTHETIC  training step on a cached batch   {synthetic:10.1f}",
        f"  FULL       data loader + training step       {full:10.1f}",
        f"  -> {verdict}",
    ])

