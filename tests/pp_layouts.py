"""Run by tests/test_pp.py as CPU processes (gloo): pipeline-parallel layouts of a small SwinIR and a small
ViT against the same model on one process, step by step.

``python pp_layouts.py schedules`` (2 processes): both models, 2 ranks, every schedule (gpipe and 1f1b: 2
stages; interleaved_1f1b and zbv: 4 stages, 2 per rank), FSDP2 over a dp of 1 for SwinIR (its hooks under
the schedule), plain stages for the ViT. ``python pp_layouts.py dp`` (4 processes): dp 2 x pp 2, FSDP2 and DDP.
For each layout the same initial weights and global batch go through STEPS AdamW steps as train_pp.py
applies them; after each step every rank's gradients (full tensors) must equal the single-process
gradients of the same names, each step's loss the single-process loss, and after the last step every
weight. Both models are cut into 4 units (SwinIR: 4 RSTBs of one block; ViT: 4 blocks), and the stages
together must hold every parameter exactly once. Prints one JSON line per layout on rank 0.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mp_layouts import differing, full  # noqa: E402

from models import build_model  # noqa: E402
from utils.config import build_config  # noqa: E402
from utils.parallel.distributed import build_pp_mesh
from utils.parallel.pipeline_parallel import Pipeline, apply_data_parallel
from utils.parallel.techniques import apply_ac
from utils.training import relative_l2

STEPS = 2
BATCH = 8
LAYOUTS = {  # name -> [(model, schedule, data parallel, activation checkpointing)]
    "schedules": [(model, schedule, "fsdp" if model == "swinir" else "none", "none")
                  for model in ("swinir", "vit") for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv")],
    "dp": [("swinir", "1f1b", "fsdp", "block"), ("vit", "interleaved_1f1b", "ddp", "none"),
           ("vit", "zbv", "fsdp", "none")],
}


def config_model_data(name: str, schedule: str):
    """(config, plain model, STEPS batches of (input, target), loss): SwinIR super-resolving 10x12 to 20x24
    (padded to its 8x8 windows inside, cropped back by the last stage) with L1, or a ViT on 3 x 4 tokens."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    common = {"pp_schedule": schedule, "pp_microbatches": 2, "drop_path_rate": 0.0}
    if name == "vit":
        cfg = build_config("vit_quickstart", {**common, "img_size": [12, 16], "patch_size": 4, "in_chans": 3,
                                               "embed_dim": 16, "depths": [4], "num_heads": [2],
                                               "channel_names": [], "mean": [0.0] * 3, "std": [1.0] * 3})
        shapes, loss_fn = ((BATCH, 3, 12, 16), (BATCH, 3, 12, 16)), relative_l2
    else:
        cfg = build_config("quickstart", {**common, "depths": [1] * 4, "num_heads": [2] * 4, "embed_dim": 16,
                                          "img_size": 16, "window_size": 8})
        shapes, loss_fn = ((BATCH, 3, 10, 12), (BATCH, 3, 20, 24)), F.l1_loss
    data = [tuple(torch.randn(shape, generator=g) for shape in shapes) for _ in range(STEPS)]
    return cfg, build_model(cfg.model), data, loss_fn


def reference(model, data, loss_fn):
    """STEPS AdamW steps on the whole batch: (losses, grads per step, weights)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], []
    for x, y in data:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipelined(cfg, model, data, loss_fn, data_parallel: str, ac: str):
    """The same steps through train_pp.py's pipeline: this rank's (losses, grads per step, weights)."""
    device = torch.device("cpu")
    mesh = build_pp_mesh(dist.get_world_size(), 2, device)
    pipeline = Pipeline(model, cfg, mesh["pp"], device, loss_fn, BATCH // mesh["dp"].size())
    pipeline.parallelize(lambda stage: apply_ac(stage, ac))
    if data_parallel != "none":
        cfg.dist.pp_dp = data_parallel
        pipeline.parallelize(lambda stage: apply_data_parallel(stage, cfg, device, mesh))
    local = pipeline.local_model()
    optimizer = torch.optim.AdamW(local.parameters(), lr=1e-2)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    per = BATCH // dp_size
    losses, grads = [], []
    for x, y in data:
        optimizer.zero_grad()
        loss = pipeline.step(x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per])
        dist.all_reduce(loss)  # the replicas' mean: every rank of a pipeline holds its replica's loss
        losses.append(loss.item() / dist.get_world_size())
        grads.append({n: full(p.grad).clone() for n, p in local.named_parameters()})
        optimizer.step()
    return losses, grads, {n: full(p.detach()) for n, p in local.named_parameters()}, pipeline


def main():
    dist.init_process_group("gloo")
    references = {}
    for name, schedule, data_parallel, ac in LAYOUTS[sys.argv[1]]:
        cfg, plain, data, loss_fn = config_model_data(name, schedule)
        if name not in references:
            references[name] = reference(copy.deepcopy(plain), data, loss_fn)
        ref_losses, ref_grads, ref_weights = references[name]
        losses, grads, weights, pipeline = pipelined(cfg, copy.deepcopy(plain), data, loss_fn, data_parallel, ac)
        held = [None] * dist.get_world_size()  # every rank's parameter names, to check the cut
        dist.all_gather_object(held, sorted(weights))
        pp = pipeline.pp
        per_pipeline = [name for names in held[:pp] for name in names]
        bad = sorted({n for step in range(STEPS)
                      for n in differing(grads[step], {k: ref_grads[step][k] for k in grads[step]}, 1e-6)})
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, {"grads": bad, "weights": differing(weights, {k: ref_weights[k] for k in weights}, 2e-5),
                                       "losses": losses})
        result = {"model": name, "schedule": schedule, "dp": data_parallel, "ac": ac, "split": pipeline.split,
                  "parameters": len(ref_weights),
                  "cut_exact": sorted(per_pipeline) == sorted(ref_weights),
                  "losses_equal": all(torch.allclose(torch.tensor(r["losses"]), torch.tensor(ref_losses), rtol=1e-5)
                                      for r in every),
                  "grads_differ": sorted({n for r in every for n in r["grads"]}),
                  "weights_differ": sorted({n for r in every for n in r["weights"]})}
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
