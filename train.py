"""Step 0a — the baseline: train a model on ERA5 on one device, whichever the config names:
SwinIR super-resolution (Part I) or the ViT that forecasts six hours ahead (Part II, --config vit_*).

Every later script (profiling, DDP, FSDP) is this file plus one technique, so
`git diff --no-index train.py train_ddp.py` shows only that technique.

Launch (one process; CUDA if available, else CPU):
    python train.py --config quickstart                  # laptop: small SwinIR, synthetic data
    python train.py --config vit_quickstart              # laptop: small ViT forecaster, synthetic data
    python train.py --config baseline                    # one GPU: the tutorial's 11.75M SwinIR on ERA5
    python train.py --config baseline --batch_size 4 --max_steps 20 --run_dir runs/try
    python train.py --config baseline --resume           # continue from runs/baseline/checkpoints
    sbatch submit_singlegpu.sh train.py --config baseline
Any config key can be overridden on the command line; `python train.py --help` lists them all.
"""

from tqdm import tqdm

from models import build_model, on_meta
from utils.checkpoint.contents import checkpoint_payload, restore_payload
from utils.checkpoint.files import load_newest, prepare_run_dir
from utils.checkpoint.single import load_checkpoint, save_checkpoint
from utils.checkpoint.state import TrainState
from utils.config import parse_config
from utils.data import build_loaders
from utils.observe.flops import train_flops_per_sample
from utils.observe.logger import MetricsLogger
from utils.parallel.ensemble import Members
from utils.parallel.techniques import apply_ac, apply_compile
from utils.precision import apply_keep_fp32, autocast, make_grad_scaler
from utils.tasks import build_task
from utils.training import (Bookkeeping, build_loss, build_optimizer, configure_backends, pick_device, run_cli,
                            seed_everything, seed_step, total_steps)


def main():
    # ------------------------------------------------------------------------------------------ Setup
    cfg = parse_config(__doc__)
    tcfg = cfg.train
    device = pick_device(tcfg.device)
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

    # -------------------------------------------------------------------------------------- Optimizer
    optimizer, scheduler = build_optimizer(model, cfg, steps_per_epoch, device)
    scaler = make_grad_scaler(device, tcfg.amp_dtype)
    loss_fn = build_loss(cfg)
    members = Members(cfg)  # --ensemble M: every member of each sample here
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
    book = Bookkeeping(cfg, state, steps_per_epoch, max_steps, logger, scheduler, validate, save, flops_per_sample,
                       device)  # after each step: log, validate, checkpoint, stop
    while book.next_epoch():  # rolls a finished epoch over; False after the last step or on a stop
        # Same seed + epoch -> same order and crops: a resumed run sees exactly the same batches.
        train_loader.sampler.set_epoch(state.epoch, start_batch=state.batch_in_epoch)
        train_loader.dataset.set_epoch(state.epoch)
        for inputs, target in book.batches(train_loader):
            inputs, target = inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)

            seed_step(tcfg.seed, state.step)  # stochastic-depth draws: a function of (seed, step)
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
    print(book.summary())
    return book.exit_code


if __name__ == "__main__":
    run_cli(main)
