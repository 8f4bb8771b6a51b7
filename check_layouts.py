"""Does every layout of a model train as one device does? Checked on a laptop, in one command, before GPU hours.

    python check_layouts.py --config vit_quickstart --model_args.depths '[4]'   # the ViT: every layout, 4 CPU processes
    python check_layouts.py --config quickstart \
        --model_args "{depths: [1,1,1,1], num_heads: [2,2,2,2]}"                # SwinIR: 4 RSTBs
    python check_layouts.py --config unet3d_quickstart --crop_size 16   # the U-Net: DDP, FSDP, HSDP only
    python check_layouts.py --config_file my_model.yaml --config my_model --nproc 2
    python check_layouts.py --config vit_quickstart --only cp --left_out cp_reduction   # also cp without it: FAIL
    python check_layouts.py --config vit_quickstart --ensemble 4 --loss crps --nproc 2  # members on ens 2 (Part V)

It starts --nproc CPU processes itself (gloo; torchrun's variables, so `torchrun --nproc-per-node 4
check_layouts.py ...` works too) and runs every layout the model's plan (utils/parallel/plans.py: model_plan)
supports — DDP, FSDP and HSDP; where the plan has them, tensor parallel (tp), context parallel (cp), both, and a
pipeline (pp) with each schedule; with --ensemble M, the members shared out over ens ranks — through the functions and in the order of its training script
(utils/layouts/equivalence.py). Each trains a copy of the same initial weights for --steps AdamW steps (the
config's optimizer, without warm-up) on the same random global batches, shaped as the config's task feeds the
model (sr: low-res fields in, img_size x upscale out; forecast: img_size fields in and out; volume: crop_size
cubes); one process trains them too. The table gives, per layout, the largest relative difference from one
process of the loss, of every gradient (the worst parameter named) and of the weights after the last step, and
PASS or FAIL against the tolerance (fp32; the numbers and why: utils/layouts/equivalence.py, TOLERANCE).
Layouts the plan lacks are listed as such, and a layout its script refuses for this config says why; neither
fails. --left_out runs each layout that has the piece once more without it, which must FAIL. Exit 0 when every
layout that ran equals one process (and every one with a piece left out does not), 1 otherwise, 2 on bad input.
A hang ends, as in the training scripts: each rank runs their step watchdog (utils/stopping.py: a step that has not
moved for 1.5 --dist_timeout_s ends the rank, naming the ranks that did not arrive), and the launcher ends every
rank once one has not moved for 1.75 of it (a rank frozen whole cannot end itself), with one line naming it: the
check ends within twice --dist_timeout_s of a hang (exit 1).

The model is whatever models.build_model builds from the config, so a model of your own is checked the same
way. The check is in fp32 and without random layers: --amp_dtype, --param_dtype and --reduce_dtype stay fp32,
and a model argument drop_path_rate (stochastic depth) is set to 0 (each layout would draw other masks). Any
config key can be overridden as in the training scripts (`python check_layouts.py --help` lists them).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from models import build_model
from utils.config import Config, ConfigError, parse_config
from utils.memory.measure import with_statistics
from utils.parallel.distributed import cleanup_distributed, init_distributed
from utils.parallel.plans import model_plan
from utils.layouts.equivalence import LEFT_OUT, TOLERANCE, compare, one_process, run_layout, with_keys
from utils.layouts.accepted import SCHEDULES, Layout
from utils.stopping import StepWatchdog, stop_watching
from utils.training import build_loss, build_optimizer, exit_process, run_cli, scaled_lr

TECHNIQUES = ("ddp", "fsdp", "hsdp", "tp", "cp", "ens", "pp")
WATCH_VARIABLE = "CHECK_LAYOUTS_WATCH_DIR"
"""The launcher's folder, given to its ranks: each rank's step watchdog writes its stack there (if it hangs) and
touches its beat file there at every step, which the launcher watches."""
SILENCE_FRACTION = 1.75
"""The launcher ends the check once a rank's beat is this many --dist_timeout_s old: after the 1.5 at which a rank's
own watchdog ends it (naming the ranks that did not arrive), so that it acts for a rank that cannot end itself (frozen,
or held where Python cannot run), and before 2, so that the check ends within twice the timeout (exit included)."""
START_S = 60.0
"""Before its first beat a rank also imports torch, joins the others and builds the model: tens of seconds on a
loaded laptop, which a small --dist_timeout_s must not count as a hang."""


def add_arguments(parser) -> None:
    parser.add_argument("--nproc", type=int, default=4, help="CPU processes to start: 4 runs dp 2 x tp 2, dp 2 x "
                        "cp 2, tp 2 x cp 2, dp 2 x pp 2 and 2 x 2 HSDP; 2 runs each technique alone")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps per layout")
    parser.add_argument("--batch", type=int, default=0, help="global batch of each step (default: one sample per "
                        "process)")
    parser.add_argument("--only", type=techniques, default=frozenset(TECHNIQUES), metavar="T,T",
                        help=f"only the layouts made of these techniques, of {','.join(TECHNIQUES)} (tp x cp: both)")
    parser.add_argument("--left_out", choices=sorted(LEFT_OUT), default=None,
                        help="also run each layout that has this piece without it, to see the check FAIL it: "
                             + "; ".join(f"{k}: {v}" for k, v in LEFT_OUT.items()))
    parser.add_argument("--json", action="store_true", help="one JSON object per layout instead of the table")


def techniques(text: str) -> frozenset:
    chosen = frozenset(text.split(","))
    if chosen - set(TECHNIQUES):
        raise argparse.ArgumentTypeError(f"{text!r}: give some of {','.join(TECHNIQUES)}, joined by commas")
    return chosen


def checked(cfg: Config, args, world: int) -> Config:
    """The config the check runs on ``world`` processes; ConfigError (one line) for what it cannot compare."""
    if world < 2 or world % 2:
        raise ConfigError(f"{world} processes: give an even number, 2 or more (--nproc 4 runs every layout)")
    batch = args.batch or world
    if args.steps < 1 or batch < 1 or batch % world:
        raise ConfigError(f"--steps {args.steps}, --batch {batch}: give 1 or more steps, and a batch that the {world} "
                          "processes divide (every rank of a data-parallel layout takes as many samples)")
    low = [f"--{key} {value}" for key, value in (("amp_dtype", cfg.train.amp_dtype), ("param_dtype",
           cfg.dist.param_dtype), ("reduce_dtype", cfg.dist.reduce_dtype)) if value not in ("none", "fp32")]
    if low:
        raise ConfigError(f"check_layouts.py compares in fp32, where rounding is 1e-7 and a missing reduction stands "
                          f"out; bf16's 4e-3 would hide it: drop {' '.join(low)}")
    # The same weights on every rank (statistics where the data would give them), no random masks, and the lr of
    # every step (a warm-up would start it near 0).
    cfg = with_keys(with_statistics(cfg), {"warmup_steps": 0, "batch_size": batch})
    if "drop_path_rate" in cfg.model.model_args:  # stochastic depth, by timm's name for it
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, model_args={**cfg.model.model_args, "drop_path_rate": 0.0}))
    return cfg


def random_batches(cfg: Config, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (input, target) with the shapes the config's task feeds the model, in its
    units: physical fields around the config's mean and std (sr, forecast; diagnostic: each side its own), or the
    stored cubes (volume)."""
    m, task, batch = cfg.model, cfg.data.task, cfg.train.batch_size
    g = torch.Generator().manual_seed(cfg.train.seed)
    if task == "volume":  # utils/data/volume.py stores its fields scaled into the U-Net's tanh range
        side = cfg.data.crop_size
        return [tuple(0.3 * torch.randn(batch, c, side, side, side, generator=g) for c in (m.in_chans, m.out_chans))
                for _ in range(steps)]
    (h, w), s = m.img_hw, m.upscale if task == "sr" else 1
    mean, std, out_mean, out_std = (torch.tensor(v).view(1, -1, 1, 1)
                                    for v in (m.mean, m.std, m.out_mean or m.mean, m.out_std or m.std))
    return [(mean + std * torch.randn(batch, m.in_chans, h, w, generator=g),
             out_mean + out_std * torch.randn(batch, cfg.target_chans, h * s, w * s, generator=g)) for _ in range(steps)]


