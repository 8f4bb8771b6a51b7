"""Run by tests/test_mp.py under torchrun (4 CPU processes, gloo): every model-parallel layout of a small ViT
against the same ViT on one process, step by step.

For each layout the same initial weights and global batch go through STEPS AdamW steps as train_mp.py
applies them (TP -> CP -> FSDP2 over dp x cp); after each backward, every gradient (full tensors,
gathered from the shards) must equal the single-process gradient, and after the last step every weight.
The token grid has 3 rows, so cp 2 splits it unevenly (2 + 1 rows); tp 2 x cp 2 runs with activation
checkpointing per block. One more run folds cp out of FSDP's
mesh (gradients averaged over dp only, as NERSC's DL4SCI25 code did for its final norm): the check must
catch it. Prints one JSON line per layout on rank 0.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models.vit import ViT  # noqa: E402
from utils.context_parallel import apply_cp  # noqa: E402
from utils.distributed import build_mp_mesh  # noqa: E402
from utils.techniques import apply_ac  # noqa: E402
from utils.tensor_parallel import apply_tp  # noqa: E402
from utils.training import relative_l2  # noqa: E402

STEPS = 3
BATCH = 4
LAYOUTS = [  # (tp, cp, order): dp = 4 / (tp * cp); tp 2 x cp 2 also with activation checkpointing per block
    (2, 1, "tp-cp-dp"), (1, 2, "tp-cp-dp"), (2, 2, "tp-cp-dp"), (2, 1, "dp-cp-tp")]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 3, 12, 16, generator=g), torch.randn(BATCH, 3, 12, 16, generator=g))
            for _ in range(STEPS)]


def reference(model, data):
    """grads per step and final weights of the plain model on the whole batch."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    grads = []
    for x, y in data:
        optimizer.zero_grad()
        relative_l2(model(x), y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def parallel(model, data, tp, cp, order, fold_cp=True):
    mesh, dp_cp = build_mp_mesh(dist.get_world_size(), tp, cp, order, torch.device("cpu"))
    dp_mesh = dp_cp if fold_cp else mesh["dp"]
    apply_tp(model, mesh["tp"])
    apply_cp(model, mesh["cp"])
    apply_ac(model, "block" if (tp, cp) == (2, 2) else "none")  # torchtitan's order: TP -> CP -> AC -> FSDP
    for block in model.transformer:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per, d = BATCH // mesh["dp"].size(), mesh["dp"].get_local_rank()
    grads = []
    for x, y in data:
        optimizer.zero_grad()
        relative_l2(model(x[d * per:(d + 1) * per]), y[d * per:(d + 1) * per]).backward()
        grads.append({n: full(p.grad) for n, p in model.named_parameters()})
        optimizer.step()
    return grads, {n: full(p.detach()) for n, p in model.named_parameters()}


def differing(a: dict, b: dict, atol: float) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [n for n in a if not torch.allclose(a[n], b[n], rtol=1e-4, atol=atol)]


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    plain = ViT(img_size=(12, 16), patch_size=4, in_chans=3, embed_dim=16, depth=2, num_heads=2)
    data = batches()
    ref_grads, ref_weights = reference(copy.deepcopy(plain), data)
    runs = [(tp, cp, order, True) for tp, cp, order in LAYOUTS] + [(1, 2, "tp-cp-dp", False)]
    for tp, cp, order, fold_cp in runs:
        grads, weights = parallel(copy.deepcopy(plain), data, tp, cp, order, fold_cp)
        result = {"tp": tp, "cp": cp, "order": order, "fold_cp": fold_cp, "parameters": len(ref_weights),
                  "grads_differ": sorted({n for step in range(STEPS) for n in differing(grads[step], ref_grads[step], 1e-6)}),
                  # Adam divides by the gradient's own size: rounding in the gradient -> ~lr * 1e-3 in a weight
                  "weights_differ": differing(weights, ref_weights, 2e-5)}
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
