"""Does a layout train as one device does? The check of check_layouts.py and of the equivalence tests.

A layout (:class:`utils.layouts.accepted.Layout`: DDP, FSDP, HSDP, tensor and context parallelism on train_mp.py's
mesh, a pipeline schedule on train_pp.py's) is applied to a copy of a model as its script applies it — the same
functions of utils/parallel, in the same order: tensor parallel -> context parallel -> activation checkpointing ->
compile -> FSDP2 or DDP (a pipeline: cut into stages, then AC, compile and data parallelism on each stage) — and
trained for a few steps from the same initial weights on the same global batches as one process (train.py: AC
and compile only). After each backward every gradient is gathered whole (``full_tensor`` of DTensor shards) and
compared with one process's, as are each step's loss (the mean over ranks) and, after the last step, every
weight; the ranks together must hold every parameter (a pipeline's stages).

The measure, per tensor: max |layout - one process| / max |one process| for a gradient (for a weight: / how far
one process moved it; for a loss: / the loss). A layout adds the same terms in another order (over ranks,
microbatches, bands), and fp32 rounds a sum to a few units of 2**-24 of its largest terms, not of its result: an
entry that nearly cancels may differ by all of itself and still be right, so a tensor is measured as a whole,
against its largest entry, and never against less than :data:`FLOOR` of the model's largest. :data:`TOLERANCE`
says how far the differences may go, and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from models import copy_model
from utils.config import APPLIED_BY, KEYS, Config
from utils.parallel.context_parallel import apply_cp
from utils.parallel.distributed import build_mp_mesh, build_pp_mesh
from utils.parallel.domain_parallel import FieldBands, band_loss, field_bands
from utils.parallel.ensemble import Members
from utils.parallel.fsdp import apply_fsdp
from utils.parallel.pipeline_parallel import Pipeline, apply_data_parallel
from utils.parallel.techniques import apply_ac, apply_compile, apply_ddp
from utils.parallel.tensor_parallel import apply_tp
from utils.layouts.accepted import Layout, layout_config
from utils.precision import autocast
from utils.stopping import heartbeat

TOLERANCE = {"loss": 1e-5, "grads": 1e-3, "weights": 5e-2}
"""The largest relative difference that passes, in fp32: of the loss of each step; of each gradient of each step
(max |a - b| / max |b|); of each weight after the last step, against how far one process moved it (AdamW divides
an entry's gradient by its own running size, so rounding in a small entry becomes a larger share of its step).
Chosen between what rounding alone gives and what the bugs the check is for give, as measured on every layout of
the three built-in models (docs/beyond-data-parallel.md, "Check a model's layouts"): rounding reaches 3e-7 for the
losses, 7e-5 for the gradients (SwinIR's last bias on 4 bands: one sum of 10^4 terms split 4 ways) and 3e-3 for
the weights; leaving out a reduction or a halo gives 0.9 to 2.5 for the gradients, 2 to 90 for the weights and
6e-5 to 0.3 for the losses (the weakest witness: a reduction acts in backward, so the first step's loss is right).
Each limit sits an order of magnitude or more above rounding, and below the bugs (the loss's: 6 times)."""
FLOOR = 1e-2
"""A gradient is measured against its own largest entry (a weight against how far it moved), but never against
less than FLOOR x the largest of all the model's gradients at that step (of how far any weight moved). Rounding
follows the size of the terms a gradient sums, not of their sum: SwinIR's LayerNorm biases and relative-position
tables sum terms like the others' into results 1e-4 to 1e-5 of the largest gradient, and the bias of attention's
keys is zero up to rounding (the softmax ignores what adds to every key: 1e-13 where others are 1e-3). A missing
reduction still shows in such a tensor: half of a gradient of 1e-5 of the largest is 5e-4 of the floor."""
ROUNDING = 1e-6
"""A gradient no larger than ROUNDING x the model's largest at every step of one process is zero up to rounding
(fp32 rounds a sum to a few units of 2**-24 of its largest terms): MONAI's convolution biases before an instance
norm, which takes out whatever is added to a whole channel, get 2e-8 of the largest. AdamW divides a gradient by its
own running size, so the steps of such a weight are rounding noise as large as a real step, in one process and in
every layout alike (MONAI's UNet: 1.6 x how far they moved, where its other weights differ by 1e-5): its weight is
judged by its gradients alone, which a layout that loses or halves a real gradient still fails."""
CPU = torch.device("cpu")  # fp32 without TF32, gloo: the same arithmetic on any laptop
LEFT_OUT = {"cp_reduction": "gradients averaged over dp only, not dp x cp (NERSC DL4SCI25's final-norm bug)"}
"""Pieces a layout may leave out on purpose, to see the check catch it (check_layouts.py --left_out)."""

Batches = list[tuple[torch.Tensor, torch.Tensor]]
MakeOptimizer = Callable[[nn.Module], tuple[torch.optim.Optimizer, Optional[torch.optim.lr_scheduler.LRScheduler]]]


@dataclass
class Trace:
    """One run's record on this rank: each step's loss (the mean over all ranks), each step's gradients and the
    weights after the last step, whole, by parameter name (the parameters this rank holds); ``outputs``: each
    step's prediction of this rank's part of the batch, when asked for."""

    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: list[torch.Tensor] = field(default_factory=list)
    detail: str = ""
    """What the layout chose (a pipeline: its split of the units into stages)."""
    dp: tuple[int, int] = (0, 1)
    """(this rank's data-parallel rank, their number): whose samples ``outputs`` are."""
    bands: Optional[FieldBands] = None
    """This rank's band of each field under SwinIR's domain parallelism: ``outputs`` are that band."""
    moved: dict[str, float] = field(default_factory=dict)
    """One process's: how far the steps moved each weight (max |last - first|), the scale of its differences."""


@dataclass
class _Run:
    """A layout applied: what is called, whose parameters are the model's, the loss, this rank's part of a batch."""

    model: Callable
    params: nn.Module
    loss_fn: Callable
    dp: tuple[int, int]
    bands: Optional[FieldBands] = None
    pipeline: Optional[Pipeline] = None
    detail: str = ""
    members: Optional[Members] = None  # --ensemble M: this rank's members of each sample

    def part(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a global batch: its dp rank's samples (and, under bands, its band of each field)."""
        rank, size = self.dp
        per = len(x) // size
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        if self.bands:
            start, stop = self.bands.bounds(x.shape[2])
            s = y.shape[2] // x.shape[2]
            x, y = x[:, :, start:stop], y[:, :, s * start:s * stop]
        return x, y


def adamw(lr: float) -> MakeOptimizer:
    """Plain AdamW at a constant ``lr`` (the tests' optimizer; check_layouts.py builds the config's)."""
    return lambda module: (torch.optim.AdamW(module.parameters(), lr=lr), None)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor's shards (collective over its mesh); a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def with_keys(cfg: Config, keys: dict) -> Config:
    """``cfg`` with config keys replaced, each in its section (unchecked: layout_config checks)."""
    sections: dict[str, dict] = {}
    for key, value in keys.items():
        sections.setdefault(KEYS[key][0], {})[key] = value
    return dataclasses.replace(cfg, **{s: dataclasses.replace(getattr(cfg, s), **kv) for s, kv in sections.items()})


def for_script(cfg: Config, script: str) -> Config:
    """``cfg`` with the keys ``script`` does not apply back at their defaults: one config runs every script's
    layouts here, so a key meant for one (--pp_dp ddp) must not make another refuse its layout."""
    defaults = Config().to_dict()
    return with_keys(cfg, {key: defaults[key] for key, scripts in APPLIED_BY.items() if script not in scripts})


# ------------------------------------------------------------------ the layouts, as the scripts apply them


def _ac_compile(model: nn.Module, cfg: Config) -> nn.Module:
    t = cfg.train
    return apply_compile(apply_ac(model, t.ac), t.compile, t.compile_backend, t.cuda_graphs)


def _single(model, cfg, loss_fn, **_) -> _Run:  # train.py
    model = _ac_compile(model, cfg)
    return _Run(model, model, loss_fn, (0, 1), members=Members(cfg))


def _ddp(model, cfg, loss_fn, **_) -> _Run:  # train_ddp.py: the wrapper is called, the parameters are the model's
    return _Run(apply_ddp(_ac_compile(model, cfg), cfg, CPU), model, loss_fn, (dist.get_rank(), dist.get_world_size()),
                members=Members(cfg))


def _fsdp(model, cfg, loss_fn, **_) -> _Run:  # train_fsdp.py: FSDP over all ranks, or HSDP (cfg's hsdp_replicas)
    model = apply_fsdp(_ac_compile(model, cfg), cfg, CPU)
    return _Run(model, model, loss_fn, (dist.get_rank(), dist.get_world_size()), members=Members(cfg))


def _mp(model, cfg, loss_fn, left_out="", after_cp=None, **_) -> _Run:  # train_mp.py
    d = cfg.dist
    mesh, dp_cp = build_mp_mesh(dist.get_world_size(), d.tp, d.cp, d.parallel_order, CPU, d.ens)
    bands = field_bands(cfg, mesh["cp"])
    model = apply_cp(apply_tp(model, mesh["tp"]), mesh["cp"])
    if after_cp:  # a test's change to the layout (e.g. a piece left out)
        after_cp(model)
    model = apply_fsdp(_ac_compile(model, cfg), cfg, CPU, mesh["dp"] if left_out == "cp_reduction" else dp_cp)
    return _Run(model, model, band_loss(loss_fn, bands), (mesh["dp"].get_local_rank(), mesh["dp"].size()), bands,
                members=Members(cfg, mesh, bands))


def _pp(model, cfg, loss_fn, batch=0, **_) -> _Run:  # train_pp.py
    mesh = build_pp_mesh(dist.get_world_size(), cfg.dist.pp, CPU)
    pipeline = Pipeline(model, cfg, mesh["pp"], CPU, loss_fn, batch // mesh["dp"].size())
    pipeline.parallelize(lambda stage: _ac_compile(stage, cfg))
    pipeline.parallelize(lambda stage: apply_data_parallel(stage, cfg, CPU, mesh))
    return _Run(pipeline, pipeline.local_model(), loss_fn, (mesh["dp"].get_local_rank(), mesh["dp"].size()),
                pipeline=pipeline, detail=f"stages of {pipeline.split} units")


RUNS = {"none": _single, "ddp": _ddp, "fsdp": _fsdp, "hsdp": _fsdp, "mp": _mp, "pp": _pp}


def run_layout(layout: Layout, model: nn.Module, cfg: Config, batches: Batches, loss_fn: Callable,
               make_optimizer: MakeOptimizer, *, left_out: str = "", after_cp: Optional[Callable] = None,
               keep_outputs: bool = False, activations=None) -> Trace:
    """``layout`` applied to a copy of ``model`` and trained on ``batches`` (global batches): this rank's trace.

    Collective when the layout has several ranks; ConfigError (on every rank alike) where its script would
    refuse it. ``left_out``: a key of :data:`LEFT_OUT`; ``after_cp(model)``: called after context parallelism;
    ``activations``: a utils.memory.measure.SavedTensorBytes counting the first step's forward and loss.
    """
    cfg = layout_config(for_script(cfg, layout.script), layout)
    run = RUNS[layout.strategy](copy_model(model), cfg, loss_fn, left_out=left_out, after_cp=after_cp,
                                batch=len(batches[0][0]))
    optimizer, scheduler = make_optimizer(run.params)
    several = layout.world > 1
    trace = Trace(detail=run.detail, dp=run.dp, bands=run.bands)
    for step, (x, y) in enumerate(batches):
        x, y = run.part(x, y)
        samples = [run.dp[0] * len(x) + i for i in range(len(x))]  # their places in the global batch (``part``)
        optimizer.zero_grad(set_to_none=True)
        with activations.counting(step == 0) if activations else contextlib.nullcontext():
            if run.pipeline:  # forward and backward of every microbatch; the loss shared by the pipeline's ranks
                loss, pred = run.pipeline.step(x, y), None
            else:
                with autocast(CPU, cfg.train.amp_dtype):
                    pred = run.model(run.members.inputs(x, step, samples))  # --ensemble: the members' inputs
                loss = run.loss_fn(run.members.gather(pred.float()), y)  # in fp32, as the scripts compute it
        if not run.pipeline:
            loss.backward()
        loss = loss.detach().clone()
        if several:  # replicas hold their samples' losses; a replica's tp x cp ranks the same (or band shares)
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        trace.losses.append(loss.item())
        trace.grads.append({name: whole(p.grad).clone() if p.grad is not None else torch.zeros(p.shape)
                            for name, p in run.params.named_parameters() if p.requires_grad})
        if keep_outputs and pred is not None:
            trace.outputs.append(pred.detach().float())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        heartbeat()  # a step done: the step watchdog's deadline (check_layouts.py's ranks) starts again
    trace.weights = {name: whole(p.detach()).clone() for name, p in run.params.named_parameters() if p.requires_grad}
    return trace


def one_process(model: nn.Module, cfg: Config, batches: Batches, loss_fn: Callable, make_optimizer: MakeOptimizer,
                precision: str = "fp32", keep_outputs: bool = False) -> Trace:
    """The reference: train.py's steps on one process (rank 0 computes, every rank gets it; collective)."""
    reference = Layout("train.py", "none", world=1, ac=cfg.train.ac, precision=precision, batch_size=len(batches[0][0]))
    trace = [run_layout(reference, model, cfg, batches, loss_fn, make_optimizer, keep_outputs=keep_outputs)
             if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if trace[0] is not None:  # ``model`` itself is untouched (run_layout trains a copy): the first weights
        trace[0].moved = {name: (trace[0].weights[name] - p.detach()).abs().max().item()
                          for name, p in model.named_parameters() if p.requires_grad}
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(trace)
    return trace[0]


# ------------------------------------------------------------------ the comparison


def relative(a: torch.Tensor, b: Optional[torch.Tensor], scale: Optional[float] = None, floor: float = 0.0) -> float:
    """max |a - b| / max(scale, floor), ``scale`` by default max |b|: inf where b is missing, of another shape,
    or the result is not a number."""
    if b is None or a.shape != b.shape:
        return math.inf
    empty = not b.numel()
    scale = max(0.0 if empty else b.abs().max().item() if scale is None else scale, floor)
    diff = 0.0 if empty else (a - b).abs().max().item()
    value = diff / scale if scale else (0.0 if diff == 0 else math.inf)
    return value if value == value else math.inf


def _largest(tensors: dict[str, torch.Tensor]) -> float:
    return max((t.abs().max().item() for t in tensors.values() if t.numel()), default=0.0)


@dataclass
class Comparison:
    """One layout against one process: the largest relative difference of the loss over the steps, of each
    parameter's gradient over the steps and of its weight after the last step; the parameters no rank holds."""

    loss: float
    grads: dict[str, float]
    weights: dict[str, float]
    missing: list[str]
    parameters: int
    detail: str = ""
    rounding: list[str] = field(default_factory=list)
    """The parameters whose gradients are zero up to rounding (:data:`ROUNDING`): their weights are not compared."""

    def worst(self, kind: str) -> tuple[str, float]:
        """(name, difference) of the worst gradient ("grads") or weight ("weights")."""
        values = getattr(self, kind)
        name = max(values, key=values.get)
        return name, values[name]

    def differing(self, kind: str, tolerance: dict = TOLERANCE) -> list[str]:
        """The gradients ("grads") or weights ("weights") over the tolerance, by name."""
        return sorted(name for name, value in getattr(self, kind).items() if value > tolerance[kind])

    def passed(self, tolerance: dict = TOLERANCE) -> bool:
        return (self.loss <= tolerance["loss"] and not self.missing and not self.differing("grads", tolerance)
                and not self.differing("weights", tolerance))

    def summary(self, tolerance: dict = TOLERANCE) -> dict:
        """The comparison as JSON: the verdict, the worst gradient and weight, every one over the tolerance."""
        (grad, grad_value), (weight, weight_value) = self.worst("grads"), self.worst("weights")
        return {"passed": self.passed(tolerance), "loss": self.loss, "grad": grad_value, "worst_grad": grad,
                "weight": weight_value, "worst_weight": weight, "grads_differ": self.differing("grads", tolerance),
                "weights_differ": self.differing("weights", tolerance), "missing": self.missing,
                "parameters": self.parameters, "detail": self.detail, "rounding": self.rounding}


def compare(trace: Trace, reference: Trace) -> Comparison:
    """``trace`` (this rank's) against one process's, every rank's parameters together (collective)."""
    grads: dict[str, float] = {}
    for mine, theirs in zip(trace.grads, reference.grads, strict=True):
        floor = FLOOR * _largest(theirs)
        for name, grad in mine.items():
            grads[name] = max(grads.get(name, 0.0), relative(grad, theirs.get(name), floor=floor))
    floor = FLOOR * max(reference.moved.values(), default=0.0)
    rounding = sorted(name for name in reference.weights
                      if all(step[name].abs().max() <= ROUNDING * _largest(step) for step in reference.grads))
    weights = {name: relative(w, reference.weights.get(name), reference.moved.get(name, 0.0), floor)
               for name, w in trace.weights.items() if name not in rounding}
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, (grads, weights))
        for rank_grads, rank_weights in every:
            for mine, theirs in ((grads, rank_grads), (weights, rank_weights)):
                for name, value in theirs.items():
                    mine[name] = max(mine.get(name, 0.0), value)
    loss = max(relative(torch.tensor(a), torch.tensor(b)) for a, b in zip(trace.losses, reference.losses, strict=True))
    held = set(grads)  # every rank's parameters (a gradient each), their weights compared or not
    return Comparison(loss, grads, weights, sorted(set(reference.weights) - held), len(reference.weights),
                      trace.detail, rounding)