@dataclass(frozen=True)
class Row:
    """One row of the table: a layout, or why it is not run; ``left_out``: a piece left out on purpose."""

    label: str
    uses: frozenset
    """The techniques of TECHNIQUES it is made of."""
    layout: Optional[Layout] = None
    why: str = ""
    left_out: str = ""


def layouts(plan, world: int, cfg: Config, left_out: str = "") -> list[Row]:
    """The rows for ``world`` processes: every layout, or why the model's plan lacks it; tp, cp, pp and the HSDP
    replicas are 2 unless the config sets them larger. ``left_out``: each layout that has the piece, once more
    without it (cp_reduction: those with cp), right after it."""
    tp, cp, pp, replicas = (max(v, 2) for v in (cfg.dist.tp, cfg.dist.cp, cfg.dist.pp, cfg.dist.hsdp_replicas))
    common = dict(world=world, ac=cfg.train.ac, batch_size=cfg.train.batch_size)
    rows = [Row(layout.name(), frozenset([layout.strategy]), layout) for layout in (
        Layout("train_ddp.py", "ddp", **common), Layout("train_fsdp.py", "fsdp", **common),
        Layout("train_fsdp.py", "hsdp", hsdp_replicas=replicas, **common))]
    lacks = {"tp": "" if plan.tp else "no tensor-parallel plan", "cp": "" if plan.cp else "nothing for cp to split"}
    for sizes in ({"tp": tp}, {"cp": cp}, {"tp": tp, "cp": cp}):
        layout = Layout("train_mp.py", "mp", **sizes, **common)
        why = "; ".join(lacks[k] for k in sizes if lacks[k])
        rows.append(Row(layout.name(), frozenset(sizes), layout, why and f"not in the model's plan ({why})"))
        if left_out == "cp_reduction" and "cp" in sizes and not why:
            rows.append(Row(f"{layout.name()} without {left_out}", frozenset(sizes), layout, left_out=left_out))
    if cfg.train.ensemble > 1:  # --ensemble M --loss crps: the members shared out over ens ranks
        layout = Layout("train_mp.py", "mp", ens=max(cfg.dist.ens, 2), **common)
        rows.append(Row(layout.name(), frozenset(["ens"]), layout))
    if not plan.stages:
        return rows + [Row(f"pp{pp} ({', '.join(SCHEDULES)})", frozenset(["pp"]),
                           why="not in the model's plan (no pipeline cuts)")]
    per_pipeline = cfg.train.batch_size // max(world // pp, 1)
    for schedule in SCHEDULES:  # one microbatch per sample of a pipeline's share of the batch
        layout = Layout("train_pp.py", "pp", pp=pp, pp_schedule=schedule, pp_microbatches=per_pipeline, **common)
        rows.append(Row(layout.name(), frozenset(["pp"]), layout))
    return rows


