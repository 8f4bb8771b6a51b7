"""python tests/same_checkpoints.py RUN_A RUN_B: do two runs end in the same bits?

The newest checkpoint of each run folder — a train.py / train_ddp.py file, or a train_fsdp.py DCP folder, exported to
one file first (utils/checkpoint/sharded.py) — compared entry by entry: the step, the weights, AdamW's state, the
schedule, the grad scaler and every RNG state must be equal to the bit (the configs, which name their run folders,
are not compared). Prints one line and exits 0 if they are, else 1 naming the first entry that differs; 2 for a
folder without a checkpoint. make test-libraries compares a run resumed half-way with an uninterrupted one so
(tests/libraries.py).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from utils.checkpoint.files import checkpoints_by_step, latest_checkpoint  # noqa: E402
from utils.checkpoint.sharded import export_full_state_dict  # noqa: E402
from utils.checkpoint.single import load_checkpoint  # noqa: E402

COMPARED = ("train_state", "model", "optimizer", "scheduler", "scaler", "rng")


def newest(run: Path, scratch: Path) -> dict:
    """The newest checkpoint of ``run`` as train.py's payload (a DCP folder exported into ``scratch``)."""
    folder = run / "checkpoints"
    sharded = checkpoints_by_step(folder, sharded=True)
    path = export_full_state_dict(sharded[-1][1], scratch / f"{run.name}.pt") if sharded else latest_checkpoint(folder)
    if path is None:
        raise SystemExit(f"error: {folder} holds no checkpoint")
    return load_checkpoint(path)


def first_difference(a: Any, b: Any, where: str) -> Optional[str]:
    """Where ``a`` and ``b`` first differ (tensors by dtype, shape and bits), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return None if same else where
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{where} (keys: {sorted(map(str, a.keys() ^ b.keys()))[:3]})"
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{where}.{k}"))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{where} (lengths {len(a)} and {len(b)})"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{where}[{i}]"))), None)
    return None if a == b else where


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    runs = [Path(arg) for arg in argv]
    with tempfile.TemporaryDirectory() as scratch:
        first, second = (newest(run, Path(scratch) / str(i)) for i, run in enumerate(runs))
    difference = next((d for key in COMPARED if (d := first_difference(first.get(key), second.get(key), key))), None)
    step = first["train_state"]["step"]
    if difference:
        print(f"differ: {runs[0]} and {runs[1]} at {difference} (newest checkpoints: steps {step} and "
              f"{second['train_state']['step']})")
        return 1
    print(f"same bits: {runs[0]} and {runs[1]} at step {step} ({', '.join(COMPARED)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
