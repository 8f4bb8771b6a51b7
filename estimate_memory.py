"""Steps 1-2 and Part II — predict the peak training memory of a config, before running out of it.

Works for every model of the tutorial (the config's ``model`` key): SwinIR (Part I), the ViT
forecaster (Part II) and SC22's 3-D U-Net (Part III). Adds up, per rank: parameters, gradients, AdamW state, the activations
autograd holds for backward (a formula per layer: SwinIR's windowed attention grows linearly with
the number of pixels; the ViT's fused SDPA saves q, k, v and the output, never the tokens x tokens
matrix, so it grows linearly with the tokens too), and the temporary peak of backward. Nothing is
run: it takes a second.

    python estimate_memory.py --config full_size                        # SwinIR, whole 720x1440 fields, fp32
    python estimate_memory.py --config full_size --amp_dtype bf16 --ac block
    python estimate_memory.py --config full_size --device cuda          # GPU attention path (default: this machine's)
    python estimate_memory.py --config baseline --crop_size 64 --batch_size 2
    python estimate_memory.py --config full_size --batch_size 8 --world_size 8 --strategy fsdp --param_dtype bf16
    python estimate_memory.py --config vit_mp --device cuda --amp_dtype none   # the ViT, 350M parameters, batch 64
    python estimate_memory.py --config vit_mp --device cuda --ac block
    python estimate_memory.py --config vit_mp --device cuda --strategy fsdp --world_size 4
    python estimate_memory.py --config full_size --cp 4 --world_size 4 --strategy fsdp --device cuda  # 4 bands
    python estimate_memory.py --config unet3d_base --device cuda        # SC22's U-Net, 64³ crops, batch 64
    python estimate_memory.py --config full_size --json                 # one JSON object
    python estimate_memory.py --config vit_quickstart --traced --world_size 2 --strategy fsdp   # traced (below)

Any config key can be overridden as in the training scripts (`--help` lists them). batch_size is
the global batch: with --world_size N each rank holds batch_size / N samples. The ViT's input is
always its whole img_size field (no crops, no --field); its activation checkpointing unit and
FSDP unit are the transformer block (``ac: layer`` is SwinIR's RSTB, an error for the ViT).
For SwinIR, --cp N (train_mp.py's domain parallelism) estimates the rank holding the largest band of
each field: the cp ranks of a field share its samples, FSDP2 shards over all --world_size ranks.
For the ViT, --cp N (its token bands) estimates the rank holding the largest band. --tp N (train_mp.py's
tensor parallelism) and --pp N with --pp_schedule and --pp_microbatches (train_pp.py) estimate the rank that
holds the most; --world_size counts every rank (dp = world_size / (tp x cp x pp)). plan.py ranks every layout
by these estimates (`python plan.py --config NAME --cluster this-machine --nodes 1`).
The U-Net's input is its crop_size³ crop; its units are its down and up blocks (one convolution each).
See utils/memory/estimate.py for the model of each term, and which terms are exact or approximate;
benchmarks/validate_memory_estimate.py compares the estimate with measurements.

A model without a hand-written description (a spec's memory: models/spec.py, utils/memory/shapes.py), or any model with --traced, is estimated by
tracing one training step on fake tensors (utils/memory/traced.py: PyTorch's memory trackers, nothing allocated,
a second or two): its peak per rank on one device, under DDP, FSDP2 or HSDP, with AC and autocast as configured,
within 10 % of the measured peak on CPU (benchmarks/validate_traced_estimate.py; benchmarks/README.md). It runs
the CPU's kernels; tensor, context and pipeline parallelism need the hand-written description and are refused.
A model whose step does not run on fake tensors is one line (exit 2).
"""

from __future__ import annotations

import json

from utils.config import ConfigError, parse_config
from utils.memory.estimate import GB, MemoryEstimate, estimate_memory
from utils.memory.shapes import MemoryDescription, has_description, model_shape
from utils.memory.traced import estimate_traced
from utils.training import run_cli

ACCURACY = {  # what the estimate can promise for each term (utils/memory/estimate.py explains why; the activations:
    # each model's description, which knows how they were measured)
    "params": "exact",
    "grads": "exact",
    "optimizer": "exact",
    "temporary": "approximate",
}


def _field(text: str) -> tuple[int, int]:
    try:
        height, width = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ConfigError(f"--field {text!r} is not HEIGHTxWIDTH, e.g. 720x1440") from None
    if height < 1 or width < 1:
        raise ConfigError(f"--field {text!r} needs positive sides")
    return height, width


