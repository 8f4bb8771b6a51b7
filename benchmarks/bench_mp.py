"""What each model-parallel layout holds per rank and how fast it steps: train_mp.py on a ViT, one run per layout.

    python benchmarks/bench_mp.py                          # vit_quickstart's model, 2 processes, CPU
    python benchmarks/bench_mp.py --nproc 4 -- --config vit_mp --max_steps 20    # one 4-GPU node

Layouts: 1 process (the reference), then on --nproc processes FSDP alone (dp), tensor parallel (tp),
context parallel (cp) and, with 4 or more processes, tp 2 x cp 2. Each run's memory record (largest
rank: parameters, gradients, AdamW state; bytes saved for backward in one step) and its median
samples/s after the first log window are printed, with each layout's ratio to one process. Arguments
after `--` go to train_mp.py; without --data_dir, a small synthetic 20-channel data set is generated
in a temporary folder (vit_quickstart's 32x64 grid).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def layouts(nproc: int) -> list[tuple[str, int, list[str]]]:
    """(name, processes, train_mp.py options)."""
    rows = [("1 process", 1, []), (f"dp {nproc} (FSDP)", nproc, []), (f"tp {nproc}", nproc, ["--tp", str(nproc)]),
            (f"cp {nproc}", nproc, ["--cp", str(nproc)])]
    if nproc >= 4 and nproc % 4 == 0:
        rows.append((f"tp 2 x cp 2 x dp {nproc // 4}", nproc, ["--tp", "2", "--cp", "2"]))
    return rows


def run_records(script: str, nproc: int, args: list[str], run_dir: Path) -> list[dict]:
    """The metrics records of one torchrun launch of ``script`` (no validation, no checkpoints)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           script, *args, "--run_dir", str(run_dir), "--progress", "never", "--val_every", "0",
           "--ckpt_every", "0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {' '.join(cmd[3:])} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(nproc: int, args: list[str], run_dir: Path) -> dict:
    records = run_records("train_mp.py", nproc, args, run_dir)
    rates = [r["samples_per_sec"] for r in records if r["kind"] == "train"][1:]
    if not rates:
        sys.exit("error: too few log records; raise --max_steps or lower --log_every")
    return {**next(r for r in records if r["kind"] == "memory"), "samples_per_sec": statistics.median(rates)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="processes of the parallel layouts")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train_mp.py arguments")
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"] or [
        "--config", "vit_quickstart", "--max_steps", "12", "--log_every", "3", "--num_workers", "0"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if "--data_dir" not in train_args:
            from datasets.make_synthetic_era5 import make_synthetic_era5

            make_synthetic_era5(tmp / "data", samples_per_year=40, height=33, width=64, seed=0,
                                train_years=(2008,), valid_years=(2015,), channels="nersc20", hours_per_step=6,
                                stats=True, progress=False)
            train_args += ["--data_dir", str(tmp / "data")]
        results = [(name, run(n, [*train_args, *options], tmp / f"run{i}"))
                   for i, (name, n, options) in enumerate(layouts(args.nproc))]
    base = results[0][1]
    shown = [a for a in train_args if not a.startswith(str(tmp))]
    if "--data_dir" in shown and shown.index("--data_dir") == len(shown) - 1:
        shown = shown[:-1] + ["(synthetic 32x64, generated)"]
    print(f"train_mp.py {' '.join(shown)}; batch per rank: global batch / dp")
    print("MB per rank (largest rank; 1e6 bytes)   params    grads  optimizer  activations    total  "
          "vs 1 proc  samples/s  vs 1 proc")
    for name, r in results:
        total = r["total_mb"] + r["activations_mb"]
        base_total = base["total_mb"] + base["activations_mb"]
        print(f"{name:<40}{r['params_mb']:>8.2f} {r['grads_mb']:>8.2f} {r['optimizer_mb']:>10.2f} "
              f"{r['activations_mb']:>12.2f} {total:>8.2f} {total / base_total:>10.2f} "
              f"{r['samples_per_sec']:>10.2f} {r['samples_per_sec'] / base['samples_per_sec']:>10.2f}")


if __name__ == "__main__":
    main()
