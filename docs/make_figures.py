"""The tutorial's teaching pictures, drawn with matplotlib (no pyplot: no global figure state).

    python docs/make_figures.py                                          # (a), (b) and (d)
    python docs/make_figures.py --metrics runs/quickstart/metrics.jsonl  # also (c), from a quickstart run

(a) docs/parallelism.png: what each rank holds under DDP, FSDP and HSDP (parameters, gradients,
    optimizer state, in slices of the model) and the collectives each uses;
(b) docs/launch_tree.png: sbatch -> srun (one task per node) -> torchrun (one per node) -> ranks,
    with RANK, LOCAL_RANK and WORLD_SIZE for 2 nodes x 4 GPUs;
(d) docs/layers.png: the layers of utils/ as .importlinter states them (imports only go down), with the
    scripts above and models/ beside;
(c) docs/quickstart_rmse.png: the quickstart's validation RMSE per channel against bicubic
    interpolation's over training, and the training loss, from a run's metrics.jsonl.
"""

from __future__ import annotations

import argparse
import configparser
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

DOCS = Path(__file__).resolve().parent
STATE = (("parameters", "#4C72B0"), ("gradients", "#DD8452"), ("optimizer state (AdamW m, v)", "#55A868"))
SLICES = 4  # the model drawn as 4 slices, one per rank under FSDP


def _held_slices(strategy: str, rank: int) -> list[int]:
    """Which of the model's SLICES a rank keeps between steps."""
    if strategy == "DDP":
        return list(range(SLICES))
    if strategy == "FSDP":
        return [rank]
    shard = rank % 2  # HSDP 2 x 2: ranks 0, 1 are node 0 (one shard group), 2, 3 node 1
    return [2 * shard, 2 * shard + 1]


def _rank_column(ax, x: float, strategy: str, rank: int) -> None:
    """One rank: a box with a bar per kind of state, filled where the rank holds that slice."""
    width, bar_h = 0.84, 0.34
    ax.add_patch(FancyBboxPatch((x + 0.03, 0.55), width + 0.1, 2.25, boxstyle="round,pad=0.02,rounding_size=0.06",
                                facecolor="#F7F7F7", edgecolor="#999999", linewidth=0.8))
    ax.text(x + 0.08 + width / 2, 2.63, f"rank {rank}", ha="center", va="center", fontsize=10, fontweight="bold")
    held = _held_slices(strategy, rank)
    for row, (_, colour) in enumerate(STATE):
        y = 2.05 - row * 0.55
        for s in range(SLICES):
            filled = s in held
            ax.add_patch(Rectangle((x + 0.08 + s * width / SLICES, y), width / SLICES, bar_h,
                                   facecolor=colour if filled else "white", edgecolor=colour,
                                   linewidth=1.0, alpha=1.0 if filled else 0.6))
    share = len(held) / SLICES
    ax.text(x + 0.08 + width / 2, 0.7, f"holds {share:.0%}", ha="center", va="center", fontsize=9)


def _bracket(ax, x0: float, x1: float, y: float, label: str, colour: str) -> None:
    ax.plot([x0, x0, x1, x1], [y + 0.1, y, y, y + 0.1], color=colour, linewidth=1.6, solid_capstyle="round")
    ax.text((x0 + x1) / 2, y - 0.12, label, ha="center", va="top", fontsize=9, color=colour)


