"""The tutorial's teaching pictures, drawn with matplotlib (no pyplot: no global figure state).

    python docs/make_figures.py                                          # (a), (b), (d), (e), (f) and (h)
    python docs/make_figures.py --metrics runs/quickstart/metrics.jsonl  # also (c), from a quickstart run

(a) docs/parallelism.png: what each rank holds under DDP, FSDP and HSDP (parameters, gradients,
    optimizer state, in slices of the model) and the collectives each uses;
(b) docs/launch_tree.png: sbatch -> srun (one task per node) -> torchrun (one per node) -> ranks,
    with RANK, LOCAL_RANK and WORLD_SIZE for 2 nodes x 4 GPUs;
(d) docs/layers.png: the layers of utils/ as .importlinter states them (imports only go down), with the
    scripts above and models/ beside;
(e) docs/mesh.png: Step 6's device mesh, 2 nodes x 4 GPUs with --tp 2 --cp 2: which ranks share what;
(f) docs/bands.png: Step 8's bands of one field over 4 ranks, the halo rows and the shifted windows' ring;
(h) docs/job_chain.png: one long run as one SLURM job that requeues itself, and what a cancel or a lost rank does;
(c) docs/quickstart_rmse.png: the quickstart's validation RMSE per channel against bicubic
    interpolation's over training, and the training loss, from a run's metrics.jsonl;
(g) docs/layout_drift.png (--drift A B): two runs of one config under two layouts (train.py and train_mp.py
    --cp 2): the training loss step by step and the validation RMSE.
"""

from __future__ import annotations

import argparse
import configparser
import json
import sys
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: the layouts come from its code
from utils.parallel.distributed import mp_mesh_layout  # noqa: E402
from utils.parallel.domain_parallel import band_bounds  # noqa: E402

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
    _box(ax, 11.6, 1.2, 2.4, 1.4, "models/\nspec; swinir/, vit/,\nunet3d/: network\n+ spec (nothing\nfrom utils/)", "#E2F0D9", 9)
    ax.text(5, 0.25, "Checked by `lint-imports` in make test (.importlinter); what is model-specific in a technique is "
            "the model's spec (models/spec.py; yours beside your model).", ha="center", fontsize=9)
    return fig


def run_channel_names(metrics: Path) -> list[str]:
    """The channel names in the config of the run's latest checkpoint (metrics.jsonl does not repeat them)."""
    sys.path.insert(0, str(DOCS.parent))
    try:
        from utils.checkpoint.files import latest_checkpoint
        from utils.checkpoint.single import load_checkpoint

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


MESH_COLOURS = {"tp": "#C44E52", "cp": "#4C72B0", "dp": "#55A868"}
MESH_MEANS = {"tp": "hold halves of every block's weights (all-gather / reduce-scatter in every layer)",
              "cp": "hold halves of the tokens: latitude bands (all-gather of keys and values per attention)",
              "dp": "read different samples (FSDP2 over dp x cp: gradients reduced once per step)"}


def mesh_groups(world: int, tp: int, cp: int, order: str = "tp-cp-dp") -> dict[str, list[list[int]]]:
    """Per mesh dimension, its groups of ranks, by train_mp.py's layout (utils.parallel.distributed.mp_mesh_layout)."""
    shape, names = mp_mesh_layout(world, tp, cp, order)
    ranks = np.arange(world).reshape(shape)
    return {name: np.moveaxis(ranks, axis, -1).reshape(-1, shape[axis]).tolist() for axis, name in enumerate(names)}


