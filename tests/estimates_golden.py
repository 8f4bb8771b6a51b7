"""The memory estimate and the plan of every named config, recorded (tests/golden/estimates.json), so that a change
in how the models are described — a refactor that should change nothing — shows up as numbers that moved.

    python -m tests.estimates_golden --write    # record them again, after a change that should move them
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from utils.config import ConfigError, build_config, load_named_configs
from utils.memory.estimate import estimate_memory
from utils.plan.clusters import load_cluster
from utils.plan.planner import plan

GOLDEN = Path(__file__).parent / "golden" / "estimates.json"
VARIANTS = ({}, {"amp_dtype": "bf16"}, {"amp_dtype": "bf16", "ac": "block"})
LAYOUTS = ((1, "none"), (4, "ddp"), (4, "fsdp"))
PLAN_ON = ("perlmutter-a100-80", 2)  # a named cluster: no measurement of this machine enters the plan
# Planned: one config per kind of model and task (each plan counts its model's FLOPs, 0.1-1.5 s); the others share
# these models and differ in what the estimates above already cover.
PLANNED = ("baseline", "full_size", "quickstart", "vit_base", "vit_tcwv_quickstart", "unet3d_base")
ERA5_FIELD = (720, 1440)  # the super-resolution configs' whole field, whatever data this checkout holds
NO_DATA = {"data_dir": "/nonexistent/estimates_golden"}  # the plan reads a grid from data it finds: let it find none


def rounded(value):
    """Floats to 9 significant digits (what a refactor must keep), recursively."""
    if isinstance(value, float):
        return float(f"{value:.9g}") if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


def figures() -> dict:
    """{what: numbers} for every named config: the estimate under each variant, layout and device, and the plan."""
    out = {}
    for name in sorted(load_named_configs()):
        base = build_config(name)
        field = ERA5_FIELD if base.data.task == "sr" else None
        for variant in VARIANTS:
            for world, strategy in LAYOUTS:  # each rank takes the config's batch
                cfg = build_config(name, {**NO_DATA, **variant, "batch_size": base.train.batch_size * world})
                for device in ("cuda", "cpu"):
                    key = f"{name} {json.dumps(variant, sort_keys=True)} {strategy} x{world} {device}"
                    try:
                        out[key] = rounded(estimate_memory(cfg, world, strategy, device_type=device,
                                                           field=field).to_json())
                    except ConfigError as error:  # a refusal is a figure too
                        out[key] = f"refused: {error}"
        if name not in PLANNED:
            continue
        rows = plan(build_config(name, dict(NO_DATA)), load_cluster(PLAN_ON[0]), PLAN_ON[1])
        out[f"{name} plan on {PLAN_ON[0]} x{PLAN_ON[1]}"] = rounded([
            [r.layout.name(), r.layout.precision, r.layout.ac, r.gb, r.speed.samples_per_sec] for r in rows])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the figures in tests/golden/estimates.json")
    args = parser.parse_args(argv)
    now = figures()
    if args.write:
        GOLDEN.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(now)} figures to {GOLDEN}")
        return 0
    recorded = json.loads(GOLDEN.read_text())
    moved = sorted(k for k in now.keys() | recorded.keys() if now.get(k) != recorded.get(k))
    print(f"{len(moved)} of {len(now)} figures moved" + "".join(f"\n  {k}" for k in moved[:20]))
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
