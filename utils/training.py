"""Objects every training script builds the same way: device, optimizer and schedule, mixed
precision, loss, and the command-line error handling (evaluation: utils/tasks.py; checkpoint contents:
utils/checkpoint/contents.py).

The training step itself is written out in each script; only the objects it uses come from here, and what
follows it (:class:`Bookkeeping`: log, validate, checkpoint, stop, the epoch's end).
"""

from __future__ import annotations

import faulthandler
import functools
import math
import multiprocessing
import os
import random
import signal
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from models import ModelError

from utils.checkpoint.files import CheckpointError, StorageError
from utils.config import Config, ConfigError, lr_scale
from utils.data.common import STEP_STREAM, DataError, stable_hash
from utils.observe.flops import device_peak_flops, mfu, peak_memory_gb, reset_peak_memory
from utils.observe.logger import MetricsLogger
from utils.parallel.distributed import (DistEnv, all_reduce_max, all_reduce_mean, device_for, joined_job,
                                        read_dist_env)
from utils.stopping import StopRequest, describe_timeout, stop_watching


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite: training stops instead of writing broken weights."""


# ----------------------------------------------------------------------------- device and numerics


def pick_device(choice: str, env: DistEnv = DistEnv()) -> torch.device:
    """``auto``: this process's GPU if CUDA is available, else the CPU."""
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but CUDA is not available: use --device auto or cpu")
    device = device_for(env)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def seed_step(seed: int, step: int, rank: int = 0) -> None:
    """Seed the random draws of one training step (stochastic depth, dropout) from (seed, step, rank).

    Each rank draws its own masks, as the samples of one device's batch do: with one seed for all
    ranks, sample i of every rank would drop the same blocks. And a resumed run repeats the draws
    of the uninterrupted one by construction, with no per-rank RNG state in the checkpoint.
    """
    torch.manual_seed(stable_hash(seed, STEP_STREAM, step, rank))


def configure_backends(cfg: Config) -> None:
    """TF32 for matmuls and convolutions on Ampere+ GPUs (~fp32 range, 10-bit mantissa, several x faster), and
    cuDNN's autotuner for convolutions when the config asks for it."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.allow_tf32 = cfg.train.tf32
        torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark


def relative_l2(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """NERSC's ViT loss: the batch mean of ||pred - target|| / ||target||, norms over each whole sample."""
    pred, target = pred.flatten(1), target.flatten(1)
    return ((pred - target).norm(dim=1) / target.norm(dim=1)).mean()


def l1_with_density(pred: torch.Tensor, target: torch.Tensor, lambda_rho: float) -> torch.Tensor:
    """SC22's U-Net loss: L1, plus lambda_rho x the L1 of channel 0 back in density units (stored as log(rho) / 14)."""
    density = F.l1_loss(torch.exp(14.0 * pred[:, 0]), torch.exp(14.0 * target[:, 0]))
    return F.l1_loss(pred, target) + lambda_rho * density


