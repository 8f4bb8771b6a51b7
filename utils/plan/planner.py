"""The plan: every layout the scripts accept (utils/layouts/accepted.py), its memory per GPU (utils/memory/estimate.py)
and its step (utils/plan/speed.py) on a cluster (utils/plan/clusters.py), ranked; and the command that runs it.

Ranking: layouts that fit first, then by predicted samples/s (within 1 %, the simpler layout first: DDP, FSDP,
HSDP, tp/cp, pp), then by memory per GPU. A layout fits when its
estimate stays within 95 % of the GPU's memory: the CUDA context and the caching allocator's fragmentation are
not in the estimate, and the 5 % are kept for them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shlex
from dataclasses import dataclass
from typing import Optional

import torch

from models import fixed_input_size
from utils.config import Config, ConfigError
from utils.memory.estimate import GB, MemoryEstimate, estimate_memory
from utils.memory.measure import build_for_measurement, loss_for, random_batch, time_training_step
from utils.memory.shapes import has_description, input_size, model_shape
from utils.memory.traced import CannotTrace, estimate_traced
from utils.observe.flops import train_flops_per_sample
from utils.plan.clusters import CPU_EFFICIENCY, THIS_MACHINE, Cluster, measured_efficiency, remember_efficiency
from utils.layouts.accepted import Layout, enumerate_layouts, layout_config, meta_model
from utils.plan.speed import AC_RECOMPUTE, Speed, predict_speed

USABLE = 0.95  # of a GPU's memory; the rest for what the estimate leaves out (see the module docstring)
STRATEGY = {"none": "none", "ddp": "ddp", "fsdp": "fsdp", "hsdp": "fsdp", "mp": "fsdp", "pp": "fsdp"}
SIMPLER = ["none", "ddp", "fsdp", "hsdp", "mp", "pp"]


@dataclass
class Row:
    """One layout of the plan: its memory and speed, and the command that runs it."""

    layout: Layout
    estimate: MemoryEstimate
    speed: Speed
    memory_bytes: float  # of the cluster's GPU
    command: str

    @property
    def gb(self) -> float:
        return self.estimate.total / GB

    @property
    def fits(self) -> bool:
        return self.estimate.total <= USABLE * self.memory_bytes

    @property
    def margin_gb(self) -> float:
        return (USABLE * self.memory_bytes - self.estimate.total) / GB

    @property
    def limited_by(self) -> str:
        if not self.fits:
            return "memory"
        ac_extra = self.speed.compute_s * (1 - 1 / AC_RECOMPUTE) if self.layout.ac != "none" else 0.0
        return self.speed.limited_by(ac_extra)

    def to_json(self) -> dict:
        return {**self.layout.keys(), "script": self.layout.script, "layout": self.layout.name(),
                "micro_batch_per_gpu": self.layout.micro_batch, "fits": self.fits,
                "gb_per_gpu": round(self.gb, 3), "margin_gb": round(self.margin_gb, 3),
                "samples_per_sec": round(self.speed.samples_per_sec, 4), "step_s": round(self.speed.step_s, 6),
                "scaling_efficiency": round(self.speed.efficiency, 4), "limited_by": self.limited_by,
                "compute_s": round(self.speed.compute_s, 6), "exposed_comm_s": round(self.speed.exposed_s, 6),
                "bubble_s": round(self.speed.bubble_s, 6),
                "comm_s": {k: round(v, 6) for k, v in self.speed.terms.items()}, "command": self.command}


def model_facts(cfg: Config) -> tuple[float, list[int], int]:
    """(FLOPs of one training step per sample, fp32 gradient bytes per tensor in backward's order, units a pipeline
    may cut) of the config's model, counted on the meta device."""
    flops = train_flops_per_sample(lambda: meta_model(cfg), (cfg.model.in_chans, *input_size(cfg)))
    flops *= cfg.train.ensemble  # --ensemble M: a sample's every member, a forward and a backward each
    grads = [4 * p.numel() for p in meta_model(cfg).parameters() if p.requires_grad][::-1]
    shape = model_shape(cfg.model, cfg.target_chans) if has_description(cfg.model) else None  # (no pipeline without one)
    units = len(shape.pipeline_units()[0]) if shape is not None else 0
    return flops, grads, units


