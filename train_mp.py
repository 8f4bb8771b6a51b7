"""Step 6 — model parallelism: train_fsdp.py on a dp x cp x tp device mesh (tensor and context parallelism).

When one sample's activations or the model itself outgrow a GPU even with AMP + AC + FSDP, split the
model: --tp N splits every block over N ranks (whole heads, 1/N of the MLP, and for the ViT with
sequence parallelism 1/N of the tokens of the norms and residual stream); --cp N gives each of N ranks one
latitude band: of the ViT's tokens (attention gathers the other bands' keys and values), of SwinIR's
field itself (domain parallelism: each rank reads and computes its rows, with halos from its neighbours).
The tp x cp ranks of a model replica read the same batch; FSDP2 shards over the remaining dp ranks, with
cp folded in, so every gradient is averaged over dp x cp. Every layout trains as one device does
(tests/test_mp.py, tests/test_domain_parallel.py).
Checkpoints are DCP folders, as train_fsdp.py's: they resume under any layout, and
`python -m utils.checkpoint.sharded export` makes a train.py file.

Launch (torchrun starts one process per GPU and sets RANK, LOCAL_RANK, WORLD_SIZE):
    torchrun --nproc-per-node 4 train_mp.py --config vit_mp --tp 4                  # one node: 4-way TP
    sbatch --nodes 4 submit_multinode.sh train_mp.py --config vit_mp --tp 4         # + 4-way data parallel
    torchrun --nproc-per-node 2 train_mp.py --config vit_quickstart --tp 2          # laptop: 2 CPU processes
    torchrun --nproc-per-node 2 train_mp.py --config vit_quickstart --cp 2          # laptop: context parallel
    torchrun --nproc-per-node 2 train_mp.py --config quickstart --tp 2              # SwinIR, tensor parallel
    torchrun --nproc-per-node 2 train_mp.py --config quickstart --cp 2              # SwinIR, 2 bands of each field
    torchrun --nproc-per-node 4 train_mp.py --config full_size --cp 4               # one 720x1440 field over 4 GPUs
Any config key can be overridden on the command line; `python train_mp.py --help` lists them all.
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
from utils.parallel.context_parallel import apply_cp
from utils.parallel.distributed import (build_mp_mesh, cleanup_distributed,
                                        init_distributed)
from utils.parallel.domain_parallel import band_loss, field_bands
from utils.parallel.fsdp import apply_fsdp, memory_record
from utils.parallel.ensemble import Members
from utils.parallel.techniques import apply_ac, apply_compile
from utils.parallel.tensor_parallel import apply_tp
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
    d = cfg.dist
    mesh, dp_cp_mesh = build_mp_mesh(env.world_size, d.tp, d.cp, d.parallel_order, device, d.ens)
    dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()

    # ------------------------------------------------------------------------------------------- Data
    # Sharded over dp only: the tp x cp ranks of one model replica read the same samples (SwinIR: each cp
    # rank only its band of them).
    bands = field_bands(cfg, mesh["cp"])
    train_loader, val_loader = build_loaders(cfg, dp_rank, dp_size, bands)  # also fills in the config from the data
    task = build_task(cfg, device, bands)
    steps_per_epoch = len(train_loader)
    max_steps = total_steps(cfg, steps_per_epoch)

    # ------------------------------------------------------------------------------------------ Model
    raw_model = build_model(cfg.model).to(device)
    probe = on_meta(lambda: build_model(cfg.model))  # its shapes, no storage: the contract check and FLOP count
    task.check_model(cfg.model, val_loader.dataset[0], probe)  # the model contract, in one line
    model = apply_tp(raw_model, mesh["tp"])  # parameters -> DTensors on the tp ranks
    model = apply_cp(model, mesh["cp"])  # hooks: one band of tokens per cp rank
    model = apply_keep_fp32(model, tcfg.keep_fp32, tcfg.fp32_modules)  # the parts kept in fp32
    model = apply_ac(model, tcfg.ac)
    model = apply_compile(model, tcfg.compile, tcfg.compile_backend, tcfg.cuda_graphs)
    model = apply_fsdp(model, cfg, device, dp_cp_mesh)  # in place: raw_model is model, sharded over dp x cp
    input_shape = tuple(val_loader.dataset[0][0].shape)
    flops_per_sample = train_flops_per_sample(lambda: probe, input_shape)
    if bands:  # the sample's FLOPs are its bands'
        flops_per_sample = bands.sum(flops_per_sample, device)

    # -------------------------------------------------------------------------------------- Optimizer
    optimizer, scheduler = build_optimizer(model, cfg, steps_per_epoch, device)  # on the local shards
    scaler = make_grad_scaler(device, tcfg.amp_dtype)
    loss_fn = band_loss(build_loss(cfg), bands)  # SwinIR under cp: this band's share of the field's loss
    members = Members(cfg, mesh, bands, dp=(dp_rank, dp_size))  # --ensemble M: ensemble / ens of them here
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
         f"mesh {' x '.join(f'{name} {mesh[name].size()}' for name in mesh.mesh_dim_names)}")
    log0(f"model: {sum(p.numel() for p in raw_model.parameters()):,} parameters | device: {device} | "
          f"{steps_per_epoch} steps/epoch, {max_steps} steps | {flops_per_sample / 1e9:.1f} GFLOP/sample/step")
    activations = SavedTensorBytes(exclude=[*model.parameters(), *model.buffers()])  # counted in the first step

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
                       device, replicas=dp_size)  # after each step: log, validate, checkpoint, stop
    while book.next_epoch():  # rolls a finished epoch over; False after the last step or on a stop
        # Same seed + epoch -> same order and crops: a resumed run sees exactly the same batches.
        train_loader.sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        train_loader.dataset.set_epoch(state.epoch)
        for inputs, target in book.batches(train_loader):
            inputs, target = inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)

            seed_step(tcfg.seed, state.step, dp_rank)  # the ranks of one replica draw the same drop-path masks
            optimizer.zero_grad(set_to_none=True)
            with autocast(device, tcfg.amp_dtype), activations.counting(book.first_step):
                pred = model(members.inputs(inputs, state.step))  # --ensemble M: M noisy copies of each sample
            loss = loss_fn(members.gather(pred.float()), target)  # fp32, physical units; CRPS: all members
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()

            if book.first_step:  # per rank: params + grads + AdamW state + activations
                logger.log(memory_record(model, optimizer, state.step + 1, activations.bytes))
            book.after_step(loss, inputs.shape[0])  # log, validate, checkpoint, stop; the epoch's loop may end here

    # --------------------------------------------------------------------------------------- Teardown
    book.close()  # the progress bar and the log
    finish_sharded_checkpoint()  # an asynchronous save in flight is on disk before the run says it ended
    log0(book.summary())
    cleanup_distributed()
    return book.exit_code


if __name__ == "__main__":
    run_cli(main)
