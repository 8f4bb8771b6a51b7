"""Step 3b — sharded data parallelism: train_ddp.py with FSDP2 (fully_shard) instead of DDP.

Each rank keeps 1/world_size of every parameter, gradient and AdamW state (DDP: full copies) and
all-gathers one block (Swin or ViT block; an RSTB with --fsdp_unit layer) just before it runs.
--hsdp_replicas N shards within groups and replicates across N of them (HSDP: one group per node); --param_dtype bf16
computes in bf16 with fp32 master weights. Checkpoints are sharded torch.distributed.checkpoint
folders that resume on any number of ranks; `python -m utils.checkpoint.sharded export` makes a train.py file.

Launch (torchrun starts one process per GPU and sets RANK, LOCAL_RANK, WORLD_SIZE):
    torchrun --nproc-per-node 4 train_fsdp.py --config baseline --param_dtype bf16   # one node, 4 GPUs
    torchrun --nproc-per-node 2 train_fsdp.py --config quickstart      # laptop: 2 CPU processes, gloo
    torchrun --nproc-per-node 4 train_fsdp.py --config vit_mp          # Part II: the 350M ViT, sharded per block
    sbatch --nodes 2 submit_multinode.sh train_fsdp.py --config baseline --hsdp_replicas 2   # HSDP
Any config key can be overridden on the command line; `python train_fsdp.py --help` lists them all.
"""

import torch
from tqdm import tqdm

from models import build_model, on_meta
from utils.checkpoint.contents import sharded_payload
from utils.checkpoint.files import load_newest, prepare_run_dir
from utils.checkpoint.sharded import finish_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint
from utils.checkpoint.state import TrainState
from utils.config import parse_config
from utils.data import build_loaders
from utils.observe.flops import train_flops_per_sample
from utils.observe.logger import MetricsLogger
from utils.parallel.distributed import cleanup_distributed, init_distributed
from utils.parallel.fsdp import apply_fsdp, memory_record
from utils.parallel.ensemble import Members
from utils.parallel.techniques import apply_ac, apply_compile
from utils.precision import apply_keep_fp32, autocast, make_grad_scaler
from utils.tasks import build_task
from utils.training import (Bookkeeping, build_loss, build_optimizer, configure_backends, run_cli, seed_everything,
                            seed_step, total_steps)


def main():
    # ------------------------------------------------------------------------------------------ Setup
    cfg = parse_config(__doc__)
    tcfg = cfg.train
    env, device = init_distributed(cfg.dist.dist_timeout_s)
    log0 = print if env.is_main else lambda *args: None  # one copy of each message, not world_size
    seed_everything(tcfg.seed)
    configure_backends(cfg)

    # ------------------------------------------------------------------------------------------- Data
    train_loader, val_loader = build_loaders(cfg, env.rank, env.world_size)  # also fills in the config from the data
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
    model = apply_fsdp(model, cfg, device)  # in place: raw_model is model, sharded
    input_shape = tuple(val_loader.dataset[0][0].shape)
    flops_per_sample = train_flops_per_sample(lambda: probe, input_shape)

    # -------------------------------------------------------------------------------------- Optimizer
    optimizer, scheduler = build_optimizer(model, cfg, steps_per_epoch, device)  # on the local shards
    scaler = make_grad_scaler(device, tcfg.amp_dtype)
    loss_fn = build_loss(cfg)
    members = Members(cfg, dp=(env.rank, env.world_size))  # --ensemble M: every member of each sample here
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
    log0(f"world_size={env.world_size} nodes={env.num_nodes} backend={torch.distributed.get_backend()}")
    log0(f"model: {sum(p.numel() for p in raw_model.parameters()):,} parameters | device: {device} | "
          f"{steps_per_epoch} steps/epoch, {max_steps} steps | {flops_per_sample / 1e9:.1f} GFLOP/sample/step")
    logger.log(memory_record(model, optimizer, state.step))  # per rank: params + grads + AdamW state vs DDP

    # ------------------------------------------------------------------------------------- Validation
    def validate():
        result = task.evaluate(model, val_loader, device, tcfg.amp_dtype, all_reduce=True)
        logger.log({"kind": "val", "step": state.step, "epoch": state.epoch, **result.metrics})
        if env.is_main:
            task.save_picture(f"{tcfg.run_dir}/samples/step_{state.step}.png", result)

    def save():
        save_sharded_checkpoint(ckpt_dir, state.step,  # every rank writes its shards
                                sharded_payload(model, optimizer, scheduler, scaler, state, cfg),
                                keep=tcfg.keep_checkpoints, asynchronous=tcfg.ckpt_async)

    # ------------------------------------------------------------------------------------- Train loop
    model.train()
    book = Bookkeeping(cfg, state, steps_per_epoch, max_steps, logger, scheduler, validate, save, flops_per_sample,
                       device, replicas=env.world_size)  # after each step: log, validate, checkpoint, stop
    while book.next_epoch():  # rolls a finished epoch over; False after the last step or on a stop
        # Same seed + epoch -> same order and crops: a resumed run sees exactly the same batches.
        train_loader.sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        train_loader.dataset.set_epoch(state.epoch)
        for inputs, target in book.batches(train_loader):
            inputs, target = inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)

            seed_step(tcfg.seed, state.step, env.rank)  # stochastic-depth draws: a function of (seed, step, rank)
            optimizer.zero_grad(set_to_none=True)
            with autocast(device, tcfg.amp_dtype):
                pred = model(members.inputs(inputs, state.step))  # --ensemble M: M noisy copies of each sample
            loss = loss_fn(members.gather(pred.float()), target)  # fp32, physical units; CRPS: all members
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            book.after_step(loss, inputs.shape[0])  # log, validate, checkpoint, stop; the epoch's loop may end here

    # --------------------------------------------------------------------------------------- Teardown
    book.close()  # the progress bar and the log
    finish_sharded_checkpoint()  # an asynchronous save in flight is on disk before the run says it ended
    log0(book.summary())
    cleanup_distributed()
    return book.exit_code


if __name__ == "__main__":
    run_cli(main)