CALIBRATE_MAX_S = 5.0  # longest one-process step plan.py times on this machine (else the configured efficiency)


def calibrated(cluster: Cluster, cfg: Config, flops: float, world: int) -> Cluster:
    """``this-machine`` with the efficiency of the config's own training step, per precision: one process with one
    thread (as torchrun runs each) times a step at the micro-batch of pure data parallelism (cached)."""
    if cluster.name != THIS_MACHINE:  # (a cluster file's own figures are the user's)
        return cluster
    batch = max(1, cfg.train.batch_size // world)
    efficiency = {m: dict(p) for m, p in cluster.efficiency.items()}
    for precision, amp in (("fp32", "none"), ("bf16", "bf16")):
        model = hashlib.sha1(json.dumps(dataclasses.asdict(cfg.model), sort_keys=True).encode()).hexdigest()[:12]
        key = f"{cfg.model.model} {model} {amp} batch {batch}"  # the model section's hash: its size and shape
        value = measured_efficiency(key)
        if value is None and flops * batch / (cluster.peak_flops[precision] * CPU_EFFICIENCY) < CALIBRATE_MAX_S:
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                step_cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, amp_dtype=amp, ac="none"))
                lr, hr = random_batch(step_cfg, batch=batch)
                seconds = min(time_training_step(build_for_measurement(step_cfg), lr, hr, amp, loss_for(step_cfg),
                                                 steps=2, warmup=1))
            finally:
                torch.set_num_threads(threads)
            value = flops * batch / seconds / cluster.peak_flops[precision]
            remember_efficiency(key, value)
        if value is not None:
            efficiency.setdefault(cfg.model.model, {})[precision] = value
    return dataclasses.replace(cluster, efficiency=efficiency)


def command(cfg: Config, layout: Layout, cluster: Cluster, nodes: int, user_args: list[str]) -> str:
    """The command line that runs ``layout``: the config, the user's own overrides, and the keys the layout
    changes from the config's values."""
    values = cfg.to_dict()
    keys = {k: v for k, v in layout.keys().items() if k != "strategy" and values.get(k) != v}
    if cluster.device == "cpu":
        launch = "python" if layout.world == 1 else f"torchrun --standalone --nproc-per-node {layout.world}"
    else:
        launch = f"{cluster.submit_line(nodes)} submit_multinode.sh"
    args = ["--config", cfg.name, *user_args]
    for key, value in keys.items():
        if f"--{key}" in args:  # the layout's value instead of the user's
            index = args.index(f"--{key}")
            del args[index: index + 2]
        args += [f"--{key}", str(value)]
    return f"{launch} {layout.script} {shlex.join(args)}"


def plan(cfg: Config, cluster: Cluster, nodes: int, batch_sizes: Optional[list[int]] = None,
         user_args: Optional[list[str]] = None) -> list[Row]:
    """Every accepted layout of ``cfg`` on ``nodes`` nodes of ``cluster``, ranked (see the module docstring)."""
    if nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {nodes}")
    world = nodes * cluster.gpus_per_node
    flops, grads, units = model_facts(cfg)
    cluster = calibrated(cluster, cfg, flops, world)
    rows = []
    for layout, layout_cfg in enumerate_layouts(cfg, world, cluster.gpus_per_node, units, batch_sizes):
        try:
            rows.append(_row(cfg, layout, layout_cfg, cluster, nodes, flops, grads, user_args))
        except CannotTrace:  # the model itself: one line for the whole plan
            raise
        except ConfigError:  # the batch over dp, the bands, tp/cp/pp untraced: what the scripts (or estimate) refuse
            continue
    # Within 1 % of each other (the model's resolution at best), the simpler layout first, then the smaller one.
    rows.sort(key=lambda r: (not r.fits, -round(math.log(r.speed.samples_per_sec) / math.log(1.01)),
                             SIMPLER.index(r.layout.strategy), r.gb))
    return rows


