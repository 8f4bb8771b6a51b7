"""Step 0b — profiling: train.py plus torch.profiler ranges, memory timeline/snapshot and a throughput breakdown.

Profiles by default (--profile false makes it train.py); files go to <run_dir>/profile/rank<r>_*; see
utils/observe/profiling.py and docs/part1-swinir.md, Step 0b, for what each shows and how to open it.

Launch (one process; CUDA if available, else CPU):
    python train_with_profiling.py --config quickstart --max_steps 20     # laptop: trace, memory timeline, summary
    python train_with_profiling.py --config baseline --memory_snapshot true --max_steps 20
    sbatch submit_singlegpu.sh train_with_profiling.py --config baseline --max_steps 20
    nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop --trace=cuda,nvtx,cudnn,cublas \\
        -o runs/baseline/profile/nsys_rank0 python train_with_profiling.py --config baseline --nsys true \\
        --profile false --max_steps 20
Any config key can be overridden on the command line; `python train_with_profiling.py --help` lists them all.
"""

import contextlib
import time

import torch
from torch.profiler import record_function
from tqdm import tqdm

from models import build_model, on_meta
from utils.checkpoint.files import load_newest, prepare_run_dir
from utils.checkpoint.single import load_checkpoint, save_checkpoint
from utils.checkpoint.state import TrainState
from utils.config import parse_config
from utils.data import build_loaders
from utils.observe.flops import device_peak_flops, mfu, peak_memory_gb, reset_peak_memory, train_flops_per_sample
from utils.observe.logger import MetricsLogger
from utils.observe.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling, throughput_breakdown
from utils.parallel.techniques import apply_ac, apply_compile
from utils.precision import apply_keep_fp32, autocast, make_grad_scaler
from utils.stopping import StopRequest
from utils.tasks import build_task
from utils.training import (build_loss, build_optimizer, check_finite, checkpoint_payload, configure_backends,
                            pick_device, restore_payload, run_cli, seed_everything, seed_step, show_progress,
                            total_steps)


