"""Step 0c, the optimisation ladder: samples/s of one device as each speed-up is switched on, cumulatively.

    python benchmarks/ladder.py --config quickstart                       # laptop: the rungs a CPU has
    python benchmarks/ladder.py --config vit_quickstart --steps 30 --breakdown-steps 30
    python benchmarks/ladder.py --config baseline --steps 200 --breakdown-steps 100    # one GPU
    sbatch submit_singlegpu.sh benchmarks/ladder.py --config vit_base --steps 200

Every rung is a set of config keys of the training scripts (NERSC's single-GPU ladder, with
PyTorch in place of DALI: utils/data/device_pipeline.py says why), so a rung that pays off is switched on
in a real run with the same keys. Each rung is one `train_with_profiling.py` run in a fresh process
with the keys of this rung and every rung before it: ``--steps`` training steps (compilation and
warm-up happen there), then the throughput breakdown's ``--breakdown-steps`` timed steps of

- FULL, loader + copy + step as in the training loop: the rung's samples/s;
- SYNTHETIC, the step on a batch kept on the device: FULL / SYNTHETIC shows what the loader still costs.

Rungs that need CUDA (TF32, CUDA graphs) are listed as skipped on a CPU, with the reason, and so is
bf16 on a CPU that emulates it (no AVX512-BF16 or AMX: slower than fp32, and every later rung would
inherit the slowdown). The table
goes to stdout; ladder.json and ladder.png (bars at the median of the ``--repeats`` climbs, a dot for each)
to ``--out``; a rung whose step is within the run-to-run spread is marked "not resolved on this machine". Arguments after ``--`` go to every
run (they cannot change a rung's own keys). Peak memory: CUDA, the peak of allocated tensors;
CPU, the process's peak resident set (everything, not only tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.bench_model import cpu_description, supports_bf16_matmul  # noqa: E402
from utils.config import KEYS  # noqa: E402


@dataclass
class Rung:
    name: str
    what: str
    keys: dict
    needs: str = ""
    """What the rung needs: "cuda" (does nothing without CUDA), "bf16" (bf16 matmuls in hardware (a CPU without them emulates
    bf16, far slower than fp32, and every later rung would inherit that), or "" (nothing)."""


def rungs(workers: int) -> list[Rung]:
    """NERSC's ladder in order; each rung's keys add to the ones before."""
    return [
        Rung("baseline", "no loader workers, fp32, TF32 off, for-each AdamW, eager",
             {"num_workers": 0, "pin_memory": False, "persistent_workers": False, "device_transforms": False,
              "prefetch_to_device": False, "tf32": False, "amp_dtype": "none", "fused_optimizer": False,
              "compile": False, "cuda_graphs": False}),
        Rung("workers", f"{workers} loader workers, pinned memory, persistent workers",
             {"num_workers": workers, "pin_memory": True, "persistent_workers": True}),
        Rung("device pipeline", "transforms after the copy, next batch copied during the step",
             {"device_transforms": True, "prefetch_to_device": True}),
        Rung("tf32", "TF32 matmuls and convolutions", {"tf32": True}, needs="cuda"),
        Rung("bf16", "autocast to bfloat16", {"amp_dtype": "bf16"}, needs="bf16"),
        Rung("fused adamw", "one optimizer kernel for all parameters", {"fused_optimizer": True}),
        Rung("compile", "torch.compile of each block (inductor)", {"compile": True}),
        Rung("cuda graphs", "compiled blocks replayed as CUDA graphs", {"cuda_graphs": True}, needs="cuda"),
    ]


@dataclass
class Result:
    rung: str
    what: str
    keys: dict
    skipped: str = ""
    samples_per_sec: Optional[float] = None
    synthetic_samples_per_sec: Optional[float] = None
    peak_mem_gb: Optional[float] = None
    extra: dict = field(default_factory=dict)

    @property
    def loader_share(self) -> Optional[float]:
        """The fraction of the step's possible speed the loader still takes away: 1 - FULL / SYNTHETIC."""
        if self.samples_per_sec is None:
            return None
        return max(0.0, 1.0 - self.samples_per_sec / self.synthetic_samples_per_sec)


def run_rung(args: list[str]) -> list[dict]:
    """train_with_profiling.py with ``args`` in a fresh process (its own peak memory, no compile cache in
    memory); its metrics.jsonl records."""
    # From the caller's folder, as the user would run it: relative data and run folders mean the same.
    proc = subprocess.run([sys.executable, str(REPO / "train_with_profiling.py"), *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode:  # the profiler's own chatter on stderr is shown only when something went wrong
        sys.stderr.write(proc.stderr[-3000:])
        raise subprocess.CalledProcessError(proc.returncode, proc.args)
    return read_records(args)


def read_records(args: list[str]) -> list[dict]:
    """The metrics.jsonl records of the run these arguments made."""
    run_dir = Path(args[args.index("--run_dir") + 1])
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rung_args(config: str, keys: dict, steps: int, breakdown_steps: int, run_dir: str, extra: list[str]) -> list[str]:
    args = ["--config", config, *extra]
    for key, value in keys.items():
        args += [f"--{key}", json.dumps(value) if not isinstance(value, str) else value]
    # Trace one step only (the trace is not the point); the breakdown runs after the training steps.
    return args + ["--max_steps", str(steps), "--log_every", str(steps), "--val_every", "0", "--ckpt_every", "0",
                   "--breakdown_steps", str(breakdown_steps), "--profile", "true", "--profile_wait", "0",
                   "--profile_warmup", "1", "--profile_active", "1", "--memory_timeline", "false",
                   "--progress", "never", "--run_dir", run_dir]


SKIP_REASONS = {
    "cuda": "needs CUDA",
    "bf16": "needs bf16 in hardware: this CPU has no AVX512-BF16/AMX and emulates it, slower than fp32",
}


def missing(cuda: bool) -> dict[str, bool]:
    """What this machine lacks, by Rung.needs."""
    return {"cuda": not cuda, "bf16": not cuda and not supports_bf16_matmul(torch.device("cpu"))}


def climb(config: str, steps: int, breakdown_steps: int, workers: int, lacks: dict[str, bool], extra: list[str],
          only: Optional[list[str]] = None, runner: Callable[[list[str]], list[dict]] = run_rung) -> list[Result]:
    results, keys = [], {}
    for rung in rungs(workers):
        before, keys = keys, {**keys, **rung.keys}
        shown = not only or rung.name in only or rung.name == "baseline"
        if lacks.get(rung.needs):
            keys = before  # later rungs run without it, measured or not
            if shown:
                results.append(Result(rung.name, rung.what, rung.keys, skipped=SKIP_REASONS[rung.needs]))
            continue
        if not shown:
            continue
        print(f"rung {len(results) + 1}: {rung.name} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as run_dir:
            records = runner(rung_args(config, keys, steps, breakdown_steps, run_dir, extra))
        rates = next(r for r in records if r["kind"] == "throughput")
        train = [r for r in records if r["kind"] == "train"][-1]
        results.append(Result(rung.name, rung.what, rung.keys, samples_per_sec=rates["full_samples_per_sec"],
                              synthetic_samples_per_sec=rates["synthetic_samples_per_sec"],
                              peak_mem_gb=train["peak_mem_gb"], extra={"io_samples_per_sec": rates["io_samples_per_sec"]}))
        # Each rung's figures as soon as it ends: a job that its time limit cuts short still says how far it got.
        print(f"  {rung.name}: {rates['full_samples_per_sec']:.1f} samples/s (SYNTHETIC "
              f"{rates['synthetic_samples_per_sec']:.1f}, IO {rates['io_samples_per_sec']:.1f}), peak "
              f"{train['peak_mem_gb']:.2f} GB", file=sys.stderr, flush=True)
    return results


def combine(climbs: list[list[Result]]) -> list[Result]:
    """Several climbs as one: per rung the median of each rate, the largest peak, every FULL figure kept
    (``extra["runs"]``) and their spread, (largest - smallest) / median."""
    combined = []
    for same in zip(*climbs):
        first = same[0]
        if first.samples_per_sec is None:
            combined.append(first)
            continue
        full = [r.samples_per_sec for r in same]
        median = statistics.median(full)
        combined.append(Result(first.rung, first.what, first.keys, samples_per_sec=median,
                               synthetic_samples_per_sec=statistics.median(r.synthetic_samples_per_sec for r in same),
                               peak_mem_gb=max(r.peak_mem_gb for r in same),
                               extra={"io_samples_per_sec": statistics.median(r.extra["io_samples_per_sec"] for r in same),
                                      "runs": full, "spread": (max(full) - min(full)) / median}))
    return combined


NOT_RESOLVED = "not resolved on this machine"


def unresolved(results: list[Result]) -> set[str]:
    """Rungs whose step from the rung measured before them is smaller than the spread of either: their effect
    is not told apart from the run-to-run noise (with one climb nothing is known of the noise: none)."""
    measured = [r for r in results if r.samples_per_sec is not None]
    return {r.rung for prev, r in zip(measured, measured[1:])
            if abs(r.samples_per_sec / prev.samples_per_sec - 1) <= max(r.extra.get("spread", 0),
                                                                         prev.extra.get("spread", 0))}


def format_table(results: list[Result]) -> str:
    measured = [r for r in results if r.samples_per_sec is not None]
    base, noisy = measured[0].samples_per_sec, unresolved(results)
    lines = [f"{'rung':<16}{'samples/s':>10}{'x base':>8}{'x prev':>8}{'peak GB':>9}{'loader':>8}{'spread':>8}  what"]
    previous = None
    for r in results:
        if r.samples_per_sec is None:
            lines.append(f"{r.rung:<16}{'-':>10}{'':>8}{'':>8}{'':>9}{'':>8}{'':>8}  skipped: {r.skipped}")
            continue
        step_up = f"{r.samples_per_sec / previous:>8.2f}" if previous else f"{'':>8}"
        lines.append(f"{r.rung:<16}{r.samples_per_sec:>10.2f}{r.samples_per_sec / base:>8.2f}{step_up}"
                     f"{r.peak_mem_gb:>9.2f}{r.loader_share:>8.0%}{r.extra.get('spread', 0):>8.0%}  "
                     f"{f'{NOT_RESOLVED}: ' if r.rung in noisy else ''}{r.what}")
        previous = r.samples_per_sec
    lines.append("loader = 1 - FULL / SYNTHETIC: the share of the step's own speed that loading still costs; "
                 "spread = (fastest - slowest) / median over the repeats: differences below it are noise, and a "
                 f"rung whose x prev is within its own or the previous rung's spread is {NOT_RESOLVED}")
    return "\n".join(lines)


def plot(results: list[Result], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    names = [r.rung for r in results]
    values = [r.samples_per_sec or 0.0 for r in results]
    noisy = unresolved(results)
    bars = ax.bar(names, values, color=["tab:blue" if r.samples_per_sec else "lightgrey" for r in results],
                  hatch=["//" if r.rung in noisy else "" for r in results], edgecolor="white", alpha=0.8)
    base = next(r.samples_per_sec for r in results if r.samples_per_sec)
    for x, (bar, r) in enumerate(zip(bars, results)):
        runs = r.extra.get("runs", [r.samples_per_sec] if r.samples_per_sec else [])
        if runs:  # every climb as a point, the bar at their median, a whisker from the slowest to the fastest
            ax.plot([x] * len(runs), runs, "o", color="black", markersize=3, zorder=3)
            ax.vlines(x, min(runs), max(runs), color="black", linewidth=1, zorder=3)
        label = f"{r.samples_per_sec / base:.2f}x" if r.samples_per_sec else "skipped"
        label += "\nnot resolved" if r.rung in noisy else ""
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, max([bar.get_height(), *runs])), ha="center",
                    va="bottom", fontsize=7.5)
    ax.set_ylabel(f"samples/s (FULL); bar: median of {max(len(r.extra.get('runs', [0])) for r in results)}, "
                  "dots: each climb", fontsize=8)
    ax.set_title(textwrap.fill(title, 100), fontsize=8)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def device_name() -> tuple[str, bool]:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}", True
    return f"{cpu_description()}, {os.cpu_count()} cores, torch {torch.__version__}", False


def main(argv: Optional[list[str]] = None, runner: Callable[[list[str]], list[dict]] = run_rung) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="quickstart", help="named config to climb the ladder with")
    parser.add_argument("--steps", type=int, default=20, help="training steps per rung before the timing (warm-up)")
    parser.add_argument("--breakdown-steps", type=int, default=30, help="timed steps per phase (FULL, SYNTHETIC)")
    parser.add_argument("--workers", type=int, default=min(4, max(1, (os.cpu_count() or 2) - 1)),
                        help="loader workers from the workers rung on (default: 4, or one fewer than the cores)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="climbs, one after the other; each rung's figure is the median (a shared machine drifts)")
    parser.add_argument("--rungs", nargs="+", default=None, metavar="RUNG",
                        help="measure only these rungs (the baseline always runs; the keys of skipped rungs still add up)")
    parser.add_argument("--out", default=None, help="folder for ladder.json and ladder.png (default: runs/ladder_CONFIG)")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then arguments for every run")
    args = parser.parse_args(argv)
    extra = [a for a in args.train_args if a != "--"]
    names = [r.name for r in rungs(1)]
    if args.steps < 2 or args.breakdown_steps < 1 or args.workers < 1 or args.repeats < 1:
        parser.error("--steps must be >= 2 (one profiler warm-up step, one traced), --breakdown-steps, --workers and "
                     "--repeats >= 1")
    unknown = [r for r in args.rungs or [] if r not in names]
    if unknown:
        parser.error(f"unknown rung(s) {', '.join(unknown)}; rungs: {', '.join(repr(n) for n in names)}")
    clash = sorted({a[2:] for a in extra if a.startswith("--")} & {k for r in rungs(1) for k in r.keys})
    if clash:
        parser.error(f"--{', --'.join(clash)} belong to the ladder's rungs; leave them out of the arguments after --")
    bad = [a for a in extra if a.startswith("--") and a[2:] not in KEYS and a[2:] != "config"]
    if bad:
        parser.error(f"unknown config key(s) after --: {', '.join(bad)} (python train.py --help lists them)")
    out = Path(args.out or f"runs/ladder_{args.config}")
    out.mkdir(parents=True, exist_ok=True)

    device, cuda = device_name()
    try:
        results = combine([climb(args.config, args.steps, args.breakdown_steps, args.workers, missing(cuda), extra,
                                 args.rungs, runner) for _ in range(args.repeats)])
    except subprocess.CalledProcessError as error:
        print(f"error: a rung's run exited {error.returncode} (its message is above); nothing written", file=sys.stderr)
        return 1
    title = (f"ladder: --config {args.config} {' '.join(extra)}".rstrip() + f" on {device}; {args.steps} steps, then "
             f"{args.breakdown_steps} timed per phase; median of {args.repeats} climb(s)")
    print(title)
    print(format_table(results))
    (out / "ladder.json").write_text(json.dumps(
        {"config": args.config, "device": device, "steps": args.steps, "breakdown_steps": args.breakdown_steps,
         "repeats": args.repeats, "train_args": extra,
        "rungs": [{**asdict(r), "loader_share": r.loader_share} for r in results]}, indent=1))
    plot(results, title, out / "ladder.png")
    print(f"wrote {out / 'ladder.json'} and {out / 'ladder.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