def parallelism_figure() -> Figure:
    """(a) Who holds what under DDP, FSDP and HSDP on 4 ranks, and which collectives move it."""
    fig = Figure(figsize=(15, 5.6), layout="constrained")
    axes = fig.subplots(1, 3)
    captions = {
        "DDP": "every rank: a full copy of everything",
        "FSDP": "every rank: 1/4 of everything (ZeRO-3)",
        "HSDP": "2 replicas x 2 shards: 1/2 per rank",
    }
    for ax, strategy in zip(axes, ("DDP", "FSDP", "HSDP")):
        ax.set_xlim(-0.05, 4.05)
        ax.set_ylim(-1.75, 3.25)
        ax.axis("off")
        ax.set_title(f"{strategy}: {captions[strategy]}", fontsize=11.5)
        if strategy == "HSDP":  # a node = a shard group
            for node, x in enumerate((0.0, 2.0)):
                ax.add_patch(FancyBboxPatch((x + 0.04, 0.45), 1.92, 2.5, boxstyle="round,pad=0.02",
                                            facecolor="none", edgecolor="#8172B3", linewidth=1.4, linestyle="--"))
                ax.text(x + 1.0, 3.13, f"node {node} = shard group {node}", ha="center", va="center",
                        fontsize=9, color="#8172B3")
        for rank in range(4):
            _rank_column(ax, rank, strategy, rank)
        red, grey = "#C44E52", "#555555"
        if strategy == "DDP":
            _bracket(ax, 0.5, 3.5, 0.25, "all-reduce of the gradients\n(in buckets, overlapped with backward)", red)
        elif strategy == "FSDP":
            _bracket(ax, 0.5, 3.5, 0.25, "all-gather parameters of one unit\n(before its forward and again in backward)",
                     grey)
            _bracket(ax, 0.5, 3.5, -0.75, "reduce-scatter of the gradients (backward):\neach rank receives the sum for its own slice",
                     red)
        else:
            for x0 in (0.5, 2.5):
                _bracket(ax, x0, x0 + 1.0, 0.25, "all-gather +\nreduce-scatter\nwithin the node", grey)
            for k, (a, b) in enumerate(((0.5, 2.5), (1.5, 3.5))):
                y = -0.62 - 0.22 * k
                ax.add_patch(FancyArrowPatch((a, y), (b, y), arrowstyle="<->", mutation_scale=12, color=red,
                                             linewidth=1.4))
                ax.text(a - 0.06, y, f"{a - 0.5:.0f}", ha="right", va="center", fontsize=8, color=red)
                ax.text(b + 0.06, y, f"{b - 0.5:.0f}", ha="left", va="center", fontsize=8, color=red)
            ax.text(2.0, -1.2, "then all-reduce of the gradient shards across replicas\n(rank 0 <-> 2, rank 1 <-> 3: "
                    "the only traffic between nodes)", ha="center", va="top", fontsize=9, color=red)
    handles = [Rectangle((0, 0), 1, 1, facecolor=c, edgecolor=c) for _, c in STATE]
    handles.append(Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="#777777"))
    fig.legend(handles, [name for name, _ in STATE] + ["not kept (parameters: gathered one unit at a time)"], loc="outside lower center",
               ncol=4, fontsize=10, frameon=False,
               title="each bar = the model's state in 4 slices; filled = kept by this rank between steps",
               title_fontsize=10)
    return fig


def _box(ax, x: float, y: float, w: float, h: float, text: str, colour: str, fontsize: float = 9.5,
         mono: bool = False) -> None:
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=colour, edgecolor="#444444", linewidth=0.9))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, family="monospace" if mono else None)


def _arrow(ax, start: tuple[float, float], end: tuple[float, float], label: str = "") -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=13, color="#444444", linewidth=1.1))
    if label:
        ax.text((start[0] + end[0]) / 2 + 0.08, (start[1] + end[1]) / 2, label, ha="left", va="center",
                fontsize=8.5, color="#444444")


