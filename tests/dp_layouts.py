"""Run by tests/test_domain_parallel.py as 4 CPU processes (gloo): SwinIR split into latitude bands of the field
(domain parallelism, train_mp.py --cp for SwinIR) against the same model on one process, step by step.

For each layout the same initial weights and global batch go through STEPS AdamW steps as train_mp.py
applies them (TP -> CP -> AC -> FSDP2 over dp x cp, the band-weighted loss); each step's forward output
(the bands put together), loss and every gradient, and the weights after the last step, must equal one
process's. The fields are chosen so that every band boundary crosses a shifted window (window 8, shift 4)
and the splits are uneven: 30 low-res rows over 4 bands = 8 + 8 + 8 + 6 (+ 2 rows of the model's padding),
22 rows over 2 = 16 + 6 (+ 2). Two runs that leave out a piece must be caught: convolutions without the halo
exchange, and gradients averaged over dp only (the band loss weights then never meet).
Also per rank: the bytes autograd saves in the first step of the 4-band layout (for the memory estimate),
and one bf16 autocast step. Prints one JSON line per layout on rank 0.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import build_model  # noqa: E402
from utils.config import build_config  # noqa: E402
from utils.memory.measure import SavedTensorBytes
from utils.parallel.context_parallel import apply_cp
from utils.parallel.distributed import build_mp_mesh
from utils.parallel.domain_parallel import band_bounds, band_loss, field_bands, gather_bands
from utils.parallel.techniques import apply_ac
from utils.parallel.tensor_parallel import apply_tp

STEPS = 2
BATCH = 2
LR = 1e-2
WIDTH = 24
# (name, low-res rows, tp, cp, activation checkpointing, amp, what is left out)
LAYOUTS = [
    ("cp4", 30, 1, 4, "none", "none", None),
    ("dp2xcp2+ac", 22, 1, 2, "block", "none", None),
    ("tp2xcp2", 22, 2, 2, "none", "none", None),
    ("cp4-bf16", 30, 1, 4, "none", "bf16", None),
    ("cp4-no-halo", 30, 1, 4, "none", "none", "halo"),
    ("dp2xcp2-dp-only", 22, 1, 2, "none", "none", "cp_reduction"),
]
MODEL = {"depths": [2, 2], "num_heads": [2, 2], "embed_dim": 16, "img_size": 16, "window_size": 8,
         "drop_path_rate": 0.0, "upsampler": "pixelshuffle"}  # two RSTBs: every kind of 3x3 convolution


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def config(tp: int, cp: int, amp: str):
    return build_config("quickstart", {**MODEL, "tp": tp, "cp": cp, "amp_dtype": amp})


def batches(rows: int, upscale: int):
    g = torch.Generator().manual_seed(1)
    mean = torch.tensor([6.0, 278.0, 18.0]).view(1, 3, 1, 1)  # physical units, targets far from the outputs:
    return [(mean + 3 * torch.randn(BATCH, 3, rows, WIDTH, generator=g),  # no L1 sign flips from rounding
             mean + 40 + 3 * torch.randn(BATCH, 3, rows * upscale, WIDTH * upscale, generator=g))
            for _ in range(STEPS)]


def train(model, data, loss_fn, amp: str, rows=None, dp_rank=0, dp_size=1, bands=None, counter=None):
    """STEPS AdamW steps on this rank's part of each batch: (outputs, losses, grads per step, weights). Losses
    are the whole batch's; outputs this dp rank's samples, on the first band's rank put together from the
    bands (elsewhere the rank's band)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    per = BATCH // dp_size
    outputs, losses, grads = [], [], []
    for step, (x, y) in enumerate(data):
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        if bands:
            start, stop = bands.bounds(rows)
            s = y.shape[2] // x.shape[2]
            x, y = x[:, :, start:stop], y[:, :, s * start:s * stop]
        optimizer.zero_grad()
        with counter.counting(step == 0) if counter else contextlib.nullcontext():
            with torch.autocast("cpu", torch.bfloat16, enabled=amp == "bf16"):
                pred = model(x)
            loss = loss_fn(pred.float(), y)
        loss.backward()
        pred = pred.detach().float()
        outputs.append(torch.stack([gather_bands(sample, 1, bands) for sample in pred]) if bands else pred)
        mean = loss.detach().clone()
        if bands:  # the mean of the ranks' (band-weighted) losses is the batch's loss
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean.item())
        grads.append({n: full(p.grad).clone() for n, p in model.named_parameters()})
        optimizer.step()
    return outputs, losses, grads, {n: full(p.detach()) for n, p in model.named_parameters()}


