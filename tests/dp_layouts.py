"""Run by tests/test_domain_parallel.py as 4 CPU processes (gloo): SwinIR split into latitude bands of the field
(domain parallelism, train_mp.py --cp for SwinIR) against the same model on one process, step by step.

Each layout goes through check_layouts.py's harness (utils/layouts/equivalence.py: train_mp.py's TP -> CP -> AC ->
FSDP2 over dp x cp, the band-weighted loss, STEPS AdamW steps); each step's forward output (the bands put
together), loss and every gradient, and the weights after the last step, must equal one process's. The fields
are chosen so that every band boundary crosses a shifted window (window 8, shift 4) and the splits are uneven:
30 low-res rows over 4 bands = 8 + 8 + 8 + 6 (+ 2 rows of the model's padding), 22 rows over 2 = 16 + 6 (+ 2).
Two runs that leave out a piece must be caught: convolutions without the halo exchange, and gradients averaged
over dp only (the band loss weights then never meet).
Also per rank: the bytes autograd saves in the first step of the 4-band layout (for the memory estimate),
and one bf16 autocast step. Prints one JSON line per layout on rank 0.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import build_model  # noqa: E402
from utils.config import build_config  # noqa: E402
from utils.memory.measure import SavedTensorBytes  # noqa: E402
from utils.parallel.domain_parallel import band_bounds, gather_bands  # noqa: E402
from utils.layouts.equivalence import adamw, compare, one_process, run_layout  # noqa: E402
from utils.layouts.accepted import Layout  # noqa: E402
from utils.training import exit_process  # noqa: E402

STEPS = 2
BATCH = 2
LR = 1e-2
WIDTH = 24
# (name, low-res rows, tp, cp, activation checkpointing, precision, what is left out)
LAYOUTS = [
    ("cp4", 30, 1, 4, "none", "fp32", None),
    ("dp2xcp2+ac", 22, 1, 2, "block", "fp32", None),
    ("tp2xcp2", 22, 2, 2, "none", "fp32", None),
    ("cp4-bf16", 30, 1, 4, "none", "bf16", None),
    ("cp4-no-halo", 30, 1, 4, "none", "fp32", "halo"),
    ("dp2xcp2-dp-only", 22, 1, 2, "none", "fp32", "cp_reduction"),
]
MODEL = {"model_args": {"depths": [2, 2], "num_heads": [2, 2], "embed_dim": 16, "window_size": 8, "drop_path_rate": 0.0,
                        "upsampler": "pixelshuffle"}, "img_size": 16}  # two RSTBs: every kind of 3x3 convolution


def batches(rows: int, upscale: int):
    g = torch.Generator().manual_seed(1)
    mean = torch.tensor([6.0, 278.0, 18.0]).view(1, 3, 1, 1)  # physical units, targets far from the outputs:
    return [(mean + 3 * torch.randn(BATCH, 3, rows, WIDTH, generator=g),  # no L1 sign flips from rounding
             mean + 40 + 3 * torch.randn(BATCH, 3, rows * upscale, WIDTH * upscale, generator=g))
            for _ in range(STEPS)]


def without_halo(model) -> None:
    """Every convolution back to its own zero padding at the band edges (the halo's pre-hook removed)."""
    for conv in (m for m in model.modules() if isinstance(m, torch.nn.Conv2d)):
        conv._forward_pre_hooks.clear()
        conv.padding = (conv.kernel_size[0] // 2, conv.padding[1])


def outputs_equal(trace, reference, tolerance: float) -> bool:
    """Each step's output, the bands put together on each first band's rank, equals one process's for the same
    samples (every rank says whether its own are; collective)."""
    rank, size = trace.dp
    per = BATCH // size
    whole = [torch.stack([gather_bands(sample, 1, trace.bands) for sample in pred]) for pred in trace.outputs]
    same = torch.tensor([not trace.bands.first or all(
        torch.allclose(o, r[rank * per:(rank + 1) * per], rtol=tolerance, atol=tolerance * r.abs().max())
        for o, r in zip(whole, reference.outputs))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same)


def relative_error(a: dict, b: dict) -> float:
    """|a - b| / |b| over all the gradients at once."""
    return (sum((a[n] - b[n]).square().sum() for n in b) / sum(b[n].square().sum() for n in b)).sqrt().item()


def main():
    dist.init_process_group("gloo")
    references = {}
    for name, rows, tp, cp, ac, precision, left_out in LAYOUTS:
        cfg = build_config("quickstart", MODEL)
        torch.manual_seed(0)
        plain = build_model(cfg.model)
        data = batches(rows, cfg.model.upscale)
        for p in {"fp32", precision}:
            if (rows, p) not in references:  # one process computes it for all (4 share 2 cores in CI)
                references[rows, p] = one_process(plain, cfg, data, F.l1_loss, adamw(LR), p, keep_outputs=True)
        reference = references[rows, precision]
        counter = SavedTensorBytes(exclude=list(plain.parameters()) + list(plain.buffers()))
        layout = Layout("train_mp.py", "mp", world=dist.get_world_size(), tp=tp, cp=cp, ac=ac, precision=precision,
                        batch_size=BATCH)
        trace = run_layout(layout, plain, cfg, data, F.l1_loss, adamw(LR), keep_outputs=True, activations=counter,
                           left_out=left_out if left_out == "cp_reduction" else "",
                           after_cp=without_halo if left_out == "halo" else None)
        tolerance = 2e-2 if precision == "bf16" else 1e-5
        result = {"layout": name, "left_out": left_out, "bands": [b - a for a, b in band_bounds(rows, 8, cp)],
                  "parameters": len(reference.weights), "outputs_equal": outputs_equal(trace, reference, tolerance),
                  "losses_equal": torch.allclose(torch.tensor(trace.losses), torch.tensor(reference.losses),
                                                 rtol=tolerance)}
        if precision == "fp32":
            result.update(compare(trace, reference).summary())
        else:  # bf16 rounds each sum differently: as far from fp32 as one process's bf16, at the first step
            fp32_grads = references[rows, "fp32"].grads[0]
            result.update(grad_error=relative_error(trace.grads[0], fp32_grads),
                          single_grad_error=relative_error(reference.grads[0], fp32_grads))
        if name == "cp4":  # what each band saved for backward, and (rank 0) one process the whole field
            per_rank = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
            dist.all_gather(per_rank, torch.tensor([counter.bytes]))
            result.update(activation_bytes=torch.cat(per_rank).tolist())
            if dist.get_rank() == 0:
                single = SavedTensorBytes(exclude=list(plain.parameters()) + list(plain.buffers()))
                single_layout = Layout("train.py", "none", world=1, batch_size=BATCH)
                run_layout(single_layout, plain, cfg, data[:1], F.l1_loss, adamw(LR), activations=single)
                result.update(single_bytes=single.bytes)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_process(0, joined=True)  # gloo's threads outlive destroy_process_group: no interpreter shutdown
