"""The pipeline bubble, measured, next to the theory: train_pp.py once per schedule and microbatch count.

    python benchmarks/bench_pp.py                     # SwinIR with 4 RSTBs on 2 CPU processes (quickstart data)
    python benchmarks/bench_pp.py --nproc 4 --microbatches 4 8 16 -- --config baseline --max_steps 20  # 4 GPUs

For each schedule (gpipe, 1f1b, interleaved_1f1b, zbv) and microbatch count, one run on --nproc
processes (pp = nproc): each rank's idle fraction over the steps after the first (time outside its
stages' forward and backward chunks, from timestamps), the theory (p - 1) / (v m + p - 1), the median
seconds per step, and the largest rank's memory (parameters + gradients + AdamW state, and the most
activation bytes alive at once in the first step). Arguments after `--` go to train_pp.py.

    python benchmarks/bench_pp.py --microbatches 8 --timeline docs/pipeline_timeline.png   # the picture of Step 7

--timeline draws each run's last training step, per rank, from the chunk timestamps of its `pipeline` record:
forward (F), backward (B; under ZB-V its input-gradient half) and ZB-V's weight-gradient half (W), the gaps
between them being the bubble.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_mp import run_records  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes = pipeline stages (pp)")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8], help="microbatch counts to run")
    parser.add_argument("--timeline", type=Path, default=None, help="PNG of every run's last step per rank")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train_pp.py arguments")
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"] or [
        "--config", "quickstart", "--model_args", "{depths: [1,1,1,1], num_heads: [2,2,2,2]}", "--batch_size", "8",
        "--max_steps", "8", "--log_every", "1"]
    print(f"train_pp.py {' '.join(train_args)} --pp {args.nproc}")
    print(f"{'schedule':<18}{'microbatches':>12}  {'bubble per rank (measured)':<28}{'theory':>7}"
          f"{'s/step':>8}{'MB/rank':>9}{'activations MB':>16}")
    timelines = []
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in SCHEDULES:
            for m in args.microbatches:
                records = run_records("train_pp.py", args.nproc,
                                      [*train_args, "--pp", str(args.nproc), "--pp_schedule", schedule,
                                       "--pp_microbatches", str(m)], Path(tmp) / f"{schedule}_{m}")
                bubble = next(r for r in records if r["kind"] == "pipeline")
                memory = next(r for r in records if r["kind"] == "memory")
                steps = [r for r in records if r["kind"] == "train"][1:]
                step_s = statistics.median(r["samples_per_sec"] for r in steps)
                batch = int(train_args[train_args.index("--batch_size") + 1]) if "--batch_size" in train_args else 0
                per_rank = " ".join(f"{b:.2f}" for b in bubble["bubble_per_rank"])
                print(f"{schedule:<18}{m:>12}  {per_rank:<28}{bubble['bubble_theory']:>7.2f}"
                      f"{(batch / step_s if batch else float('nan')):>8.2f}{memory['total_mb']:>9.2f}"
                      f"{memory['activations_mb']:>16.2f}", flush=True)
                timelines.append(bubble)
    if args.timeline:
        draw_timelines(timelines, args.timeline)
        print(f"timeline: {args.timeline}")


COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}


def draw_timelines(records: list[dict], path: Path) -> None:
    """One panel per run: a row per rank, a box per chunk (letter and stage inside where it fits)."""
    import matplotlib  # only the picture needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(records), 1, figsize=(10, 1.1 + 0.55 * sum(len(r["timeline_ms"]) for r in records)),
                             squeeze=False)
    for ax, record in zip(axes[:, 0], records):
        ranks = record["timeline_ms"]
        for rank, chunks in enumerate(ranks):
            for kind, stage, start, end in chunks:
                ax.barh(rank, end - start, left=start, height=0.8, color=COLOURS[kind], edgecolor="white", linewidth=0.5)
                if end - start > 0.025 * max(c[3] for r in ranks for c in r):
                    ax.text((start + end) / 2, rank, f"{kind}{stage}", ha="center", va="center", fontsize=7,
                            color="white")
        measured = " / ".join(f"{b:.2f}" for b in record["bubble_per_rank"])
        ax.set_title(f"{record['schedule']}, {record['stages']} stages, {record['microbatches']} microbatches: "
                     f"idle {measured} per rank (theory {record['bubble_theory']:.2f})", fontsize=9, loc="left")
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
        ax.invert_yaxis()
        ax.set_xlim(left=0)
    axes[-1, 0].set_xlabel("ms from the start of the step (each rank's own clock)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    fig.legend(handles, ["forward", "backward (ZB-V: input gradient)", "weight gradient (ZB-V)"], loc="upper right",
               ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
