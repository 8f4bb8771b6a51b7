"""The memory the estimate (utils/memory/estimate.py, which plan.py ranks layouts by) predicts for a run, next to
the `memory` record the run measured: tests/test_mp.py and tests/test_pp.py hold their runs to it; tests/test_fsdp.py
the traced estimate too (utils/memory/traced.py)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import read_metrics
from utils.config import parse_config
from utils.memory.estimate import estimate_memory
from utils.memory.traced import estimate_traced


def predicted_and_measured(run_dir: Path, argv: list[str], world_size: int,
                           traced: bool = False) -> dict[str, tuple[float, float]]:
    """{"states": (predicted, measured) MB of parameters + gradients + AdamW state, "activations": (...)} of the
    largest rank, for a run of train_mp.py / train_pp.py with ``argv`` on ``world_size`` CPU processes (``traced``:
    of the traced estimate, for a train_fsdp.py run)."""
    record = next(r for r in read_metrics(run_dir) if r["kind"] == "memory")
    cfg = parse_config(argv=argv)
    estimate = (estimate_traced if traced else estimate_memory)(cfg, world_size, "fsdp", device_type="cpu")
    ranks = estimate.setting.get("pp_ranks")
    if ranks:  # the record: the largest rank of each column
        states, activations = (max(r[key] for r in ranks) * 1e3 for key in ("states_gb", "activations_gb"))
    else:  # train_mp.py counts the model's forward only: its loss runs outside the counter
        states = estimate.setting["states_gb"] * 1e3
        activations = (estimate.activations - estimate.activations_by_part.get("loss", 0.0)) / 1e6
    pairs = {"states": (states, record["total_mb"])}
    if "activations_mb" in record:  # (train_fsdp.py's record has none)
        pairs["activations"] = (activations, record["activations_mb"])
    return pairs


def assert_within(run_dir: Path, argv: list[str], world_size: int, rel: float = 0.10, traced: bool = False) -> dict:
    """Each predicted column within ``rel`` of the measured one (the issue's 10 %)."""
    pairs = predicted_and_measured(run_dir, argv, world_size, traced)
    for name, (predicted, measured) in pairs.items():
        assert abs(predicted / measured - 1) <= rel, f"{name}: predicted {predicted:.3f} MB, measured {measured:.3f} MB"
    return pairs
