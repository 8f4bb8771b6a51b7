"""plan.py's prediction next to published GPU figures (NERSC's ViT and U-Net tutorials, NREL's SwinIR tutorial).

    python benchmarks/plan_vs_published.py            # the table of benchmarks/README.md, in seconds on a CPU

Each row takes the configuration of a published figure (model size, global batch, precision, GPUs, layout),
plans it with utils/plan (the same code as plan.py) on the cluster the figure was measured on, and prints the
predicted GB per GPU and samples/s beside the published ones, with the ratio. Published memory is what
nvidia-smi showed (the CUDA context and the allocator's cache included, which the estimate leaves out), except
where the row says "allocated after forward" (NERSC SC24/SC25's log line, in GiB: parameters, AdamW state and
activations, no gradients yet): there ours is the same sum, in GiB, and the ratio adds to ours the "scaffolding
memory high watermark" their log prints before the first step (10.2-10.5 GiB, SC24's runs; not known for SC25's).
Each comparison has a role: "calibration" where the compute model's constants were derived from the same figure
(config/clusters/clusters.yaml): its ratio is near 1 by construction and checks nothing; "counted", a prediction;
"not comp.", where the publication holds a fact the model cannot represent (listed under the table, by name).
The last line is the mean absolute error of speed and of memory over the counted comparisons.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from utils.config import build_config  # noqa: E402
from utils.layouts.accepted import Layout  # noqa: E402
from utils.plan.clusters import load_cluster  # noqa: E402
from utils.plan.planner import Row, plan_layout  # noqa: E402

A100_40, A100_80, H100 = "perlmutter-a100-40", "perlmutter-a100-80", "kestrel-h100"


COUNTED, CALIBRATION = "counted", "calibration"


@dataclasses.dataclass
class Figure:
    """A published figure, the layout it ran, and the role of each of its two comparisons: COUNTED (a prediction:
    in the mean error), CALIBRATION (the model's constants came from it: ratio 1 by construction), or the published
    fact the model cannot represent (not comparable: shown, not counted)."""

    label: str
    source: str
    config: str
    overrides: dict
    cluster: str
    gpus: int
    pick: Callable[[int, int], Layout]  # (GPUs, global batch) -> the layout the publication ran
    gb: Optional[tuple[float, float]] = None  # published range; (inf, inf): out of memory
    samples: Optional[tuple[float, float]] = None
    note: str = ""
    after_forward: bool = False  # theirs: memory allocated after the forward pass (parameters, AdamW, activations)
    scaffolding: float = 0.0  # GiB their log reports allocated before the first step (set-up): left out of theirs
    gb_role: str = COUNTED
    speed_role: str = COUNTED


SCRIPTS = {"none": "train.py", "ddp": "train_ddp.py", "mp": "train_mp.py"}


def layout(strategy: str, precision: str = "bf16", ac: str = "none", tp: int = 1, cp: int = 1) -> Callable:
    """The publication's layout in full: NERSC's tp and cp run DDP over dp, and their tp keeps the residual stream
    and the LayerNorms whole on every tp rank (no sequence parallelism)."""
    return lambda gpus, batch: Layout(SCRIPTS[strategy], strategy, gpus, tp=tp, cp=cp, ac=ac, precision=precision,
                                      batch_size=batch, ddp_beside_mp=strategy == "mp", sequence_parallel=tp == 1)


OOM = (float("inf"), float("inf"))
E1024 = {"model_args.embed_dim": 1024}
NO_SETUP = "SC25's set-up memory is not stated (SC24's: 10.2 of 33.2 GiB)"
ORIGINAL_CODE = "theirs the original SwinIR code (explicit attention, its matrices saved)"
FIGURES = [
    Figure("ViT embed 1536, DP 4, 16/GPU", "NERSC SC23/DL4SCI25", "vit_mp", {}, A100_40, 4, layout("ddp"), OOM),
    Figure("ViT embed 1536, DP 4, 16/GPU", "NERSC SC23/DL4SCI25", "vit_mp", {}, A100_80, 4, layout("ddp"),
           (53, 54), (46, 51)),
    Figure("ViT embed 1536, TP 4 x DP 4", "NERSC SC23/DL4SCI25", "vit_mp", {}, A100_40, 16, layout("mp", tp=4),
           (36, 39), (61, 72), "theirs: DDP over dp, no sequence parallelism (so ours)"),
    Figure("ViT embed 1024, DP 4, 16/GPU", "NERSC SC24", "vit_mp", E1024, A100_80, 4, layout("ddp"),
           (44.9, 44.9), (93, 93), "theirs: allocated after forward (GiB), 10.5 of it set-up: added to ours",
           after_forward=True, scaffolding=10.48),
    Figure("ViT embed 1024, TP 4 x DP 4", "NERSC SC24", "vit_mp", E1024, A100_80, 16,
           layout("mp", tp=4), (33.2, 33.2), (125, 125), "as above (10.2 set-up); DDP over dp, no SP",
           after_forward=True, scaffolding=10.18),
    Figure("ViT embed 1024, TP 4 x DP 4", "NERSC SC25", "vit_mp", E1024, A100_40, 16,
           layout("mp", tp=4), (29.3, 29.3), (126, 126), "DDP over dp, no SP", after_forward=True,
           gb_role=NO_SETUP),
    Figure("ViT embed 1024, CP 4 x DP 4", "NERSC SC25", "vit_mp", E1024, A100_40, 16,
           layout("mp", cp=4), (26.6, 26.6), (166, 166), "DDP over dp; K/V all-gathered as ours", after_forward=True,
           gb_role=NO_SETUP),
    Figure("ViT base, DP 4, batch 64", "NERSC SC23 scaling", "vit_base", {"amp_dtype": "bf16", "batch_size": 64},
           A100_40, 4, layout("ddp"), None, (204, 204)),
    Figure("ViT base, DP 64, batch 1024", "NERSC SC23 scaling", "vit_base", {"amp_dtype": "bf16", "batch_size": 1024},
           A100_40, 64, layout("ddp"), None, (2550, 2550)),
    Figure("ViT base, 1 GPU, fp32", "NERSC SC23 ladder", "vit_base", {}, A100_40, 1, layout("none", "fp32"),
           None, (8.8, 12), speed_role="theirs input-bound (8.8 -> 12 with 8 data workers): the model has no input "
           "pipeline"),
    Figure("ViT base, 1 GPU, bf16", "NERSC SC25 ladder", "vit_base", {"amp_dtype": "bf16"}, A100_40, 1,
           layout("none"), None, (54, 54), speed_role=CALIBRATION),
    Figure("SwinIR 720x1440, batch 1, fp32", "NREL tutorial", "full_size", {}, H100, 1, layout("none", "fp32"), OOM),
    Figure("SwinIR 720x1440, batch 1, AMP", "NREL tutorial", "full_size", {"amp_dtype": "bf16"}, H100, 1,
           layout("none"), (70, 70), None, gb_role=ORIGINAL_CODE),
    Figure("SwinIR 720x1440, AMP + AC", "NREL tutorial", "full_size", {"amp_dtype": "bf16"}, H100, 1,
           layout("none", ac="block"), (12, 12), None, gb_role=ORIGINAL_CODE),
    Figure("U-Net 64^3, batch 64, fp32", "NERSC SC22", "unet3d_base", {}, A100_40, 1, layout("none", "fp32"),
           None, (577, 579), "theirs with DALI (85 without: input-bound)", speed_role=CALIBRATION),
    Figure("U-Net 64^3, batch 64, AMP", "NERSC SC22", "unet3d_base", {}, A100_40, 1, layout("none"), None,
           (774, 779), "theirs fp16 AMP (bf16 has the same peak)", speed_role=CALIBRATION),
]


def predicted(figure: Figure) -> Row:
    """plan.py's model of the figure's own layout (utils/plan/planner.py: plan_layout)."""
    cluster = load_cluster(figure.cluster)
    per_node = min(figure.gpus, cluster.gpus_per_node)
    cluster = dataclasses.replace(cluster, gpus_per_node=per_node)
    cfg = build_config(figure.config, figure.overrides)
    return plan_layout(cfg, cluster, figure.gpus // per_node, figure.pick(figure.gpus, cfg.train.batch_size))


def compared(published: Optional[tuple[float, float]], value: float, capacity: float = 0.0):
    """(published column, ratio column, ratio or None): a range, 'OOM' (and whether ours says so too), or '-'."""
    if published is None:
        return "-", "-", None
    if published == OOM:
        return "OOM", "agrees" if value > capacity else "DISAGREES", None
    low, high = published
    ratio = value / ((low + high) / 2)
    return (f"{low:g}" if low == high else f"{low:g}-{high:g}"), f"{ratio:.2f}", ratio


def role(given: str, ratio: Optional[float]) -> str:
    """The short label of a comparison: counted, calibration, not comparable, or nothing (no ratio)."""
    if ratio is None:
        return ""
    return given if given in (COUNTED, CALIBRATION) else "not comp."


def main() -> int:
    print(f"{'figure':<30} {'source':<19} {'GPUs':>4} {'GB pub.':>7} {'ours':>6} {'ratio':>7} {'role':<10} "
          f"{'samples/s pub.':>14} {'ours':>7} {'ratio':>6} {'role':<11} note")
    errors: dict[str, list[float]] = {"speed": [], "memory": []}
    facts = []
    for figure in FIGURES:
        row = predicted(figure)
        e = row.estimate
        gb = (e.params + e.optimizer + e.activations) / 2**30 if figure.after_forward else row.gb
        gb_pub, gb_text, gb_ratio = compared(figure.gb, gb + figure.scaffolding, row.memory_bytes / 1e9)
        sp_pub, sp_text, sp_ratio = compared(figure.samples, row.speed.samples_per_sec)
        roles = role(figure.gb_role, gb_ratio), role(figure.speed_role, sp_ratio)
        for what, ratio, given in (("memory", gb_ratio, figure.gb_role), ("speed", sp_ratio, figure.speed_role)):
            if ratio is not None and given == COUNTED:
                errors[what].append(abs(ratio - 1))
            elif ratio is not None and given != CALIBRATION:
                facts.append(f"  {figure.label} ({figure.source}), {what}: {given}")
        print(f"{figure.label:<30} {figure.source:<19} {figure.gpus:>4} {gb_pub:>7} {gb:>6.1f} {gb_text:>7} "
              f"{roles[0]:<10} {sp_pub:>14} {row.speed.samples_per_sec:>7.1f} {sp_text:>6} {roles[1]:<11} "
              f"{figure.note}")
    print("not comparable (shown, not counted):\n" + "\n".join(facts))
    print("mean absolute error over the counted rows: " + ", ".join(
        f"{what} {100 * sum(v) / len(v):.0f} % ({len(v)} rows)" for what, v in errors.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
