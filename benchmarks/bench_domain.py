"""Activation memory per rank and step time of SwinIR with each field split into cp bands (train_mp.py --cp).

    python benchmarks/bench_domain.py                             # quickstart's 180x360 fields, cp 1, 2, 4 on CPU
    python benchmarks/bench_domain.py --cp 1 2 4 -- --config full_size --ac block --amp_dtype bf16   # a 4-GPU node

One train_mp.py launch per cp (cp processes, dp 1: every rank holds a band of the same samples), at a
fixed field size. Printed per cp: the bytes the largest band saved for backward in one step (the
memory record) and estimate_memory.py's prediction of it, the scaling memory(cp=1) / memory(cp=N) against the ideal N (the issue's goal: at least
0.8 N), parameters + gradients + AdamW state per rank (FSDP2 shards them over the cp ranks), and the
median samples/s after the first log window (each sample computed by all cp ranks together). Arguments after `--` go to train_mp.py; without
--data_dir, a synthetic data set of 181x360 fields (quickstart's) is generated in a temporary folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_mp import run  # noqa: E402
from utils.config import parse_config  # noqa: E402
from utils.memory.estimate import estimate_memory  # noqa: E402


def estimated_mb(train_args: list[str], cp: int) -> float:
    """estimate_memory.py's activations of the largest band (the field's size read from the data, as it does)."""
    cfg = parse_config(argv=[*train_args, "--cp", str(cp)])
    return estimate_memory(cfg, world_size=cp, strategy="fsdp").activations / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="bands per field, one launch each")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train_mp.py arguments")
    args = parser.parse_args()
    train_args = [a for a in args.train_args if a != "--"] or [
        "--config", "quickstart", "--max_steps", "8", "--log_every", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shown = list(train_args)
        if "--data_dir" not in train_args:
            from datasets.make_synthetic_era5 import make_synthetic_era5

            make_synthetic_era5(tmp / "data", samples_per_year=8, height=181, width=360, seed=0,
                                train_years=(2008,), valid_years=(2015,), progress=False)
            train_args += ["--data_dir", str(tmp / "data"), "--crop_size", "0"]
            shown += ["(synthetic 180x360 fields, generated)"]
        results = [(cp, run(cp, [*train_args, "--cp", str(cp)], tmp / f"cp{cp}")) for cp in args.cp]
        estimates = [estimated_mb(train_args, cp) for cp in args.cp]
    base = results[0][1]
    print(f"train_mp.py {' '.join(shown)}: each field in cp bands, dp 1; MB = 1e6 bytes, of the largest rank")
    print(f"{'cp':>3} {'activations MB':>15} {'estimated':>10} {'memory(cp=' + str(results[0][0]) + ')/memory':>20} {'ideal':>6} "
          f"{'of ideal':>9} {'params+grads+AdamW MB':>22} {'samples/s':>10} {'vs cp=' + str(results[0][0]):>8}")
    for (cp, r), estimate in zip(results, estimates):
        ratio, ideal = base["activations_mb"] / r["activations_mb"], cp / results[0][0]
        print(f"{cp:>3} {r['activations_mb']:>15.1f} {estimate:>10.1f} {ratio:>20.2f} {ideal:>6.0f} {ratio / ideal:>9.2f} "
              f"{r['total_mb']:>22.2f} {r['samples_per_sec']:>10.2f} {r['samples_per_sec'] / base['samples_per_sec']:>8.2f}")


if __name__ == "__main__":
    main()
