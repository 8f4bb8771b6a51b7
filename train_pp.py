"""Step 7 — pipeline parallelism: train_fsdp.py with the model cut into stages, one (or two) per rank.

When the model's weights, gradients and optimizer state outgrow a GPU, or the links between nodes are
slow, cut the model: --pp N runs N stages on N ranks (SwinIR: whole RSTBs, the long skip passed along;
the ViT: whole blocks), and each batch goes through them as --pp_microbatches microbatches, so that the
stages work at once (torch.distributed.pipelining; --pp_schedule gpipe, 1f1b, interleaved_1f1b or zbv).
Only the activations at stage boundaries travel between ranks. The pp ranks of a pipeline read the
same batch; pipelines are data-parallel with FSDP2 (--pp_dp fsdp, sharded) or replicated as DDP does
(--pp_dp ddp). Every schedule trains as one device does (tests/test_pp.py); the log reports each rank's
measured bubble next to the theory. Checkpoints are DCP folders, as train_fsdp.py's: they resume under
any layout, and `python -m utils.checkpoint.sharded export` makes a train.py file.

Launch (torchrun starts one process per GPU and sets RANK, LOCAL_RANK, WORLD_SIZE):
    torchrun --nproc-per-node 4 train_pp.py --config baseline --pp 4 --pp_microbatches 8    # one node: 4 stages
    sbatch --nodes 2 submit_multinode.sh train_pp.py --config baseline --pp 4 --pp_microbatches 8  # + 2 pipelines
    torchrun --nproc-per-node 2 train_pp.py --config vit_quickstart --pp 2            # laptop: 2 CPU processes
    torchrun --nproc-per-node 2 train_pp.py --config quickstart --pp 2 --pp_schedule zbv \
        --model_args "{depths: [1,1,1,1], num_heads: [2,2,2,2]}" --batch_size 8 --pp_microbatches 8   # SwinIR: V-shaped
Any config key can be overridden on the command line; `python train_pp.py --help` lists them all.
"""

import time

import torch
from tqdm import tqdm

from models import build_model, on_meta
from utils.checkpoint.files import load_newest, prepare_run_dir
from utils.checkpoint.sharded import finish_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint
from utils.checkpoint.state import TrainState
from utils.config import parse_config
from utils.data import build_loaders
from utils.memory.measure import SavedTensorBytes
from utils.observe.flops import device_peak_flops, mfu, peak_memory_gb, reset_peak_memory, train_flops_per_sample
from utils.observe.logger import MetricsLogger
from utils.parallel.distributed import (all_reduce_max, all_reduce_mean, build_pp_mesh, cleanup_distributed,
                                        init_distributed)
from utils.parallel.fsdp import memory_record
from utils.parallel.pipeline_parallel import Pipeline, apply_data_parallel, bubble_report
from utils.parallel.techniques import apply_ac, apply_compile
from utils.precision import apply_keep_fp32, make_grad_scaler
from utils.stopping import StopRequest
from utils.tasks import build_task
from utils.training import (build_loss, build_optimizer, check_finite, configure_backends, run_cli, seed_everything,
                            seed_step, show_progress, total_steps)