def parallel(plain, data, rows, tp, cp, ac, amp, left_out, counter):
    """train() under train_mp.py's layout: (its results, this rank's dp rank and size, whether it is a first band)."""
    mesh, dp_cp = build_mp_mesh(dist.get_world_size(), tp, cp, "tp-cp-dp", torch.device("cpu"))
    bands = field_bands(config(tp, cp, amp), mesh["cp"])
    model = apply_cp(apply_tp(copy.deepcopy(plain), mesh["tp"]), mesh["cp"])
    if left_out == "halo":  # every convolution back to its own zero padding at the band edges
        for conv in (m for m in model.modules() if isinstance(m, torch.nn.Conv2d)):
            conv._forward_pre_hooks.clear()
            conv.padding = (conv.kernel_size[0] // 2, conv.padding[1])
    model = apply_ac(model, ac)
    fsdp_mesh = mesh["dp"] if left_out == "cp_reduction" else dp_cp  # dp only: the cp ranks are never averaged
    for block in model.blocks():
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    results = train(model, data, band_loss(F.l1_loss, bands), amp, rows, dp_rank, dp_size, bands, counter)
    return results, dp_rank, dp_size, bands.first


def differing(a: dict, b: dict, rtol: float, elementwise: bool = False) -> list[str]:
    """Names whose tensors differ by more than rtol of the reference's largest magnitude: fp32 rounding in a
    sum grows with its terms, not with the result. ``elementwise`` (weights after Adam steps): rtol of each
    element, and 1 % of a step, since Adam scales a small gradient's rounding up to the step's size."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    if elementwise:
        return [n for n in a if not torch.allclose(a[n], b[n], rtol=rtol, atol=LR / 100)]
    return [n for n in a if (a[n] - b[n]).abs().max() > rtol * b[n].abs().max()]


def relative_error(a: dict, b: dict) -> float:
    """|a - b| / |b| over all the gradients at once."""
    return (sum((a[n] - b[n]).square().sum() for n in b) / sum(b[n].square().sum() for n in b)).sqrt().item()


def main():
    dist.init_process_group("gloo")
    references = {}
    for name, rows, tp, cp, ac, amp, left_out in LAYOUTS:
        cfg = config(1, 1, "none")
        torch.manual_seed(0)
        plain = build_model(cfg.model)
        data = batches(rows, cfg.model.upscale)
        for precision in {"none", amp}:
            if (rows, precision) not in references:  # one process computes it for all (4 share 2 cores in CI)
                reference = [train(copy.deepcopy(plain), data, F.l1_loss, precision) if dist.get_rank() == 0 else None]
                dist.broadcast_object_list(reference)
                references[rows, precision] = reference[0]
        ref_outputs, ref_losses, ref_grads, ref_weights = references[rows, amp]
        counter = SavedTensorBytes(exclude=list(plain.parameters()) + list(plain.buffers()))
        (outputs, losses, grads, weights), dp_rank, dp_size, first_band = parallel(plain, data, rows, tp, cp, ac, amp,
                                                                                   left_out, counter)
        tolerance = 2e-2 if amp == "bf16" else 1e-5
        per = BATCH // dp_size
        same = torch.tensor([not first_band or all(  # this dp rank's samples, checked where they are whole
            torch.allclose(o, r[dp_rank * per:(dp_rank + 1) * per], rtol=tolerance, atol=tolerance * r.abs().max())
            for o, r in zip(outputs, ref_outputs))])
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        result = {"layout": name, "left_out": left_out, "bands": [b - a for a, b in band_bounds(rows, 8, cp)],
                  "parameters": len(ref_weights), "outputs_equal": bool(same),
                  "losses_equal": torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=tolerance)}
        if amp == "none":
            result.update(grads_differ=sorted({n for step in range(STEPS) for n in differing(grads[step], ref_grads[step], 1e-4)}),
                          weights_differ=differing(weights, ref_weights, 1e-4, elementwise=True))
        else:  # bf16 rounds each sum differently: as far from fp32 as one process's bf16, at the first step
            fp32_grads = references[rows, "none"][2][0]
            result.update(grad_error=relative_error(grads[0], fp32_grads),
                          single_grad_error=relative_error(ref_grads[0], fp32_grads))
        if name == "cp4":  # what each band saved for backward, and (rank 0) one process the whole field
            per_rank = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
            dist.all_gather(per_rank, torch.tensor([counter.bytes]))
            result.update(activation_bytes=torch.cat(per_rank).tolist())
            if dist.get_rank() == 0:
                single = SavedTensorBytes(exclude=list(plain.parameters()) + list(plain.buffers()))
                train(copy.deepcopy(plain), data[:1], F.l1_loss, amp, counter=single)
                result.update(single_bytes=single.bytes)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