def crps(members: torch.Tensor, target: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """The almost fair CRPS of AIFS-CRPS (Lang et al. 2024, arXiv:2412.15832, section 2) of ``members`` (M, B, ...)
    against ``target`` (B, ...), averaged over the samples and cells: per cell, with ε = (1 − alpha) / M,

        afCRPS = 1 / (2 M (M − 1)) Σ_j Σ_{k≠j} (|x_j − y| + |x_k − y| − (1 − ε) |x_j − x_k|)
               = mean_j |x_j − y| − (1 − ε) / (2 M (M − 1)) Σ_{j,k} |x_j − x_k|,

    which is alpha × the fair CRPS + (1 − alpha) × the ensemble's plain CRPS. alpha = 1 is the fair CRPS, unbiased for
    the members' distribution; the paper shows it blind where two members coincide (a pair's terms cancel, so nothing
    pushes them apart), and trains with alpha = 0.95, a little of the plain CRPS, which penalises such a pair.
    The pairs' sum is taken over the sorted members, Σ_{j,k} |x_j − x_k| = 2 Σ_i (2i − M + 1) x_(i): M values per
    cell, not M²."""
    m = members.shape[0]
    skill = (members - target).abs().mean(0)
    rank_weight = (2 * torch.arange(m, device=members.device, dtype=members.dtype) - (m - 1))
    pairs = 2 * (rank_weight.view(-1, *[1] * (members.dim() - 1)) * members.sort(dim=0).values).sum(0)
    return (skill - (1 - (1 - alpha) / m) * pairs / (2 * m * (m - 1))).mean()


LOSSES = {"l1": F.l1_loss, "mse": F.mse_loss, "relative_l2": relative_l2, "crps": crps}


def build_loss(cfg: Config) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(pred, target)`` of ``cfg.train.loss`` on physical (B, C, H, W) tensors.

    ``loss_space: normalized`` first standardises each channel with the targets' mean/std (out_mean/out_std where
    they are other channels than the inputs, else mean/std), so a channel in pascals does not outweigh one in
    kelvins (NERSC computes its loss on normalised data).
    """
    base = LOSSES[cfg.train.loss]
    if cfg.train.loss == "crps":  # (members (M, B, C, H, W), target (B, C, H, W)): see utils/parallel/ensemble.py
        base = functools.partial(crps, alpha=cfg.train.crps_alpha)
    if cfg.train.lambda_rho:
        return functools.partial(l1_with_density, lambda_rho=cfg.train.lambda_rho)
    if cfg.train.loss_space == "physical":
        return base
    m = cfg.model
    mean = torch.tensor(m.out_mean or m.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(m.out_std or m.std, dtype=torch.float32).view(1, -1, 1, 1)

    def normalized(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        m, s = mean.to(pred.device), std.to(pred.device)
        return base((pred - m) / s, (target - m) / s)

    return normalized


# ----------------------------------------------------------------------------- optimizer and schedule


def scaled_lr(cfg: Config) -> float:
    """lr for the global batch_size under the lr_scaling rule (NERSC tutorials: sqrt or linear)."""
    return cfg.train.lr * lr_scale(cfg.dist.lr_scaling, cfg.train.batch_size, cfg.dist.base_batch_size)


def build_optimizer(model: nn.Module, cfg: Config, steps_per_epoch: int, device: torch.device):
    """AdamW (Adam when weight_decay is 0), and a per-step schedule: optional linear warm-up, then
    either lr_gamma once per epoch (exponential) or a cosine from lr to 0 at the last step.

    Decaying by ``lr_gamma ** (step // steps_per_epoch)`` is ExponentialLR stepped each epoch,
    written per step so that warm-up fits in and a mid-epoch resume restores it exactly.
    """
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=scaled_lr(cfg),
        betas=tuple(cfg.train.betas),
        weight_decay=cfg.train.weight_decay,
        # One kernel for all parameters (CPU: ~3x faster optimizer step, measured); None = torch's default.
        fused=(device.type in ("cuda", "cpu")) if cfg.train.fused_optimizer else None,
    )
    warmup, gamma, cosine = cfg.dist.warmup_steps, cfg.train.lr_gamma, cfg.train.lr_schedule == "cosine"
    decay_steps = max(total_steps(cfg, steps_per_epoch) - warmup, 1)

    def factor(step: int) -> float:
        if cosine:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1.0 + math.cos(math.pi * min(step - warmup, decay_steps) / decay_steps))
        warm = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        return warm * gamma ** (step // steps_per_epoch)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    if steps_per_epoch == 0:
        raise DataError(
            f"the training split has fewer samples than one global batch ({cfg.train.batch_size}): "
            "lower --batch_size or use more data"
        )
    return cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch


# ----------------------------------------------------------------------------- loop helpers


def check_finite(loss_total: torch.Tensor, step: int, ckpt_dir) -> float:
    """The loss as a float, or stop with NonFiniteLossError (the last good checkpoint stays the latest)."""
    value = loss_total.item()
    if not math.isfinite(value):
        raise NonFiniteLossError(
            f"loss is {value} by step {step}: stopping without saving; the newest checkpoint in {ckpt_dir} "
            "is the last good one. Lower --lr, or use --amp_dtype bf16 instead of fp16")
    return value


def show_progress(mode: str) -> bool:
    return mode == "always" or (mode == "auto" and sys.stdout.isatty())


class Bookkeeping:
    """What every training script does after its step, the same in each: count the loss and the samples, log
    every ``log_every`` steps (loss, lr, samples/s, MFU, peak memory), validate, checkpoint (every ``ckpt_every``
    steps, at the end of an epoch and of the run, on a stop, by the clock), agree with every rank on a stop, and
    roll the epoch over. The script keeps its step, and says how it validates and saves (``validate()``,
    ``save()``: they differ by technique), so that its diff from its predecessor shows only its technique::

        while book.next_epoch():
            for inputs, target in book.batches(train_loader):
                ...  # the step: forward, backward, optimizer
                book.after_step(loss, len(inputs))

    ``replicas``: data-parallel model replicas, each taking ``samples`` per step (1; DDP and FSDP: the world
    size; train_mp.py and train_pp.py: the dp size). Losses are averaged and peak memory is the largest over the
    ranks (no-ops on one process); MFU is that of all the job's devices together. Build it on every rank just
    before the loop: it builds the StopRequest.
    """

    def __init__(self, cfg: Config, state, steps_per_epoch: int, max_steps: int, logger: MetricsLogger, scheduler,
                 validate: Callable[[], None], save: Callable[[], None], flops_per_sample: float,
                 device: torch.device, replicas: int = 1):
        self.cfg, self.state, self.steps_per_epoch, self.max_steps = cfg.train, state, steps_per_epoch, max_steps
        self.logger, self.scheduler, self.validate, self.save = logger, scheduler, validate, save
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.flops_per_sample = flops_per_sample * cfg.train.ensemble  # a sample's every member: a forward, a backward
        self.peak_flops = world * device_peak_flops(device, cfg.train.amp_dtype)  # MFU of all devices together
        self.device, self.replicas = device, replicas
        self.ckpt_dir, self.start_step = f"{cfg.train.run_dir}/checkpoints", state.step
        is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.progress = tqdm(total=max_steps, initial=state.step, unit="step",
                             disable=not (is_main and show_progress(cfg.train.progress)))
        self.loss_sum, self.loss_count = torch.zeros((), device=device), 0  # summed on the device: no sync per step
        self.window_start, self.window_samples = time.perf_counter(), 0
        reset_peak_memory(device)
        self.stopping = StopRequest(cfg)  # SIGTERM or SIGUSR1 on any rank: checkpoint the step, then end the run
        self._loop_ends = False

    @property
    def first_step(self) -> bool:
        """Whether the step being taken is this run's first (a resumed run's: its first after the checkpoint)."""
        return self.state.step == self.start_step

    def next_epoch(self) -> bool:
        """Roll a finished epoch over; whether to train on (steps left, and no stop agreed)."""
        state = self.state
        if state.batch_in_epoch == self.steps_per_epoch:
            state.epoch += 1
            state.batch_in_epoch = 0
        return state.step < self.max_steps and not self.stopping.signal

    def batches(self, loader):
        """The epoch's batches, up to the step after which :meth:`after_step` ends the epoch's loop (the end of the
        epoch or of the run, or a stop); no batch is drawn beyond it."""
        self._loop_ends = False
        for batch in loader:
            yield batch
            if self._loop_ends:
                return

    def after_step(self, loss: torch.Tensor, samples: int) -> None:
        """Count the step just taken, then log, validate, checkpoint and stop as due; end the epoch's loop
        (:meth:`batches`) at the end of the epoch or of the run, or on a stop."""
        state, t = self.state, self.cfg
        state.step += 1
        state.batch_in_epoch += 1
        self.loss_sum += loss.detach()
        self.loss_count += 1
        self.window_samples += samples
        self.progress.update(1)

        end_of_epoch = state.batch_in_epoch == self.steps_per_epoch
        done = state.step == self.max_steps
        if state.step % t.log_every == 0 or done:
            self._log()
        if (t.val_every and state.step % t.val_every == 0) or (not t.val_every and end_of_epoch) or done:
            self.validate()
        stop, due = self.stopping.agreed()  # collective: all ranks stop, or checkpoint by the clock, at one step
        if (t.ckpt_every and state.step % t.ckpt_every == 0) or end_of_epoch or done or stop or due:
            check_finite(all_reduce_mean(self.loss_sum), state.step, self.ckpt_dir)  # never save a diverged step
            self.save()
        if done or stop:
            self.progress.close()  # before the scripts' last lines
        self._loop_ends = end_of_epoch or done or stop

    def _log(self) -> None:
        """The train record of the steps since the last one; one host sync (the loss) per record."""
        state = self.state
        mean_loss = check_finite(all_reduce_mean(self.loss_sum / self.loss_count), state.step, self.ckpt_dir)
        samples_per_sec = self.replicas * self.window_samples / (time.perf_counter() - self.window_start)
        self.logger.log({"kind": "train", "step": state.step, "epoch": state.epoch, "loss": mean_loss,
                         "lr": self.scheduler.get_last_lr()[0], "samples_per_sec": samples_per_sec,
                         "mfu": mfu(self.flops_per_sample, samples_per_sec, self.peak_flops),
                         "peak_mem_gb": all_reduce_max(peak_memory_gb(self.device), self.device)})
        self.progress.set_postfix(loss=f"{mean_loss:.4f}")
        self.loss_sum.zero_()
        self.loss_count, self.window_start, self.window_samples = 0, time.perf_counter(), 0

    def close(self, *records: Optional[dict]) -> None:
        """Close the progress bar, log the run's last ``records`` (a None is none) and close the log."""
        self.progress.close()
        for record in records:
            if record is not None:
                self.logger.log(record)
        self.logger.close()

    def summary(self) -> str:
        """How the run ended (steps, a stop request, the run folder), for its last line."""
        return self.stopping.summary(self.state.step, self.cfg.run_dir)

    @property
    def exit_code(self) -> int:
        return self.stopping.exit_code