def launch(nproc: int, timeout_s: float) -> int:
    """This command again as ``nproc`` processes with torchrun's variables; the first failure ends the others, and
    so does a rank whose step has not moved for SILENCE_FRACTION x ``timeout_s`` (the config's dist_timeout_s)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    threads = str(max(1, (os.cpu_count() or 1) // nproc))  # the cores shared out, not oversubscribed
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(f"{tmp}/{rank}.log", "w+") for rank in range(nproc)]
        procs: list[subprocess.Popen] = []
        for r in range(nproc):  # one process group of their own, ended whole (with anything a rank started)
            procs.append(subprocess.Popen(
                [sys.executable, *sys.argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r), WATCH_VARIABLE: tmp},
                stdout=subprocess.PIPE if r == 0 else logs[r], stderr=logs[r], text=True,
                process_group=procs[0].pid if procs else 0))
        # Rank 0 speaks: its table line by line through this process's stdout (whatever that is); the others'
        # output, and rank 0's stderr, are shown if they fail.
        relay = threading.Thread(target=lambda: [print(line, end="", flush=True) for line in procs[0].stdout])
        relay.start()
        first, hung = None, ""  # the first rank seen failing; the line naming a rank that hung
        started = time.monotonic()
        try:
            while first is None and not hung and any(p.poll() is None for p in procs):
                time.sleep(0.05)
                first = next((r for r, p in enumerate(procs) if p.poll() not in (None, 0)), None)
                hung = silent_ranks(procs, Path(tmp) / "stacks", started, timeout_s)
        finally:
            with contextlib.suppress(ProcessLookupError):  # SIGKILL ends a frozen (SIGSTOPped) rank too
                os.killpg(procs[0].pid, signal.SIGKILL)
            relay.join(timeout=10)  # the pipe closes with rank 0; bounded all the same
        codes = [p.wait(timeout=10) for p in procs]
        first = next((r for r, code in enumerate(codes) if code), None) if first is None else first
        if hung:
            print(hung, file=sys.stderr)
        elif first is not None:
            logs[first].seek(0)
            said = logs[first].read()
            print(f"[rank {first}] exited {codes[first]}:\n{said[-4000:]}" if first else said.rstrip(),
                  file=sys.stderr)
        for log in logs:
            log.close()
    return 1 if hung else 0 if first is None else codes[first] if codes[first] > 0 else 1


def silent_ranks(procs: list, stacks: Path, started: float, timeout_s: float) -> str:
    """One line naming the ranks whose step has not moved for SILENCE_FRACTION x ``timeout_s`` (their beat files'
    age, from ``started`` before the first beat, plus START_S), or "" while every live rank moves. Of those, the ranks
    whose watchdog left no stack are the ones that hung: a rank waiting for them writes its stack at 0.8 x."""
    now, limit = time.time(), SILENCE_FRACTION * timeout_s
    ages = {}
    for rank, proc in enumerate(procs):
        beat = stacks / f"rank{rank}.beat"
        with contextlib.suppress(FileNotFoundError):
            ages[rank] = now - beat.stat().st_mtime
        if rank not in ages and proc.poll() is None:
            ages[rank] = time.monotonic() - started - START_S
    silent = [rank for rank, age in ages.items() if age >= limit and procs[rank].poll() is None]
    if not silent:
        return ""
    stack = lambda rank: stacks / f"rank{rank}.txt"  # noqa: E731
    frozen = [rank for rank in silent if stack(rank).is_file() and not stack(rank).stat().st_size]
    named = frozen or silent
    return (f"error: rank{'s' if len(named) > 1 else ''} {', '.join(map(str, named))} hung: no step for "
            f"{max(ages[r] for r in named):.0f} s ({SILENCE_FRACTION:g} x --dist_timeout_s {timeout_s:g}), and "
            f"{'no' if frozen else 'its'} watchdog's stack written (frozen, or held where Python cannot run); every "
            "rank was stopped (a step that is just slow needs a larger --dist_timeout_s)")


def check(cfg: Config, args, world: int, say) -> bool:
    """Every row's layout against one process, said as a table (or JSON) by ``say``: whether all is as it must be
    (every layout equal to one process, every layout with a piece left out not)."""
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank, copied into every layout
    model = build_model(cfg.model)
    batches, loss_fn = random_batches(cfg, args.steps), build_loss(cfg)
    make_optimizer = lambda module: build_optimizer(module, cfg, args.steps, torch.device("cpu"))  # noqa: E731
    rows = [row for row in layouts(model_plan(model), world, cfg, args.left_out or "") if row.uses <= args.only]
    width = max([len(row.label) for row in rows] + [6])
    if not args.json:
        (x, y), t = batches[0], TOLERANCE
        say(f"{type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} parameters), config {cfg.name}, "
            f"task {cfg.data.task}: {world} CPU processes, {args.steps} AdamW steps at lr {scaled_lr(cfg):.1e}, "
            f"batch {tuple(x.shape)} -> {tuple(y.shape)}, fp32")
        say("largest relative difference from one process: max |a - b| / max |b| per tensor (weights: over how far "
            "they moved)")
        say(f"PASS: loss <= {t['loss']:.0e}, gradients <= {t['grads']:.0e}, weights <= {t['weights']:.0e} "
            "(why: utils/layouts/equivalence.py)")
        say(f"{'layout':<{width}}  {'loss':>7}  {'gradients':>9}  {'weights':>7}  verdict  worst gradient")
    reference = one_process(model, cfg, batches, loss_fn, make_optimizer)
    equal, differ, caught, missed, refused, rounding = [], [], [], [], set(), set()
    for row in rows:
        why = row.why
        if row.left_out and row.layout in refused:  # its layout already said why it does not run
            continue
        if not why:
            try:
                comparison = compare(run_layout(row.layout, model, cfg, batches, loss_fn, make_optimizer,
                                                left_out=row.left_out), reference)
            except ConfigError as error:  # the layout's script refuses it for this config, on every rank alike
                why = f"not run: {error}"
                refused.add(row.layout)
        if why:
            say(json.dumps({"layout": row.label, "not_run": why}) if args.json else f"{row.label:<{width}}  {why}")
            continue
        s = comparison.summary()
        ((missed if s["passed"] else caught) if row.left_out else (equal if s["passed"] else differ)).append(row.label)
        rounding.update(s["rounding"])
        detail = "; ".join(([f"no rank holds {', '.join(s['missing'])}"] if s["missing"] else []) + [s["detail"]])
        say(json.dumps({"layout": row.label, "left_out": row.left_out, **s}) if args.json else
            f"{row.label:<{width}}  {s['loss']:7.1e}  {s['grad']:9.1e}  {s['weight']:7.1e}  "
            f"{'PASS' if s['passed'] else 'FAIL':<7}  {s['worst_grad']}"
            + (f"  ({detail.strip('; ')})" if detail.strip("; ") else ""))
    if not args.json:
        if rounding:
            say(f"not compared: the weights of {', '.join(sorted(rounding))}, whose gradients are zero up to rounding "
                "(AdamW's steps on them are rounding noise; utils/layouts/equivalence.py, ROUNDING)")
        say(f"{len(equal)} of {len(equal) + len(differ)} layouts equal one process"
            + (f"; differ: {', '.join(differ)}" if differ else "")
            + (f"; without {args.left_out}, {len(caught)} of {len(caught) + len(missed)} differ, as they must"
               if caught or missed else "")
            + (f" (yet equal: {', '.join(missed)}: this model and batch cannot show its absence)" if missed else ""))
    return not differ and not missed


def main() -> int:
    cfg, args = parse_config(__doc__, extra_args=add_arguments)
    if "RANK" not in os.environ:  # the command as typed: bad input in one line here, then the processes
        checked(cfg, args, args.nproc)
        # The verdict is out and every rank has ended: skip the interpreter's shutdown, seconds of torch's own on a
        # loaded machine, which would count against the bound on the end of a check that hung.
        exit_process(launch(args.nproc, cfg.dist.dist_timeout_s), joined=True)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA starts: CPU processes and gloo (fp32, no TF32)
    env, _ = init_distributed(cfg.dist.dist_timeout_s)
    # The training scripts' step watchdog: a step that does not end within 1.5 dist_timeout_s ends the rank, with
    # the ranks that did not arrive named, whatever it waits for. Stacks in the launcher's folder, else (torchrun)
    # in the run folder, as the training scripts leave them; a run folder made only for them goes again if empty.
    watch = os.environ.get(WATCH_VARIABLE)
    run_dir = Path(cfg.train.run_dir)
    made = [] if watch else [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # innermost first
    StepWatchdog(cfg.dist.dist_timeout_s, watch or cfg.train.run_dir, beats=bool(watch))
    # DTensor warns that a gradient sharded by tp and FSDP is gathered in two steps: the check's own gather, once.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    say = functools.partial(print, flush=True) if env.is_main else lambda *_: None
    ok = check(checked(cfg, args, env.world_size), args, env.world_size, say)
    stop_watching()
    with contextlib.suppress(OSError):  # not empty: a hang's stacks, or another rank's still there
        for folder in made:
            folder.rmdir()
    cleanup_distributed()
    return 0 if ok or not env.is_main else 1  # rank 0's verdict: the launcher passes it on


if __name__ == "__main__":
    run_cli(main)
