"""Every layout the training scripts accept for a config on N GPUs: data, sharded, tensor, context and pipeline
parallelism, activation checkpointing and precision.

A :class:`Layout` is the config keys one run sets (``strategy``, ``tp``, ``cp``, ``ens``, ``pp``, ``pp_schedule``,
``pp_microbatches``, ``ac``, ``amp_dtype``, ``param_dtype``, ``hsdp_replicas``) and the script that runs them.
:func:`enumerate_layouts` proposes the combinations and keeps those that pass the checks the scripts themselves
make — the config's validation (heads divisible by tp, ...), which script applies which key
(``refuse_unapplied``), the meshes (``mp_mesh_layout``, ``fsdp.mesh_shape``), the model's plan (its
spec: models/spec.py), the bands (``band_rows``, ``band_bounds`` through the memory estimate) and the
pipeline (``check_pipeline``) — called, not copied, so a layout the plan proposes is one the script runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

from utils.config import Config, ConfigError, refuse_unapplied, validate
from utils.memory.measure import model_on_meta
from utils.parallel.distributed import mp_mesh_layout
from utils.parallel.domain_parallel import check_band_loss
from utils.parallel.fsdp import mesh_shape
from utils.parallel.pipeline_parallel import STAGES_PER_RANK, check_pipeline
from utils.parallel.plans import FieldPlan, ModelPlan, config_plan, model_plan

SCHEDULES = tuple(STAGES_PER_RANK)
PRECISIONS = {  # name -> (amp_dtype, param_dtype): fp32; bf16 autocast; bf16 parameters (FSDP2's policy) + autocast
    "fp32": ("none", "fp32"), "bf16": ("bf16", "fp32"), "bf16 params": ("bf16", "bf16")}


@dataclass(frozen=True)
class Layout:
    """One way to run a config on ``world`` ranks: what it sets, and the script that applies it."""

    script: str
    strategy: str  # none (one device), ddp, fsdp, hsdp (train_fsdp.py), mp (train_mp.py), pp (train_pp.py)
    world: int
    tp: int = 1
    cp: int = 1
    ens: int = 1  # ranks sharing each sample's ensemble members (train_mp.py --ens)
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    hsdp_replicas: int = 1
    ac: str = "none"
    precision: str = "fp32"
    batch_size: int = 1  # global
    # Published runs' layouts, which no script here runs (plan.py models them when given in full: plan_layout):
    ddp_beside_mp: bool = False  # tp/cp with DDP over dp (NERSC's train_mp), not FSDP2
    sequence_parallel: bool = True  # False: tp keeps the residual stream and the norms whole on every tp rank
    overrides: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.ens * self.pp)

    @property
    def runs_here(self) -> bool:
        """Whether this project's scripts run the layout (else it is a publication's, modelled only)."""
        return not self.ddp_beside_mp and self.sequence_parallel

    @property
    def micro_batch(self) -> int:
        """Samples per GPU per step (a pipeline's per microbatch)."""
        per_replica = self.batch_size // self.dp
        return per_replica // self.pp_microbatches if self.pp > 1 else per_replica

    def keys(self) -> dict:
        """The config keys this layout sets (what --json prints, and the command passes)."""
        amp, param = PRECISIONS[self.precision]
        keys = {"strategy": self.strategy, "tp": self.tp, "cp": self.cp, "ens": self.ens, "pp": self.pp, "ac": self.ac,
                "amp_dtype": amp, "param_dtype": param, "batch_size": self.batch_size}
        if self.pp > 1:
            keys.update(pp_schedule=self.pp_schedule, pp_microbatches=self.pp_microbatches)
        if self.hsdp_replicas > 1:
            keys["hsdp_replicas"] = self.hsdp_replicas
        return keys

    def name(self) -> str:
        parts = [f"dp{self.dp}"] if self.dp > 1 or self.world == 1 else []
        parts += [f"{k}{v}" for k, v in (("ens", self.ens), ("tp", self.tp), ("cp", self.cp), ("pp", self.pp)) if v > 1]
        label = " x ".join(parts)
        if self.strategy in ("fsdp", "hsdp"):
            label += f" {self.strategy.upper()}" + (f"({self.hsdp_replicas} replicas)" if self.hsdp_replicas > 1 else "")
        elif self.strategy == "ddp" or self.ddp_beside_mp:
            label += " DDP"
        if not self.sequence_parallel:
            label += " no SP"
        if self.pp > 1:
            label += f" {self.pp_schedule} m{self.pp_microbatches}"
        return label


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


meta_model = model_on_meta  # (utils/memory/measure.py: the estimate builds it too)


def plan_of(cfg: Config) -> ModelPlan:
    """The model's plan (its spec: models/spec.py)."""
    return model_plan(meta_model(cfg))


def _candidates(cfg: Config, world: int, gpus_per_node: int, batch_sizes: list[int], n_units: int,
                plan: ModelPlan) -> Iterator[Layout]:
    nodes = max(1, world // gpus_per_node)
    units = [u for u in ("none", "block", "layer") if u == "none" or u in plan.units]
    for batch in batch_sizes:
        for ac in units:
            for precision in PRECISIONS:
                common = dict(world=world, ac=ac, precision=precision, batch_size=batch)
                if world == 1:
                    if precision != "bf16 params":  # FSDP2's policy: not train.py's
                        yield Layout("train.py", "none", **common)
                    continue
                if precision != "bf16 params":
                    yield Layout("train_ddp.py", "ddp", **common)
                yield Layout("train_fsdp.py", "fsdp", **common)
                if nodes > 1:
                    yield Layout("train_fsdp.py", "hsdp", hsdp_replicas=nodes, **common)
                for tp in _divisors(gpus_per_node) if plan.tp else [1]:  # tensor parallelism stays in a node
                    for cp in _divisors(world // tp) if plan.cp else [1]:
                        for ens in _divisors(math.gcd(cfg.train.ensemble, world // (tp * cp))):  # members on ranks
                            if tp * cp * ens > 1:
                                yield Layout("train_mp.py", "mp", tp=tp, cp=cp, ens=ens, **common)
                if plan.stages:
                    for pp in _divisors(world)[1:]:
                        for schedule in SCHEDULES:
                            stages = pp * STAGES_PER_RANK[schedule]
                            if stages > n_units:
                                continue
                            for m in sorted({pp, 2 * pp, 4 * pp, 8 * pp}):
                                yield Layout("train_pp.py", "pp", pp=pp, pp_schedule=schedule, pp_microbatches=m,
                                             **common)


def layout_config(cfg: Config, layout: Layout) -> Config:
    """``cfg`` with the layout's keys, checked as the layout's script checks them (ConfigError if it refuses)."""
    amp, param = PRECISIONS[layout.precision]
    train = dataclasses.replace(cfg.train, ac=layout.ac, amp_dtype=amp, batch_size=layout.batch_size)
    dist = dataclasses.replace(cfg.dist, tp=layout.tp, cp=layout.cp, ens=layout.ens, pp=layout.pp,
                               pp_schedule=layout.pp_schedule,
                               pp_microbatches=layout.pp_microbatches if layout.pp > 1 else cfg.dist.pp_microbatches,
                               param_dtype=param, hsdp_replicas=layout.hsdp_replicas)
    new = dataclasses.replace(cfg, train=train, dist=dist)
    validate(new)  # the config's own checks, the model spec's among them (a built-in model's heads % tp, ...)
    refuse_unapplied(new, layout.script)  # keys the script would ignore
    if layout.strategy == "mp":
        mp_mesh_layout(layout.world, layout.tp, layout.cp, new.dist.parallel_order, layout.ens)
        if layout.cp > 1 and isinstance(config_plan(new.model).cp, FieldPlan):
            check_band_loss(new)
    if layout.strategy == "hsdp":
        mesh_shape(layout.world, layout.hsdp_replicas)
    return new


def enumerate_layouts(cfg: Config, world: int, gpus_per_node: int, n_units: int,
                      batch_sizes: Optional[list[int]] = None) -> Iterator[tuple[Layout, Config]]:
    """(layout, its config) for every layout of ``cfg`` on ``world`` ranks that the scripts accept; ``n_units``:
    the units a pipeline may cut (the model's blocks or RSTBs); ``batch_sizes``: global batches (default: the
    config's). The memory estimate checks the rest (the batch over dp, the bands): plan.py drops what it refuses."""
    plan = plan_of(cfg)
    for layout in _candidates(cfg, world, gpus_per_node, batch_sizes or [cfg.train.batch_size], n_units, plan):
        try:
            layout_cfg = layout_config(cfg, layout)
            if layout.pp > 1:
                check_pipeline(layout_cfg, layout.pp, layout.batch_size // layout.dp, n_units)
        except ConfigError:
            continue
        yield dataclasses.replace(layout, overrides=layout.keys()), layout_cfg