def launch_tree_figure(nodes: int = 2, gpus: int = 4) -> Figure:
    """(b) sbatch -> srun (one task per node) -> torchrun per node -> one rank per GPU."""
    fig = Figure(figsize=(15, 6.4), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 8.2)
    ax.axis("off")
    world = nodes * gpus
    _box(ax, 8, 7.55, 10.5, 0.75, "login node:  sbatch --nodes 2 submit_multinode.sh train_ddp.py --config baseline",
         "#E8E8E8", 10, mono=True)
    _box(ax, 8, 6.25, 10.5, 0.85, "submit_multinode.sh (runs once, on the first node of the allocation): picks the rendezvous "
         "host:port,\nthen  srun --ntasks-per-node 1 torchrun ...  ->  one torchrun per node", "#DCE6F2", 9.5)
    _arrow(ax, (8, 7.17), (8, 6.68))
    node_w = 7.3
    for node in range(nodes):
        cx = 4.0 + node * 8.0
        _arrow(ax, (8 + (node - 0.5) * 3.0, 5.82), (cx, 5.1), f"srun task {node}")
        _box(ax, cx, 4.7, node_w, 0.75, f"torchrun --nnodes {nodes} --nproc-per-node {gpus} --rdzv-backend c10d "
             f"--rdzv-endpoint <first node>:<port>\nnode rank {node} (handed out at the rendezvous), "
             f"starts {gpus} processes", "#E2F0D9", 9)
        for local in range(gpus):
            rank = node * gpus + local
            x = cx - node_w / 2 + node_w / gpus * (local + 0.5)
            _arrow(ax, (cx, 4.32), (x, 3.2))
            _box(ax, x, 2.45, node_w / gpus - 0.15, 1.45,
                 f"RANK={rank}\nLOCAL_RANK={local}\nWORLD_SIZE={world}\n-> cuda:{local}", "#FFF2CC", 9, mono=True)
        ax.add_patch(FancyBboxPatch((cx - node_w / 2 - 0.12, 1.55), node_w + 0.24, 3.65, boxstyle="round,pad=0.02",
                                    facecolor="none", edgecolor="#70AD47", linewidth=1.2, linestyle="--"))
    ax.text(8, 1.15, "LOCAL_RANK picks the GPU on the node (torch.cuda.set_device);  RANK picks the data shard "
            "(DistributedSampler) and who writes (rank 0);\nWORLD_SIZE = nodes x processes per node divides the "
            "global batch (--batch_size 64: 8 samples per GPU).  utils/parallel/distributed.py reads them all.",
            ha="center", va="top", fontsize=9.5)
    return fig


def import_layers(config: Path = DOCS.parent / ".importlinter") -> list[list[str]]:
    """The layers contract of ``config``, top layer first; each layer the packages or modules side by side."""
    parser = configparser.ConfigParser()
    parser.read(config)
    contract = next(section for section in parser.sections() if parser[section].get("type") == "layers")
    return [[name.strip() for name in line.split("|")] for line in parser[contract]["layers"].split("\n") if line.strip()]


def _contents(module: str) -> str:
    """A package's modules (first lines of a box), or a module's file name."""
    path = DOCS.parent / module.replace(".", "/")
    if path.is_dir():
        names = sorted(p.stem for p in path.glob("*.py") if p.stem != "__init__")
        return f"{module.replace('.', '/')}/\n" + ", ".join(names)
    return f"{module.replace('.', '/')}.py"


def layers_figure() -> Figure:
    """(d) utils/ in layers, top to bottom, as .importlinter has them; each imports only from those below."""
    layers = import_layers()
    fig = Figure(figsize=(13, 1.2 * len(layers) + 2.4), layout="constrained")
    ax = fig.subplots()
    height = len(layers) + 2
    ax.set_xlim(0, 13)
    ax.set_ylim(0, height)
    ax.axis("off")
    _box(ax, 5, height - 0.6, 9.4, 0.6, "train*.py, estimate_memory.py, rollout.py, comm_check.py, benchmarks/ (scripts)",
         "#E8E8E8", 9.5)
    for row, layer in enumerate(layers):
        y = height - 1.6 - row
        width = 9.4 / len(layer)
        for col, module in enumerate(layer):
            _box(ax, 0.3 + width * (col + 0.5), y, width - 0.2, 0.78, _contents(module), "#DCE6F2", 8.5)
        _arrow(ax, (9.9, y + 0.75), (9.9, y + 0.25))
    ax.text(10.15, height - 1.6, "imports go down only\n(|: side by side,\nneither imports the other)", fontsize=9,
            va="center")
    _box(ax, 11.6, 1.2, 2.4, 1.4, "models/\nswinir, vit, unet3d\n(import nothing\nfrom utils/)", "#E2F0D9", 9)
    ax.text(5, 0.25, "Checked by `lint-imports` in make test (.importlinter); the model-specific rows of every "
            "technique live in utils/parallel/plans.py.", ha="center", fontsize=9)
    return fig


