"""What DDP's gradient all-reduce costs: train_ddp.py with and without it, in one run, same machine.

    python benchmarks/bench_ddp_overhead.py --nproc 2 -- --config quickstart --max_steps 40
    python benchmarks/bench_ddp_overhead.py --nproc 4 -- --config baseline --max_steps 60   # one GPU node

Arguments after `--` go to train_ddp.py. The two variants run alternately, `--repeats` times each,
under torchrun (so that a machine that speeds up or slows down during the benchmark affects both);
each run's figure is the median of its logged samples/s after the first log window (start-up and
warm-up excluded), and each variant's figure the median over its runs.
`no_ddp` skips the all-reduce (ranks drift apart), so its speed is the compute-only bound.
"""

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def samples_per_sec(nproc: int, train_args: list[str], no_ddp: bool, keep_in: Path | None = None) -> float:
    """One torchrun run's median samples/s; its outputs go to a temporary folder, or stay in ``keep_in``."""
    with contextlib.nullcontext(keep_in) if keep_in else tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "train_ddp.py", *train_args, "--run_dir", run_dir, "--no_ddp", str(no_ddp).lower(),
               "--progress", "never", "--val_every", "0", "--ckpt_every", "0"]
        subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_sec"] for r in records if r["kind"] == "train"][1:]
    if not rates:
        sys.exit("error: too few log records; raise --max_steps or lower --log_every")
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs) per node")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train_ddp.py arguments")
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"] or ["--config", "quickstart", "--max_steps", "40"]
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    runs = {False: [], True: []}
    for _ in range(args.repeats):
        for no_ddp in (False, True):
            runs[no_ddp].append(samples_per_sec(args.nproc, train_args, no_ddp))
    with_ddp, without = statistics.median(runs[False]), statistics.median(runs[True])
    print(f"{'variant':<10}{'samples/s':>12}   runs")
    for name, no_ddp, rate in (("ddp", False, with_ddp), ("no_ddp", True, without)):
        print(f"{name:<10}{rate:>12.2f}   " + " ".join(f"{r:.2f}" for r in runs[no_ddp]))
    print(f"DDP overhead: {100 * (without / with_ddp - 1):+.1f}% time per step with the all-reduce than without "
          f"({args.nproc} processes, {' '.join(train_args)})")
    spread = max(max(r) / min(r) - 1 for r in runs.values())
    if args.repeats > 1 and abs(without / with_ddp - 1) < spread:
        print(f"  below this machine's noise: runs of the same variant differ by up to {100 * spread:.0f}%")
    print(json.dumps({"ddp_samples_per_sec": with_ddp, "no_ddp_samples_per_sec": without,
                      "overhead": without / with_ddp - 1}))


if __name__ == "__main__":
    main()
