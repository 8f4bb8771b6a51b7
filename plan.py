"""Step 1b — which layout does my problem need on my cluster? Memory and speed predicted for every layout, ranked.

    python plan.py --config vit_mp --cluster perlmutter-a100-40 --nodes 4          # the ViT, 350M parameters
    python plan.py --config full_size --cluster kestrel-h100 --nodes 1             # SwinIR on whole fields
    python plan.py --config vit_quickstart --cluster this-machine --nodes 1        # this computer, measured
    python plan.py --config baseline --cluster generic-8gpu --nodes 2 --json       # one JSON object per layout
    python plan.py --config full_size --cluster my-cluster --cluster_file my.yaml --nodes 2

Every layout the training scripts accept for the config on N nodes — data parallel (DDP), sharded (FSDP, HSDP),
tensor (tp), context (cp: the ViT's token bands, SwinIR's field bands) and pipeline parallel (pp, each schedule
and microbatch count), activation checkpointing (none / block / layer), precision (fp32, bf16 autocast, bf16
parameters) — with, per GPU, the memory estimate_memory.py would print (utils/memory/estimate.py; for a model without
a hand-written description, its step traced on fake tensors, utils/memory/traced.py: data parallel layouts only) and the
predicted step: compute (FLOPs per sample / (peak x efficiency)) plus the communication the compute does not
hide, plus the pipeline's bubble (utils/plan/speed.py writes down each term and the overlap rules). The global
batch is the config's (--batch_size N overrides it; --batch_sizes A B ... compares several); the micro-batch
per GPU follows from the layout. The cluster's figures and their sources: config/clusters/clusters.yaml.

Columns: fits (within 95 % of the GPU's memory; the margin in GB), GB per GPU, predicted samples/s, scaling
efficiency (the ideal step of perfectly scaled compute / the predicted step), and what limits the layout:
memory (does not fit), compute, network (exposed communication), bubble (pipeline) or recompute (AC). Then
why the winner wins, and the command that runs it. Nothing fits: one line with the smallest footprint and
what would make it fit. Any config key can be overridden as in the training scripts (`--help` lists them); a
layout key given (--tp 4, --ac block, --amp_dtype bf16, ...) keeps only the layouts with that value.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from utils.config import ConfigError, parse_config
from utils.plan.clusters import load_cluster
from utils.plan.compute import calibration_note
from utils.plan.planner import plan, what_would_fit, why_it_wins
from utils.training import run_cli


def add_arguments(parser) -> None:
    parser.add_argument("--cluster", required=True, help="a cluster of config/clusters/clusters.yaml (or of "
                        "--cluster_file): perlmutter-a100-40, perlmutter-a100-80, kestrel-h100, generic-8gpu, "
                        "this-machine")
    parser.add_argument("--cluster_file", default=None, help="a YAML file with your own cluster entries")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=None,
                        help="global batches to compare (default: the config's batch_size)")
    parser.add_argument("--top", type=int, default=12, help="rows of the table (--json lists every layout)")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per layout")


def user_overrides(args) -> list[str]:
    """The config overrides given on the command line, as --key value (YAML values, as the scripts parse them),
    after the config file they were read from, if it is not the project's."""
    out = ["--config_file", args.config_file] if args.config_file else []
    for key, value in vars(args).items():
        if key.startswith("cfg__"):
            text = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
            out += [f"--{key[5:]}", text]
    return out


LAYOUT_KEYS = ("tp", "cp", "pp", "pp_schedule", "pp_microbatches", "ac", "amp_dtype", "param_dtype", "hsdp_replicas")


def keep_fixed(rows, args) -> list:
    """Only the layouts with the layout keys the user set on the command line (--tp 4: the tp 4 layouts)."""
    fixed = {key: getattr(args, f"cfg__{key}") for key in LAYOUT_KEYS if hasattr(args, f"cfg__{key}")}
    kept = [row for row in rows if all(row.layout.keys().get(key, 1) == value for key, value in fixed.items())]
    if fixed and not kept:
        shown = " ".join(f"--{key} {value}" for key, value in fixed.items())
        raise ConfigError(f"no layout with {shown} is accepted by the scripts for this config on this cluster: "
                          "drop it to see the ones that are")
    return kept


def format_table(rows, cluster, nodes: int, cfg, top: int) -> str:
    world = nodes * cluster.gpus_per_node
    lines = [f"plan for config {cfg.name} ({cfg.model.model}, global batch {cfg.train.batch_size}) on {nodes} node(s) "
             f"of {cluster.name}: {world} x {cluster.gpu}, {cluster.memory_bytes / 1e9:.0f} GB each "
             f"({cluster.source}); {len(rows)} layouts the scripts accept",
             f"{'#':>3} {'layout':<33} {'precision':<11} {'ac':<6} {'batch/GPU':>9} {'GB/GPU':>8} {'fits':>12} "
             f"{'samples/s':>10} {'scaling':>8}  limited by"]
    for i, row in enumerate(rows[:top], 1):
        fits = f"yes {row.margin_gb:+.1f}" if row.fits else f"no {row.margin_gb:+.1f}"
        lines.append(f"{i:>3} {row.layout.name():<33} {row.layout.precision:<11} {row.layout.ac:<6} "
                     f"{row.layout.micro_batch:>9} {row.gb:>8.2f} {fits:>12} {row.speed.samples_per_sec:>10.3g} "
                     f"{row.speed.efficiency:>8.0%}  {row.limited_by}")
    if len(rows) > top:
        lines.append(f"    ... {len(rows) - top} more (--top N, or --json for all)")
    return "\n".join(lines)


def main(argv=None) -> int:
    cfg, args = parse_config(__doc__, argv, extra_args=add_arguments)
    cluster = load_cluster(args.cluster, Path(args.cluster_file) if args.cluster_file else None)
    overrides = user_overrides(args)
    rows = keep_fixed(plan(cfg, cluster, args.nodes, args.batch_sizes, overrides), args)
    if args.json:
        print(json.dumps([row.to_json() for row in rows]))
        return 0
    print(format_table(rows, cluster, args.nodes, cfg, args.top))
    if cluster.hbm_bandwidth:  # which speeds a measured step calibrates, which are extrapolated
        print(calibration_note(cfg, cluster.gpu))
    elif cluster.assumed(cfg.model.model):
        print(cluster.assumed(cfg.model.model))
    if rows and rows[0].fits:
        print(f"\nwhy: {why_it_wins(rows)}")
        print(f"run: {rows[0].command}")
    else:
        print(f"\n{what_would_fit(cfg, cluster, args.nodes, rows, args.batch_sizes, overrides)}")
    return 0


if __name__ == "__main__":
    run_cli(main)