def run_channel_names(metrics: Path) -> list[str]:
    """The channel names in the config of the run's latest checkpoint (metrics.jsonl does not repeat them)."""
    sys.path.insert(0, str(DOCS.parent))
    try:
        from utils.checkpoint import latest_checkpoint, load_checkpoint

        newest = latest_checkpoint(metrics.parent / "checkpoints")
        return list(load_checkpoint(newest)["config"].get("channel_names") or []) if newest else []
    except Exception:  # noqa: BLE001 -- a picture without names is still a picture
        return []


def quickstart_rmse_figure(records: list[dict], source: str, channel_names: list[str] | None = None) -> Figure:
    """(c) Validation RMSE of the model against bicubic's per channel over training, and the training loss."""
    val = [r for r in records if r.get("kind") == "val"]
    train = [r for r in records if r.get("kind") == "train"]
    if not val:
        raise ValueError(f"{source}: no validation records (kind 'val')")
    names = channel_names or [f"channel {c}" for c in range(len(val[0]["rmse"]))]
    fig = Figure(figsize=(4.0 * (len(names) + 1), 3.9), layout="constrained")
    axes = fig.subplots(1, len(names) + 1)
    steps = [r["step"] for r in val]
    for c, (ax, name) in enumerate(zip(axes, names)):
        model = [r["rmse"][c] for r in val]
        bicubic = [r["bicubic_rmse"][c] for r in val]
        ax.plot(steps, bicubic, "--", color="#777777", label="bicubic interpolation")
        ax.plot(steps, model, "o-", color="#C44E52", label="model (SwinIR)")
        ax.set_title(name, fontsize=10.5)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        last = model[-1] / bicubic[-1] - 1
        ax.text(0.97, 0.96, f"step {steps[-1]}: {last:+.1%} vs bicubic", transform=ax.transAxes, ha="right",
                va="top", fontsize=9.5, color="#C44E52")
        ax.set_xlim(0, steps[-1] * 1.04)
    axes[0].set_ylabel("validation RMSE (physical units)")
    axes[0].legend(fontsize=8.5, loc="center right")
    ax = axes[-1]
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], color="#4C72B0")
    ax.set_title("training loss (L1, physical units)", fontsize=10.5)
    ax.set_xlabel("training step")
    ax.set_xlim(0, steps[-1] * 1.04)
    ax.grid(alpha=0.3)
    fig.suptitle("quickstart: validation RMSE of the model and of bicubic interpolation of the same inputs "
                 "(lower is better)", fontsize=11)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", type=Path, help="a quickstart run's metrics.jsonl: also draw (c)")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the PNGs")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    figures = {"parallelism.png": parallelism_figure(), "launch_tree.png": launch_tree_figure(),
               "layers.png": layers_figure()}
    if args.metrics:
        try:
            records = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
            figures["quickstart_rmse.png"] = quickstart_rmse_figure(records, str(args.metrics),
                                                                    run_channel_names(args.metrics))
        except (OSError, ValueError, KeyError) as error:
            print(f"error: {args.metrics}: {error}", file=sys.stderr)
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    for name, fig in figures.items():
        fig.savefig(args.out / name, format="png", dpi=args.dpi)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