# ----------------------------------------------------------------------------- command line


EXIT_CODES = {StorageError: 4, ConfigError: 2, DataError: 2, CheckpointError: 2, ModelError: 2, NonFiniteLossError: 3}
"""Exit code of each expected failure, first match wins (StorageError is a CheckpointError): 2 bad input
(config, data, checkpoint, run directory, a model that cannot be built), 3 the loss diverged, 4 a write failed (disk full, quota, I/O error).
None of them is worth a restart (torchrun --max-restarts): a crash, an OOM kill or a lost node is."""
RANK_ERROR_GRACE_S = 10.0
"""How long a rank other than 0 keeps its error to itself, waiting for the launcher to stop it."""
ERROR_EXIT_BOUND_S = 20.0
"""Beyond that grace, the most a failing rank of a job takes to print its line and exit (naming the ranks that did
not arrive takes 3 s, bounded also when the store's host is frozen): past it faulthandler ends the rank, exit 1."""
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")
"""gloo's words for a collective whose peer process has exited: the error is another rank's consequence."""


def run_cli(main: Callable[[], Optional[int]]) -> None:
    """Run a script's main(); turn expected failures into one line on stderr and a non-zero exit.

    Under torchrun (or srun) an error usually reaches every rank: the same config or data error, a
    full disk under DCP, or rank 0's failure itself, which breaks the other ranks' collectives
    ("Connection closed by peer"). Rank 0 reports (one line and the code alone: no traceback and no
    torchrun error file, which keeps torchrun's own report to its shortest). The other ranks stay
    silent and wait: when rank 0 exits, torchrun's agent stops them with SIGTERM within a fraction of
    a second, and they exit 0 then, so that torchrun lists rank 0's failure only. A rank whose error
    rank 0 did not meet is not stopped: after RANK_ERROR_GRACE_S it reports as "[rank N] error: ..."
    (or its traceback) and exits, which ends the job; rank 0's own collective then breaks, and rank 0
    waits as well rather than adding a traceback that only says a peer has gone.
    """
    try:
        code = main()
    except Exception as error:
        stop_watching()  # SIGTERM back to its default: the failing-rank logic below relies on it
        if joined_job():  # whatever the failure path below waits for, the rank still ends (stacks to stderr)
            faulthandler.dump_traceback_later(RANK_ERROR_GRACE_S + ERROR_EXIT_BOUND_S, exit=True)
        env = read_dist_env()
        timeout = describe_timeout(error)
        if timeout:  # a rank stopped answering: a failure worth a restart (exit 1), said by rank 0 if it is alive
            line, missing = timeout
            if env.rank != 0 and 0 not in missing:
                _wait_to_be_stopped()
            print(f"[rank {env.rank}] error: {line}", file=sys.stderr, flush=True)
            exit_process(1)
        lost_a_peer = isinstance(error, getattr(torch.distributed, "DistNetworkError", ())) or any(
            words in str(error) for words in PEER_LOST)
        if env.world_size > 1 and (env.rank != 0 or lost_a_peer):
            _wait_to_be_stopped()
        code = next((value for kind, value in EXIT_CODES.items() if isinstance(error, kind)), None)
        if code is None:
            raise  # a bug: its traceback
        print(f"{f'[rank {env.rank}] ' if env.rank else ''}error: {error}", file=sys.stderr, flush=True)
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0:
            # torchrun would restart the workers, which would fail the same way (bad input, a diverged
            # loss, a full disk): ask it to stop instead. It ends its workers and exits non-zero, and srun
            # (--kill-on-bad-exit) then ends the other nodes'.
            os.kill(os.getppid(), signal.SIGTERM)
        exit_process(code)
    exit_process(code or 0)