def _row(cfg: Config, layout: Layout, layout_cfg: Config, cluster: Cluster, nodes: int, flops: float, grads: list[int],
         user_args) -> Row:
    """One layout's memory, step and command (ConfigError where the estimate refuses it)."""
    if not layout.runs_here:  # a publication's layout: DDP over dp beside tp/cp, tp without sequence parallelism
        memory = estimate_memory(layout_cfg, layout.world, "ddp" if layout.ddp_beside_mp else STRATEGY[layout.strategy],
                                 device_type=cluster.device, sequence_parallel=layout.sequence_parallel,
                                 ddp_beside_mp=layout.ddp_beside_mp)
        run = "(not run by this project's scripts: a published layout, modelled)"
    else:  # a model without a hand-written description: each layout's step traced on fake tensors (a second or two)
        estimate = estimate_memory if has_description(cfg.model) else estimate_traced
        memory = estimate(layout_cfg, layout.world, STRATEGY[layout.strategy], device_type=cluster.device)
        run = command(cfg, layout, cluster, nodes, list(user_args or []))
    speed = predict_speed(layout, layout_cfg, cluster, flops, grads)
    return Row(layout, memory, speed, cluster.memory_bytes, run)


def plan_layout(cfg: Config, cluster: Cluster, nodes: int, layout: Layout) -> Row:
    """The plan of one layout given in full (its world, batch, precision, ac, tp/cp/pp), also one the scripts do
    not run but a publication did (``Layout.ddp_beside_mp``, ``sequence_parallel`` False): what
    benchmarks/plan_vs_published.py compares with each published figure, like with like."""
    world = nodes * cluster.gpus_per_node
    if layout.world != world:
        raise ConfigError(f"the layout has {layout.world} ranks, {nodes} node(s) of {cluster.name} {world}")
    flops, grads, _ = model_facts(cfg)
    cluster = calibrated(cluster, cfg, flops, world)
    layout_cfg = layout_config(cfg, layout)
    return _row(cfg, dataclasses.replace(layout, overrides=layout.keys()), layout_cfg, cluster, nodes, flops, grads,
                None)


def why_it_wins(rows: list[Row]) -> str:
    """One line: what the winner gains over the runner-up of another kind (or the fastest that does not fit)."""
    best = rows[0]
    others = [r for r in rows[1:] if r.fits and r.layout.strategy != best.layout.strategy]
    faster = [r for r in rows if not r.fits and r.speed.samples_per_sec > best.speed.samples_per_sec]
    text = (f"{best.layout.name()} ({best.layout.precision}, ac {best.layout.ac}) wins: it fits with "
            f"{best.margin_gb:.1f} GB to spare and is limited by {best.limited_by}")
    if others:
        ratio = best.speed.samples_per_sec / others[0].speed.samples_per_sec
        text += f"; {ratio:.2f}x the samples/s of the best {others[0].layout.strategy} layout ({others[0].layout.name()})"
    if faster:
        text += f"; {faster[0].layout.name()} would be faster but needs {faster[0].gb:.1f} GB"
    return text


def what_would_fit(cfg: Config, cluster: Cluster, nodes: int, rows: list[Row], batch_sizes, user_args) -> str:
    """One line when nothing fits: the smallest footprint found, and what would make it fit."""
    if not rows:
        return "no layout of this config is accepted by the scripts on this cluster: check the config's batch_size"
    smallest = min(rows, key=lambda r: r.gb)
    fixes = []
    for more in (2, 4, 8, 16):
        bigger = plan(cfg, cluster, nodes * more, batch_sizes, user_args)
        if bigger and bigger[0].fits:
            fixes.append(f"{nodes * more} nodes ({bigger[0].layout.name()}, {bigger[0].gb:.1f} GB)")
            break
    if fixed_input_size(cfg.model) is None and cfg.data.crop_size:
        fixes.append(f"a smaller crop (--crop_size {cfg.data.crop_size // 2})")
    elif cfg.train.batch_size > 1:
        fixes.append(f"a smaller global batch (--batch_size {cfg.train.batch_size // 2})")
    return (f"nothing fits {cluster.memory_bytes / GB:.0f} GB per GPU on {nodes} node(s): the smallest footprint is "
            f"{smallest.gb:.1f} GB ({smallest.layout.name()}, {smallest.layout.precision}, ac {smallest.layout.ac}); "
            f"it would fit with {' or '.join(fixes) or 'a smaller model'}")