def main():
    # ------------------------------------------------------------------------------------------ Setup
    cfg = parse_config(__doc__)
    tcfg = cfg.train
    env, device = init_distributed(cfg.dist.dist_timeout_s)
    log0 = print if env.is_main else lambda *args: None  # one copy of each message, not world_size
    seed_everything(tcfg.seed)
    configure_backends(cfg)
    mesh = build_pp_mesh(env.world_size, cfg.dist.pp, device)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()

    # ------------------------------------------------------------------------------------------- Data
    # Sharded over dp only: the stages of one pipeline read the same samples.
    train_loader, val_loader = build_loaders(cfg, dp_rank, dp_size)  # also fills in the config from the data
    task = build_task(cfg, device)
    steps_per_epoch = len(train_loader)
    max_steps = total_steps(cfg, steps_per_epoch)

    # ------------------------------------------------------------------------------------------ Model
    raw_model = build_model(cfg.model).to(device)
    probe = on_meta(lambda: build_model(cfg.model))  # its shapes, no storage: the contract check and FLOP count
    task.check_model(cfg.model, val_loader.dataset[0], probe)  # the model contract, in one line
    loss_fn = build_loss(cfg)
    apply_keep_fp32(raw_model, tcfg.keep_fp32, tcfg.fp32_modules)  # before the cut: the wrapped parts go to their stages
    # This rank's stages: parts of raw_model. Each pipeline takes batch_size / dp samples per step.
    pipeline = Pipeline(raw_model, cfg, mesh["pp"], device, loss_fn, cfg.train.batch_size // dp_size)
    del raw_model  # the other ranks' parts
    pipeline.parallelize(lambda stage: apply_ac(stage, tcfg.ac))  # each technique on each stage
    pipeline.parallelize(lambda stage: apply_compile(stage, tcfg.compile, tcfg.compile_backend, tcfg.cuda_graphs,
                                                      call_is_step=False))
    pipeline.parallelize(lambda stage: apply_data_parallel(stage, cfg, device, mesh))  # FSDP2 across pipelines
    model = pipeline.local_model()  # this rank's parameters under the model's names: optimizer, checkpoints
    input_shape = tuple(val_loader.dataset[0][0].shape)
    flops_per_sample = train_flops_per_sample(lambda: probe, input_shape)
    peak_flops = env.world_size * device_peak_flops(device, tcfg.amp_dtype)  # MFU of all devices together

    # -------------------------------------------------------------------------------------- Optimizer
    optimizer, scheduler = build_optimizer(model, cfg, steps_per_epoch, device)  # on the local shards
    scaler = make_grad_scaler(device, tcfg.amp_dtype)
    state = TrainState()
    ckpt_dir = f"{tcfg.run_dir}/checkpoints"
    latest, resumed = load_newest(ckpt_dir, tcfg.resume, sharded=True, load=lambda path: load_sharded_checkpoint(
        path, model, optimizer, scheduler, scaler, cfg))  # (None, None): start fresh
    if latest:
        state = resumed
        log0(f"resumed from {latest} at step {state.step}")
    prepare_run_dir(tcfg.run_dir, latest is not None)  # writable, and no other run's outputs unless resuming
    logger = MetricsLogger(tcfg.run_dir, enabled=env.is_main, console=tqdm.write, channel_names=task.channel_names,
                           console_channels=task.key_channels)
    log0(f"world_size={env.world_size} nodes={env.num_nodes} backend={torch.distributed.get_backend()} | "
         f"mesh dp {dp_size} x pp {cfg.dist.pp} | {pipeline.describe()}")
    if pipeline.warning:
        log0(pipeline.warning)
    log0(f"model: {pipeline.param_count:,} parameters | device: {device} | "
          f"{steps_per_epoch} steps/epoch, {max_steps} steps | {flops_per_sample / 1e9:.1f} GFLOP/sample/step")
    activations = SavedTensorBytes(exclude=[*model.parameters(), *model.buffers()])  # counted in the first step
    first_step = state.step

    # ------------------------------------------------------------------------------------- Validation
    def validate():
        result = task.evaluate(pipeline, val_loader, device, tcfg.amp_dtype, all_reduce=True)  # the schedule's eval
        logger.log({"kind": "val", "step": state.step, "epoch": state.epoch, **result.metrics})
        if env.is_main:
            task.save_picture(f"{tcfg.run_dir}/samples/step_{state.step}.png", result)

    def save():
        save_sharded_checkpoint(ckpt_dir, state.step,  # every rank writes its shards
                                pipeline.payload(optimizer, scheduler, scaler, state, cfg),
                                keep=tcfg.keep_checkpoints, asynchronous=tcfg.ckpt_async)

    # ------------------------------------------------------------------------------------- Train loop
    pipeline.train()
    progress = tqdm(total=max_steps, initial=state.step, unit="step",
                    disable=not (env.is_main and show_progress(tcfg.progress)))
    loss_sum, loss_count = torch.zeros((), device=device), 0
    window_start, window_samples = time.perf_counter(), 0
    reset_peak_memory(device)
    stopping = StopRequest(cfg)  # SIGTERM or SIGUSR1 on any rank: checkpoint the step, then end the run
    while state.step < max_steps and not stopping.signal:
        # Same seed + epoch -> same order and crops: a resumed run sees exactly the same batches.
        train_loader.sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        train_loader.dataset.set_epoch(state.epoch)
        for inputs, target in train_loader:
            inputs, target = inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)

            seed_step(tcfg.seed, state.step, dp_rank)  # stochastic-depth draws: a function of (seed, step, replica)
            optimizer.zero_grad(set_to_none=True)
            with activations.counting(state.step == first_step):
                # Every microbatch's forward and backward through the stages (AMP inside each stage); the
                # loss (fp32, physical units) is computed by the last stage and shared with the others.
                loss = pipeline.step(inputs, target)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            if state.step == first_step:  # per rank: params + grads + AdamW state + peak live activations
                logger.log(memory_record(model, optimizer, state.step + 1, activations.peak_bytes, pipeline.param_bytes))
            state.step += 1
            state.batch_in_epoch += 1
            loss_sum += loss.detach()
            loss_count += 1
            window_samples += inputs.shape[0]
            progress.update(1)

            end_of_epoch = state.batch_in_epoch == steps_per_epoch
            done = state.step == max_steps
            if state.step % tcfg.log_every == 0 or done:
                mean_loss = check_finite(all_reduce_mean(loss_sum / loss_count), state.step, ckpt_dir)
                samples_per_sec = dp_size * window_samples / (time.perf_counter() - window_start)
                logger.log({"kind": "train", "step": state.step, "epoch": state.epoch, "loss": mean_loss,
                            "lr": scheduler.get_last_lr()[0], "samples_per_sec": samples_per_sec,
                            "mfu": mfu(flops_per_sample, samples_per_sec, peak_flops),
                            "peak_mem_gb": all_reduce_max(peak_memory_gb(device), device)})
                progress.set_postfix(loss=f"{mean_loss:.4f}")
                loss_sum.zero_()
                loss_count, window_start, window_samples = 0, time.perf_counter(), 0
            if (tcfg.val_every and state.step % tcfg.val_every == 0) or (not tcfg.val_every and end_of_epoch) or done:
                validate()
            stop, due = stopping.agreed()  # collective: all ranks stop, or checkpoint by the clock, at one step
            if (tcfg.ckpt_every and state.step % tcfg.ckpt_every == 0) or end_of_epoch or done or stop or due:
                check_finite(all_reduce_mean(loss_sum), state.step, ckpt_dir)  # never save a diverged step
                save()
            if end_of_epoch or done or stop:
                break
        if state.batch_in_epoch == steps_per_epoch:
            state.epoch += 1
            state.batch_in_epoch = 0

    # --------------------------------------------------------------------------------------- Teardown
    progress.close()
    bubble = bubble_report(pipeline, state.step)  # collective: every rank's measured idle fraction
    if bubble is not None:
        logger.log(bubble)
    logger.close()
    finish_sharded_checkpoint()  # an asynchronous save in flight is on disk before the run says it ended
    log0(stopping.summary(state.step, tcfg.run_dir))
    cleanup_distributed()
    return stopping.exit_code


if __name__ == "__main__":
    run_cli(main)
