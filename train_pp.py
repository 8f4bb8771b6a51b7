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

import torch
from tqdm import tqdm

from models import build_model, on_meta
from utils.checkpoint.contents import sharded_payload
from utils.checkpoint.files import load_newest, prepare_run_dir
from utils.checkpoint.sharded import finish_sharded_checkpoint, load_sharded_checkpoint, save_sharded_checkpoint
from utils.checkpoint.state import TrainState
from utils.config import parse_config
from utils.data import build_loaders
from utils.memory.measure import SavedTensorBytes
from utils.observe.flops import train_flops_per_sample
from utils.observe.logger import MetricsLogger
from utils.parallel.distributed import (build_pp_mesh, cleanup_distributed,
                                        init_distributed)
from utils.parallel.fsdp import memory_record
from utils.parallel.pipeline_parallel import Pipeline, apply_data_parallel, bubble_report
from utils.parallel.techniques import apply_ac, apply_compile
from utils.precision import apply_keep_fp32, make_grad_scaler
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

    # ------------------------------------------------------------------------------------- Validation
    def validate():
        result = task.evaluate(pipeline, val_loader, device, tcfg.amp_dtype, all_reduce=True)  # the schedule's eval
        logger.log({"kind": "val", "step": state.step, "epoch": state.epoch, **result.metrics})
        if env.is_main:
            task.save_picture(f"{tcfg.run_dir}/samples/step_{state.step}.png", result)

    def save():
        save_sharded_checkpoint(ckpt_dir, state.step,  # every rank writes its shards
                                sharded_payload(pipeline.local_model(), optimizer, scheduler, scaler, state, cfg,
                                                names=pipeline.param_names, group=pipeline.group),
                                keep=tcfg.keep_checkpoints, asynchronous=tcfg.ckpt_async)

    # ------------------------------------------------------------------------------------- Train loop
    pipeline.train()
    book = Bookkeeping(cfg, state, steps_per_epoch, max_steps, logger, scheduler, validate, save, flops_per_sample,
                       device, replicas=dp_size)  # after each step: log, validate, checkpoint, stop
    while book.next_epoch():  # rolls a finished epoch over; False after the last step or on a stop
        # Same seed + epoch -> same order and crops: a resumed run sees exactly the same batches.
        train_loader.sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        train_loader.dataset.set_epoch(state.epoch)
        for inputs, target in book.batches(train_loader):
            inputs, target = inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)

            seed_step(tcfg.seed, state.step, dp_rank)  # stochastic-depth draws: a function of (seed, step, replica)
            optimizer.zero_grad(set_to_none=True)
            with activations.counting(book.first_step):
                # Every microbatch's forward and backward through the stages (AMP inside each stage); the
                # loss (fp32, physical units) is computed by the last stage and shared with the others.
                loss = pipeline.step(inputs, target)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            if book.first_step:  # per rank: params + grads + AdamW state + peak live activations
                logger.log(memory_record(model, optimizer, state.step + 1, activations.peak_bytes, pipeline.param_bytes))
            book.after_step(loss, inputs.shape[0])  # log, validate, checkpoint, stop; the epoch's loop may end here

    # --------------------------------------------------------------------------------------- Teardown
    book.close(bubble_report(pipeline, state.step))  # collective: every rank's measured idle fraction, then the log
    finish_sharded_checkpoint()  # an asynchronous save in flight is on disk before the run says it ended
    log0(book.summary())
    cleanup_distributed()
    return book.exit_code


if __name__ == "__main__":
    run_cli(main)