def add_arguments(parser) -> None:
    parser.add_argument("--world_size", type=int, default=1, help="ranks sharing the global batch")
    parser.add_argument("--strategy", choices=["none", "ddp", "fsdp"], default=None,
                        help="none (one device, train.py), ddp or fsdp; default: none for 1 rank, else ddp")
    parser.add_argument("--field", default=None, metavar="HxW",
                        help="high-res whole-field size for crop_size 0 (default: the data's grid, else 720x1440)")
    parser.add_argument("--traced", action="store_true",
                        help="trace one training step on fake tensors (the default for a model without a hand-written "
                             "description)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


GPU_SIZES_GB = (40, 80)  # A100 40/80 GB, H100 80 GB: what the total is compared with on the CUDA path


def format_table(estimate: MemoryEstimate, shape: MemoryDescription) -> str:
    """The hand-written estimate as a table; what it says of the input and of its activations' accuracy is the
    model's description's (``shape``), so a model of yours is not described in another model's words."""
    s = estimate.setting
    ranks = f"{s['world_size']} rank{'s' if s['world_size'] > 1 else ''}, strategy {s['strategy']}"
    if "cp" in s:
        ranks += f", each field in {s['cp']} bands (cp)"
    if s.get("tp", 1) > 1:
        ranks += f", each block split over {s['tp']} ranks (tp)"
    if s.get("pp", 1) > 1:
        ranks += f", {s['pp']} pipeline stages ({s['pp_schedule']}, {s['pp_microbatches']} microbatches)"
    if s.get("members_per_rank", 1) > 1:  # --ensemble M: each member one more input per sample
        ranks += f", {s['members_per_rank']} ensemble members per sample per rank" + (
            f" (ens {s['ens']})" if "ens" in s else "")
    lines = [f"{s['model']} training memory estimate — config {s['config']}: {s['num_params']:,} parameters, {ranks}",
             shape.input_line(s)]
    if "field" in s:
        lines.append(f"  whole {s['field'][0]}x{s['field'][1]} fields: {s['field_source']}")
    lines += [
        "",
        f"  {'per rank':34s} {'GB':>10s}   accuracy",
    ]
    accuracy = dict(ACCURACY, activations=shape.activations_accuracy[s["device_type"]])

    def row(name, value, note="", indent=2):
        lines.append(f"{' ' * indent}{name:{36 - indent}s} {value / GB:10.3f}   {note}")

    row("parameters", estimate.params, accuracy["params"])
    if len(estimate.params_detail) > 1:
        for key, value in estimate.params_detail.items():
            row(key.replace("_", " "), value, indent=6)
    row("gradients", estimate.grads, accuracy["grads"])
    row("optimizer state (AdamW)", estimate.optimizer, accuracy["optimizer"])
    row("activations (held for backward)", estimate.activations, accuracy["activations"])
    for key, value in estimate.activations_by_part.items():
        if value:
            row(key.replace("_", " "), value, indent=6)
    row("temporary peak (backward)", estimate.temporary, accuracy["temporary"])
    lines.append(f"  {'-' * 48}")
    row("total (estimated peak)", estimate.total)
    if s["device_type"] == "cuda":
        fits = "; ".join(f"fits {size} GB: {'yes' if estimate.total <= size * GB else 'no'}" for size in GPU_SIZES_GB)
        lines.append(f"  per GPU: {fits} (not counted: the CUDA context, the caching allocator's fragmentation)")
    return "\n".join(lines)


def format_traced_table(estimate: MemoryEstimate) -> str:
    """The traced estimate: the peak of one rank and what it holds at that moment."""
    s = estimate.setting
    ranks = f"{s['world_size']} rank{'s' if s['world_size'] > 1 else ''}, strategy {s['strategy']}"
    if s.get("shard_group", s["world_size"]) < s["world_size"]:
        ranks += f" (HSDP: shards over {s['shard_group']})"
    lines = [f"{s['model']} training memory, traced — config {s['config']}: {s['num_params']:,} parameters, {ranks}",
             f"  input {'x'.join(map(str, s['input_shape']))} per rank; autocast {s['amp_dtype']}, parameters "
             f"{s['param_dtype']}; activation checkpointing {s['ac']}; device {s['device_type']} (CPU kernels traced); "
             f"traced in {s['traced_s']:.1f} s", "",
             f"  {'per rank, at the peak (' + s['peak_phase'] + ')':50s} {'GB':>10s}"]

    def row(name, value, indent=2):
        lines.append(f"{' ' * indent}{name:{50 - indent}s} {value / GB:10.3f}")

    row("parameters (and buffers)", estimate.params)
    if len(estimate.params_detail) > 1:
        for key, value in estimate.params_detail.items():
            row(key.replace("_", " "), value, indent=6)
    row("gradients" + (" (DDP's buckets)" if s["strategy"] == "ddp" else ""), estimate.grads)
    row("optimizer state (AdamW)", estimate.optimizer)
    row("activations", estimate.activations)
    row("temporary (backward's gradients in flight, ...)", estimate.temporary)
    lines.append(f"  {'-' * 61}")
    row("peak", estimate.total)
    lines.append(f"  after the step: parameters + gradients + AdamW state {s['states_gb']:.3f} GB; saved for backward "
                 f"by the forward pass {s['saved_activations_gb']:.3f} GB; {s['flops_per_step']:.3g} FLOPs per step "
                 "(this rank's)")
    lines += [f"  note: {note}" for note in s.get("notes", [])]
    return "\n".join(lines)


def main(argv=None) -> int:
    cfg, args = parse_config(__doc__, argv, extra_args=add_arguments)
    strategy = args.strategy or ("none" if args.world_size == 1 else "ddp")
    field = _field(args.field) if args.field else None
    if args.traced or not has_description(cfg.model):
        if field:
            raise ConfigError("--field sets SwinIR's whole field in the hand-written estimate: the traced one takes "
                              "the data's grid or --crop_size")
        estimate = estimate_traced(cfg, world_size=args.world_size, strategy=strategy)
        print(json.dumps(estimate.to_json()) if args.json else format_traced_table(estimate))
        return 0
    estimate = estimate_memory(cfg, world_size=args.world_size, strategy=strategy, field=field)
    shape = model_shape(cfg.model, cfg.target_chans)  # the words of the model's own description
    print(json.dumps(estimate.to_json()) if args.json else format_table(estimate, shape))
    return 0


if __name__ == "__main__":
    run_cli(main)
