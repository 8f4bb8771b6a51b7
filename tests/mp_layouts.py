"""Run by tests/test_mp.py as 4 CPU processes (gloo): every model-parallel layout of a small ViT, and SwinIR's
tensor parallelism, against the same model on one process, step by step.

For each layout the same initial weights and global batch go through STEPS AdamW steps as train_mp.py
applies them (TP -> CP -> FSDP2 over dp x cp); after each backward, every gradient (full tensors,
gathered from the shards) must equal the single-process gradient, each step's loss the single-process loss,
and after the last step every weight.
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
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from models import build_model  # noqa: E402
from models.vit import ViT  # noqa: E402
from utils.config import build_config  # noqa: E402
from utils.parallel.context_parallel import apply_cp
from utils.parallel.distributed import build_mp_mesh
from utils.parallel.techniques import apply_ac
from utils.parallel.tensor_parallel import apply_tp
from utils.training import relative_l2

STEPS = 3
BATCH = 4
LAYOUTS = [  # (model, tp, cp, order): dp = 4 / (tp * cp); tp 2 x cp 2 also with activation checkpointing per block
    ("vit", 2, 1, "tp-cp-dp"), ("vit", 1, 2, "dp-cp-tp"), ("vit", 2, 2, "tp-cp-dp"), ("swinir", 2, 1, "tp-cp-dp")]


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def model_and_data(name: str):
    """(plain model, STEPS batches of (input, target), loss): a 2-block ViT on 3 x 4 tokens (3 rows), or a
    2-block SwinIR (one RSTB, 2 heads) super-resolving 16x16 to 32x32 with the L1 loss."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        model = ViT(img_size=(12, 16), patch_size=4, in_chans=3, embed_dim=16, depth=2, num_heads=2)
        data = [(torch.randn(BATCH, 3, 12, 16, generator=g), torch.randn(BATCH, 3, 12, 16, generator=g))
                for _ in range(STEPS)]
        return model, data, relative_l2
    cfg = build_config("quickstart", {"depths": [2], "num_heads": [2], "embed_dim": 16, "img_size": 16,
                                      "window_size": 8, "drop_path_rate": 0.0})
    model = build_model(cfg.model)
    data = [(torch.randn(BATCH, 3, 16, 16, generator=g), torch.randn(BATCH, 3, 32, 32, generator=g))
            for _ in range(STEPS)]
    return model, data, F.l1_loss


def train(model, data, loss_fn, dp_rank=0, dp_size=1):
    """STEPS AdamW steps on this rank's part of each batch: (losses averaged over ranks, grads per step, weights)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    per = BATCH // dp_size
    losses, grads = [], []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x[dp_rank * per:(dp_rank + 1) * per]), y[dp_rank * per:(dp_rank + 1) * per])
        loss.backward()
        mean = loss.detach().clone()
        if dist.get_world_size() > 1 and dp_size > 1:  # the tp x cp ranks of a replica hold the same loss
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        losses.append(mean.item())
        grads.append({n: full(p.grad).clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads, {n: full(p.detach()) for n, p in model.named_parameters()}


def parallel(model, data, loss_fn, tp, cp, order, fold_cp=True):
    mesh, dp_cp = build_mp_mesh(dist.get_world_size(), tp, cp, order, torch.device("cpu"))
    dp_mesh = dp_cp if fold_cp else mesh["dp"]
    apply_tp(model, mesh["tp"])
    apply_cp(model, mesh["cp"])
    apply_ac(model, "block" if (tp, cp) == (2, 2) else "none")  # torchtitan's order: TP -> CP -> AC -> FSDP
    for block in model.blocks():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return train(model, data, loss_fn, mesh["dp"].get_local_rank(), mesh["dp"].size())


def differing(a: dict, b: dict, atol: float) -> list[str]:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return [n for n in a if not torch.allclose(a[n], b[n], rtol=1e-4, atol=atol)]


def main():
    dist.init_process_group("gloo")
    runs = [(*layout, True) for layout in LAYOUTS] + [("vit", 1, 2, "tp-cp-dp", False)]
    references = {}
    for name, tp, cp, order, fold_cp in runs:
        plain, data, loss_fn = model_and_data(name)
        if name not in references:
            references[name] = train(copy.deepcopy(plain), data, loss_fn)
        ref_losses, ref_grads, ref_weights = references[name]
        losses, grads, weights = parallel(copy.deepcopy(plain), data, loss_fn, tp, cp, order, fold_cp)
        result = {"model": name, "tp": tp, "cp": cp, "order": order, "fold_cp": fold_cp,
                  "parameters": len(ref_weights),
                  "losses_equal": torch.allclose(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5),
                  "grads_differ": sorted({n for step in range(STEPS) for n in differing(grads[step], ref_grads[step], 1e-6)}),
                  # Adam divides by the gradient's own size: rounding in the gradient -> ~lr * 1e-3 in a weight
                  "weights_differ": differing(weights, ref_weights, 2e-5)}
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