def _wait_to_be_stopped() -> None:
    """A rank whose failure another rank reports: stay silent for RANK_ERROR_GRACE_S, until torchrun stops it."""
    sys.stdout.flush()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # stopped as asked: the failing rank reports
    time.sleep(RANK_ERROR_GRACE_S)


def exit_process(code: int, joined: Optional[bool] = None) -> None:
    """End the script with ``code``; a rank of a multi-process job skips the interpreter's shutdown. ``joined``:
    whether this process was such a rank (default: whether it joined one through init_distributed).

    Objects that hold process groups outlive ``destroy_process_group``: FSDP2's state is kept by the
    autograd graph it hooks (a reference cycle through C++ that Python's collector cannot free), and
    so are the pipeline stages and device meshes. Freed while the interpreter shuts down, they let
    gloo's worker threads and autograd's device threads take the lock of an interpreter that is
    going away, and such a thread is unwound through C++ code that may not be, which aborts the
    process ("terminate called without an active exception", exit -6) after a run that succeeded
    (PyTorch issues 38230 and 90549 describe the mechanism). By now every output is written and
    closed; the DataLoader workers are stopped as the interpreter's exit would stop them, and the
    process ends at once.
    """
    if joined_job() if joined is None else joined:
        for child in multiprocessing.active_children():  # DataLoader workers (daemons; they ignore SIGTERM)
            child.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
