"""A PNG timeline of torch.profiler traces, drawn from the trace files themselves (what Perfetto's top rows show).

    python benchmarks/draw_trace.py runs/quickstart_profile/profile/rank0_trace.json.gz
    python benchmarks/draw_trace.py runs/RUN/profile/rank*_trace.json.gz --out timeline.png

Per trace (one per rank, as train_with_profiling.py writes them: ``rank<r>_trace.json.gz``, gzip or plain
Chrome-trace JSON), one row per kind of event, coloured by kind: the profiled steps (``ProfilerStep#N``), the
four ranges of the training loop (utils/observe/profiling.py, RANGES), the communication ops (names of the
collectives and of their backends: nccl, gloo, all_reduce, all_gather, reduce_scatter, broadcast) and, when the
trace has a GPU, its kernels (``"cat": "kernel"``). A kind the trace lacks has no row. The x axis is in ms from
the rank's first profiled step: each rank is measured on its own clock.

A file that is not a trace (not JSON, no ``traceEvents``, nothing of the kinds above) is one ``error:`` line
and exit code 2.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: the ranges' names come from it
from utils.observe.profiling import RANGES  # noqa: E402

STEP = "step"
COMMUNICATION = "communication"
KERNELS = "GPU kernels"
COLOURS = {STEP: "#bdbdbd", "## data ##": "#8c8c8c", "## forward ##": "#4C72B0", "## backward ##": "#DD8452",
           "## optimizer ##": "#55A868", COMMUNICATION: "#C44E52", KERNELS: "#8172B3"}
ROW_ORDER = (STEP, *RANGES, COMMUNICATION, KERNELS)
# Collectives by name, whatever layer recorded them: c10d's ops (c10d::allreduce_), the backends' ranges
# (gloo:all_reduce, nccl:all_reduce) and NCCL's kernels (ncclDevKernel_AllReduce_...); aten's ops are local
# tensor ops even when the name matches (aten::broadcast_tensors, in every model's loss).
COMM_NAME = re.compile(r"nccl|gloo|all_?reduce|all_?gather|reduce_?scatter|broadcast", re.IGNORECASE)
LOCAL_OP = "aten::"
RANK_IN_NAME = re.compile(r"rank(\d+)_")


class TraceError(ValueError):
    """A file that cannot be drawn: its message is the one line the user sees."""


@dataclass
class Timeline:
    """One trace's rows: kind -> [(start ms, duration ms)], on the rank's own clock, from its first profiled step."""

    label: str
    rows: dict = field(default_factory=dict)
    step_names: list = field(default_factory=list)  # "ProfilerStep#N" (counted from 0) per bar of the step row


def load_events(path: Path) -> list[dict]:
    """The complete events ("ph": "X") of a Chrome trace, gzip or plain JSON."""
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw  # gzip's magic bytes, whatever the name
        trace = json.loads(text)
    except OSError as error:
        raise TraceError(f"{path}: cannot read it ({error.strerror or error})") from None
    except (ValueError, EOFError) as error:  # not JSON, not UTF-8, or a truncated gzip
        raise TraceError(f"{path} is not a Chrome trace: {str(error).splitlines()[0]}") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise TraceError(f"{path} is not a Chrome trace: no traceEvents list (torch.profiler's "
                         "export_chrome_trace writes one)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
            and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]


def kind_of(event: dict) -> str | None:
    """The row an event belongs to, or None (the thousands of other ops)."""
    name, category = str(event.get("name", "")), event.get("cat")
    if category == "user_annotation" and name.startswith("ProfilerStep#"):
        return STEP
    if category == "user_annotation" and name in RANGES:  # the CPU thread's ranges, not their GPU shadows
        return name
    if (category in ("user_annotation", "cpu_op", "kernel", "gpu_user_annotation") and COMM_NAME.search(name)
            and not name.startswith(LOCAL_OP)):
        return COMMUNICATION
    if category == "kernel":
        return KERNELS
    return None


def timeline(events: list[dict], label: str) -> Timeline:
    """The rows of one trace, in ms from its first ProfilerStep (from its first event if it has none)."""
    kinds = [(kind_of(e), e) for e in events]
    kinds = [(k, e) for k, e in kinds if k is not None]
    if not kinds:
        raise TraceError(f"{label}: no profiled steps, ranges, communication or kernels in it: not a trace of "
                         "the training loop")
    steps = [e["ts"] for k, e in kinds if k == STEP]
    origin = min(steps) if steps else min(e["ts"] for _, e in kinds)
    result = Timeline(label)
    for kind in ROW_ORDER:
        spans = sorted(((e["ts"] - origin) / 1e3, e["dur"] / 1e3, e["name"]) for k, e in kinds if k == kind)
        if spans:
            result.rows[kind] = [(start, dur) for start, dur, _ in spans]
            if kind == STEP:
                result.step_names = [name for _, _, name in spans]
    return result


def rank_label(path: Path, events_file_index: int) -> str:
    match = RANK_IN_NAME.search(path.name)
    return f"rank {match.group(1)}" if match else f"trace {events_file_index}"


def draw(timelines: list[Timeline], out: Path, title: str = "", dpi: int = 100) -> Path:
    """One band of rows per trace, top to bottom, as Perfetto stacks them; written as a PNG."""
    labels, spans, colours, names = [], [], [], []
    for tl in timelines:
        for kind, row in tl.rows.items():
            labels.append(f"{tl.label}: {kind.strip('# ')}")
            spans.append(row)
            colours.append(COLOURS[kind])
            names.append(tl.step_names if kind == STEP else [])
    fig = Figure(figsize=(10, 0.9 + 0.32 * len(labels)), layout="constrained")
    ax = fig.subplots()
    for y, (row, colour, row_names) in enumerate(zip(spans, colours, names)):
        # Zero-length events (instant ops) still show as a hairline; steps are outlined, as they abut.
        ax.broken_barh([(start, max(dur, 1e-3)) for start, dur in row], (y - 0.38, 0.76), facecolors=colour,
                       edgecolors="#616161" if row_names else "none", linewidth=0.6)
        for (start, dur), name in zip(row, row_names):
            ax.text(start + dur / 2, y, name, ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlabel("ms from the first profiled step (each rank on its own clock)", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    kinds = [k for k in ROW_ORDER if any(k in tl.rows for tl in timelines)]
    ax.legend(handles=[Patch(color=COLOURS[k], label=k.strip("# ")) for k in kinds], fontsize=7, ncol=len(kinds),
              loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    if title:
        fig.suptitle(title, fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=dpi)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", nargs="+", type=Path, help="rank<r>_trace.json.gz files (or plain .json)")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG to write (default: trace_timeline.png beside the first trace)")
    parser.add_argument("--title", default="", help="a line above the picture")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    try:
        timelines = [timeline(load_events(path), rank_label(path, i)) for i, path in enumerate(args.traces)]
    except TraceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    out = draw(timelines, args.out or args.traces[0].parent / "trace_timeline.png", args.title, args.dpi)
    for tl in timelines:
        print(f"{tl.label}: " + ", ".join(f"{kind.strip('# ')} {len(row)}" for kind, row in tl.rows.items()))
    print(f"wrote {out} ({out.stat().st_size / 1e3:.0f} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