def main():
    # ------------------------------------------------------------------------------------------ Setup
    cfg = parse_config(__doc__, script_defaults={"profile": True})  # the script's name promises a profile
    tcfg = cfg.train
    device = pick_device(tcfg.device)
    profiling = contextlib.ExitStack()  # the profiling contexts, closed in Teardown
    profiling.enter_context(maybe_enable_memory_snapshot(cfg, device))  # before the model: every allocation
    seed_everything(tcfg.seed)
    configure_backends(cfg)

    # ------------------------------------------------------------------------------------------- Data
    train_loader, val_loader = build_loaders(cfg)  # also fills in the config from the data (channels, statistics)
    task = build_task(cfg, device)
    steps_per_epoch = len(train_loader)
    max_steps = total_steps(cfg, steps_per_epoch)

    # ------------------------------------------------------------------------------------------ Model
    raw_model = build_model(cfg.model).to(device)
    probe = on_meta(lambda: build_model(cfg.model))  # its shapes, no storage: the contract check and FLOP count
    task.check_model(cfg.model, val_loader.dataset[0], probe)  # the model contract, in one line
    model = apply_keep_fp32(raw_model, tcfg.keep_fp32, tcfg.fp32_modules)  # the parts kept in fp32
    model = apply_ac(model, tcfg.ac)
    model = apply_compile(model, tcfg.compile, tcfg.compile_backend, tcfg.cuda_graphs)
    input_shape = tuple(val_loader.dataset[0][0].shape)
    flops_per_sample = train_flops_per_sample(lambda: probe, input_shape)
    peak_flops = device_peak_flops(device, tcfg.amp_dtype)

    # -------------------------------------------------------------------------------------- Optimizer
    optimizer, scheduler = build_optimizer(model, cfg, steps_per_epoch, device)
    scaler = make_grad_scaler(device, tcfg.amp_dtype)
    loss_fn = build_loss(cfg)
    state = TrainState()
    ckpt_dir = f"{tcfg.run_dir}/checkpoints"
    latest, resumed = load_newest(ckpt_dir, tcfg.resume, load=lambda path: restore_payload(
        load_checkpoint(path, device), raw_model, optimizer, scheduler, scaler, cfg, path))  # (None, None): start fresh
    if latest:
        state = resumed
        print(f"resumed from {latest} at step {state.step}")
    prepare_run_dir(tcfg.run_dir, latest is not None)  # writable, and no other run's outputs unless resuming
    logger = MetricsLogger(tcfg.run_dir, console=tqdm.write, channel_names=task.channel_names,
                           console_channels=task.key_channels)
    print(f"model: {sum(p.numel() for p in raw_model.parameters()):,} parameters | device: {device} | "
          f"{steps_per_epoch} steps/epoch, {max_steps} steps | {flops_per_sample / 1e9:.1f} GFLOP/sample/step")

    # ------------------------------------------------------------------------------------- Validation
    def validate():
        result = task.evaluate(model, val_loader, device, tcfg.amp_dtype)
        logger.log({"kind": "val", "step": state.step, "epoch": state.epoch, **result.metrics})
        task.save_picture(f"{tcfg.run_dir}/samples/step_{state.step}.png", result)

    def save():
        save_checkpoint(ckpt_dir, state.step,
                        checkpoint_payload(raw_model, optimizer, scheduler, scaler, state, cfg),
                        keep=tcfg.keep_checkpoints)

    # ------------------------------------------------------------------------------------- Train loop
    model.train()
    progress = tqdm(total=max_steps, initial=state.step, disable=not show_progress(tcfg.progress), unit="step")
    loss_sum, loss_count = torch.zeros((), device=device), 0
    window_start, window_samples = time.perf_counter(), 0
    reset_peak_memory(device)
    profiler = profiling.enter_context(maybe_enable_profiling(cfg, device))
    stopping = StopRequest(cfg)  # SIGTERM or SIGUSR1 on any rank: checkpoint the step, then end the run
    while state.step < max_steps and not stopping.signal:
        # Same seed + epoch -> same order and crops: a resumed run sees exactly the same batches.
        train_loader.sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        train_loader.dataset.set_epoch(state.epoch)
        batches = iter(train_loader)
        while True:
            with record_function("## data ##"):  # waiting for the loader, then the copy to the device
                batch = next(batches, None)
                if batch is None:
                    break
                inputs, target = (tensor.to(device, non_blocking=True) for tensor in batch)

            seed_step(tcfg.seed, state.step)  # stochastic-depth draws: a function of (seed, step)
            optimizer.zero_grad(set_to_none=True)
            with record_function("## forward ##"):
                with autocast(device, tcfg.amp_dtype):
                    pred = model(inputs)
                loss = loss_fn(pred.float(), target)  # the loss in fp32 and in physical units
            with record_function("## backward ##"):
                scaler.scale(loss).backward()
            with record_function("## optimizer ##"):
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()

            state.step += 1
            state.batch_in_epoch += 1
            loss_sum += loss.detach()
            loss_count += 1
            window_samples += inputs.shape[0]
            progress.update(1)

            end_of_epoch = state.batch_in_epoch == steps_per_epoch
            done = state.step == max_steps
            if state.step % tcfg.log_every == 0 or done:
                mean_loss = check_finite(loss_sum / loss_count, state.step, ckpt_dir)  # one host sync per log
                samples_per_sec = window_samples / (time.perf_counter() - window_start)
                logger.log({"kind": "train", "step": state.step, "epoch": state.epoch, "loss": mean_loss,
                            "lr": scheduler.get_last_lr()[0], "samples_per_sec": samples_per_sec,
                            "mfu": mfu(flops_per_sample, samples_per_sec, peak_flops),
                            "peak_mem_gb": peak_memory_gb(device)})
                progress.set_postfix(loss=f"{mean_loss:.4f}")
                loss_sum.zero_()
                loss_count, window_start, window_samples = 0, time.perf_counter(), 0
            if (tcfg.val_every and state.step % tcfg.val_every == 0) or (not tcfg.val_every and end_of_epoch) or done:
                validate()
            stop, due = stopping.agreed()  # collective: all ranks stop, or checkpoint by the clock, at one step
            if (tcfg.ckpt_every and state.step % tcfg.ckpt_every == 0) or end_of_epoch or done or stop or due:
                check_finite(loss_sum, state.step, ckpt_dir)  # never save weights from a diverged step
                save()
            profiler.step()
            if end_of_epoch or done or stop:
                break
        if state.batch_in_epoch == steps_per_epoch:
            state.epoch += 1
            state.batch_in_epoch = 0

    # --------------------------------------------------------------------------------------- Teardown
    progress.close()
    profiling.close()  # prints the profile summary, dumps the memory snapshot
    if rates := throughput_breakdown(cfg, train_loader, model, optimizer, loss_fn, scaler, device):
        logger.log({"kind": "throughput", "step": state.step, **rates})
    logger.close()
    print(stopping.summary(state.step, tcfg.run_dir))
    return stopping.exit_code


if __name__ == "__main__":
    run_cli(main)