def mesh_figure(nodes: int = 2, gpus: int = 4, tp: int = 2, cp: int = 2) -> Figure:
    """(e) Step 6's mesh: 2 nodes x 4 GPUs with --tp 2 --cp 2; which ranks share what, one row per dimension."""
    world = nodes * gpus
    groups = mesh_groups(world, tp, cp)
    fig = Figure(figsize=(13, 5.2), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(-0.6, world + 4.4)
    ax.set_ylim(-0.4, 4.6)
    ax.axis("off")
    for node in range(nodes):
        ax.add_patch(FancyBboxPatch((node * gpus - 0.42, 3.35), gpus - 0.16, 1.05, boxstyle="round,pad=0.02",
                                    facecolor="none", edgecolor="#70AD47", linestyle="--", linewidth=1.2))
        ax.text(node * gpus + gpus / 2 - 0.5, 4.5, f"node {node} (NVLink inside)", ha="center", fontsize=9.5,
                color="#4F7F2F")
        for local in range(gpus):
            rank = node * gpus + local
            _box(ax, rank, 3.85, 0.7, 0.6, f"rank {rank}", "#FFF2CC", 9.5)
    for row, name in enumerate(("tp", "cp", "dp")):
        y = 2.6 - row * 1.05
        ax.text(-0.55, y, name, ha="left", va="center", fontsize=11, fontweight="bold", color=MESH_COLOURS[name])
        spans = [(min(g), max(g)) for g in groups[name]]
        overlap = any(a[0] < b[1] and b[0] < a[1] for a in spans for b in spans if a != b)
        for index, group in enumerate(groups[name]):
            offset = (index % 4 - 1.5) * 0.09 if overlap else 0.0  # groups that overlap in x: a line each
            ax.plot(group, [y + offset] * len(group), "-o", color=MESH_COLOURS[name], linewidth=2.2, markersize=7)
        ax.text(world - 0.2, y, f"{len(groups[name])} groups of {len(groups[name][0])}: "
                f"{' '.join('{' + ','.join(map(str, g)) + '}' for g in groups[name])}\n{MESH_MEANS[name]}",
                ha="left", va="center", fontsize=8.5)
    ax.text(world / 2 + 1.5, -0.25, "--tp 2 --cp 2 on 8 ranks, --parallel_order tp-cp-dp (fastest-varying first): "
            "tp pairs are neighbours inside a node; only dp crosses the network", ha="center", fontsize=9.5)
    return fig


def bands_figure(height: int = 90, width: int = 180, window: int = 8, cp: int = 4) -> Figure:
    """(f) Step 8's bands of a low-res field (quickstart: 90 x 180, window 8, cp 4), with halos and the ring
    that the shifted windows send, by utils.parallel.domain_parallel.band_bounds."""
    bounds = band_bounds(height, window, cp)
    padded = -(-height // window) * window  # SwinIR pads the field to whole windows: the last band holds the padding
    bounds[-1] = (bounds[-1][0], padded)
    shift = window // 2
    colours = ["#4C72B0", "#DD8452", "#55A868", "#8172B3"]
    fig = Figure(figsize=(12, 6.2), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(-30, width + 150)
    ax.set_ylim(padded + 6, -8)
    ax.axis("off")
    for rank, (start, stop) in enumerate(bounds):
        real = min(stop, height)
        ax.add_patch(Rectangle((0, start), width, real - start, facecolor=colours[rank], alpha=0.35, edgecolor="none"))
        if stop > height:
            ax.add_patch(Rectangle((0, height), width, stop - height, facecolor="white", edgecolor=colours[rank],
                                   hatch="///", linewidth=0.8))
            ax.text(width / 2, (height + stop) / 2, f"{stop - height} rows of reflect padding (whole windows)",
                    ha="center", va="center", fontsize=8.5)
        for halo in ((start - 1, start) if rank else ()), ((stop, stop + 1) if rank < cp - 1 else ()):
            if halo:
                ax.add_patch(Rectangle((0, halo[0]), width, 1, facecolor=colours[rank], edgecolor=colours[rank]))
        ax.text(-4, (start + stop) / 2, f"rank {rank}\nrows {start}-{stop - 1}", ha="right", va="center",
                fontsize=9, color=colours[rank], fontweight="bold")
        # The top rows that the shifted windows send to the band above (rank 0's around the ring, to rank 3).
        ax.add_patch(Rectangle((0, start), width, shift, facecolor="none", edgecolor=colours[rank], hatch="...",
                               linewidth=0))
        end = start - shift if rank else padded - shift / 2
        ax.add_patch(FancyArrowPatch((width + 4, start + shift / 2), (width + 4, end), arrowstyle="-|>",
                                     connectionstyle=f"arc3,rad={-0.3 if rank == 0 else 0}", mutation_scale=11,
                                     color=colours[rank], linewidth=1.5))
    for x in range(0, width + 1, window):
        ax.plot([x, x], [0, padded], color="white", linewidth=0.4)
    for y in range(0, padded + 1, window):
        ax.plot([0, width], [y, y], color="white", linewidth=0.4)
    ax.text(width + 50, padded * 0.45,
            "thin strips at each boundary: the halo, 1 row that every 3x3\nconvolution takes from each neighbour "
            "(and sends its\ngradient back in backward)\n\n"
            f"dotted rows and arrows: the shifted windows' ring: the top\n{shift} rows of each band move to the bottom "
            "of the band\nabove (rank 0's to rank 3) before each shifted\nattention, and back after it\n\n"
            f"white lines: the {window}x{window} windows; bands are whole\nrows of windows, the larger ones first",
            ha="left", va="center", fontsize=9)
    ax.set_title(f"one {height} x {width} low-res field (quickstart) in {cp} bands: train_mp.py --cp {cp}",
                 fontsize=11)
    return fig


def job_chain_figure() -> Figure:
    """(h) One long run as one SLURM job: segments that stop before their time limit and requeue themselves,
    and the paths of a cancelled job and of a lost rank."""
    fig = Figure(figsize=(15, 5.8), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 6.9)
    ax.axis("off")
    colours = {"run": "#DCE6F2", "stop": "#FCE4D6", "wait": "#EDEDED", "end": "#E2F0D9"}
    y = 4.9
    ax.text(0.1, 6.6, "sbatch submit_multinode.sh train_ddp.py ... (#SBATCH --requeue --signal=B:USR1@120 "
            "--open-mode=append): one job id, one log", fontsize=10, family="monospace")
    segments = [(0.1, 3.2, "segment 1: --resume auto\nfinds nothing: starts fresh"),
                (5.3, 3.2, "segment 2 (SLURM_RESTART_COUNT 1):\nresumes from step N"),
                (10.5, 3.2, "segment 3: resumes from\nstep M, reaches max_steps")]
    for index, (x, width, text) in enumerate(segments):
        _box(ax, x + width / 2, y, width, 0.8, text, colours["run"], 9)
        if index < 2:
            _box(ax, x + width + 0.45, y, 0.8, 0.8, "save\nexit 75", colours["stop"], 8.5)
            ax.annotate("SIGUSR1\n120 s before\nthe limit", (x + width, y + 0.42), (x + width - 0.2, y + 1.05),
                        fontsize=8, ha="center", arrowprops={"arrowstyle": "-|>", "color": "#C44E52"},
                        color="#C44E52")
            _box(ax, x + width + 1.45, y, 1.0, 0.8, "requeue:\npending", colours["wait"], 8.5)
            _arrow(ax, (x + width + 1.95, y), (x + width + 2.15, y))
    _box(ax, 14.6, y, 1.1, 0.8, "done:\nCOMPLETED", colours["end"], 9)
    _arrow(ax, (13.7, y), (14.05, y))
    ax.text(0.1, 3.75, "the job script traps SIGUSR1, sends the run SIGTERM (torchrun passes it on); the ranks agree at "
            "the next step boundary, save that step and exit 75; the script calls scontrol requeue (at most "
            "MAX_REQUEUES times)", fontsize=9)
    y2 = 2.55
    _box(ax, 1.9, y2, 3.6, 0.8, "scancel or preemption: SIGTERM", colours["stop"], 9)
    _arrow(ax, (3.7, y2), (4.3, y2))
    _box(ax, 6.6, y2, 4.4, 0.8, "save the step, exit 75: stopped, not requeued\n(sbatch it again: --resume auto)",
         colours["stop"], 9)
    y3 = 1.2
    _box(ax, 1.9, y3, 3.6, 0.8, "a rank dies (crash, OOM kill, lost node)", colours["stop"], 9)
    _arrow(ax, (3.7, y3), (4.3, y3))
    _box(ax, 6.6, y3, 4.4, 0.8, "torchrun --max-restarts: all workers start again\nfrom the newest checkpoint",
         colours["run"], 9)
    ax.text(9.1, y3, "(up to MAX_RESTARTS times; a worker that exits 2, 3 or 4 — bad input,\na diverged loss, "
            "a full disk — would fail again: not retried, the job ends)", fontsize=9, va="center")
    ax.text(0.1, 0.25, "Each recovery path continues to the weights of an uninterrupted run (tests/test_stop.py, "
            "tests/test_slurm.py); docs/part1-swinir.md, Long runs.", fontsize=9)
    return fig


def drift_figure(runs: dict[str, list[dict]]) -> Figure:
    """(g) Two layouts of the same run: the training loss at every logged step, how far apart the two are
    (relative difference), and the validation RMSE."""
    fig = Figure(figsize=(14, 4.2), layout="constrained")
    loss_ax, gap_ax, val_ax = fig.subplots(1, 3, width_ratios=(1.2, 1.2, 1))
    losses = []
    for (label, records), colour in zip(runs.items(), ("#4C72B0", "#DD8452")):
        train = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
        losses.append(train)
        loss_ax.plot(list(train), list(train.values()), color=colour, label=label, linewidth=1.2)
        val = [r for r in records if r["kind"] == "val"]
        mean_rmse = [sum(r["rmse"]) / len(r["rmse"]) for r in val]  # per channel, in the channels' order
        val_ax.plot([r["step"] for r in val], mean_rmse, "o-", color=colour, label=label, markersize=4)
    steps = sorted(set(losses[0]) & set(losses[1]))
    gap_ax.plot(steps, [abs(losses[1][s] - losses[0][s]) / losses[0][s] for s in steps], "o-", color="#55A868",
                markersize=3)
    loss_ax.set_yscale("log")
    gap_ax.set_yscale("log")
    loss_ax.set(xlabel="step", ylabel="training loss (L1, physical units)", title="training loss")
    gap_ax.set(xlabel="step", ylabel="|difference| / first run's loss", title="how far apart the two losses are")
    val_ax.set(xlabel="step", ylabel="validation RMSE, mean over channels", title="validation")
    loss_ax.legend(fontsize=8)
    return fig


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--metrics", type=Path, help="a quickstart run's metrics.jsonl: also draw (c)")
    parser.add_argument("--drift", type=Path, nargs=2, metavar=("ONE_DEVICE", "LAYOUT"),
                        help="two runs' metrics.jsonl (train.py's and another layout's): also draw (g)")
    parser.add_argument("--out", type=Path, default=DOCS, help="folder for the PNGs")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    figures = {"parallelism.png": parallelism_figure(), "launch_tree.png": launch_tree_figure(),
               "layers.png": layers_figure(), "mesh.png": mesh_figure(), "bands.png": bands_figure(),
               "job_chain.png": job_chain_figure()}
    if args.drift:
        try:
            runs = {f"{path.parent.name} ({path.parent})": [json.loads(line) for line in path.read_text().splitlines()
                                                            if line.strip()] for path in args.drift}
            figures["layout_drift.png"] = drift_figure(runs)
        except (OSError, ValueError, KeyError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
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
