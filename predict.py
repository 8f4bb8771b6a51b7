"""Use the model: from a checkpoint to predictions in netCDF or Zarr, for every task, on one device or many.

    python predict.py --checkpoint runs/quickstart --out runs/quickstart/sr.zarr --times 0:8 --tile 48
    python predict.py --checkpoint runs/quickstart --out sr.nc --input coarse_era5.nc --rename t2=t2m
    python predict.py --checkpoint runs/vit_quickstart --out forecasts.zarr --steps 8 --times 2015-01-01:2015-01-31
    python predict.py --checkpoint runs/unet3d_quickstart --out box.zarr --tile 32 --overlap 8
    torchrun --nproc-per-node 4 predict.py --checkpoint runs/vit_fsdp/checkpoints/step_00001000 --out f.zarr
    python predict.py --checkpoint runs/vit_quickstart --out ens.zarr --members 8 --perturbation spherical

The model is rebuilt from the checkpoint's own config (a run folder, a step_N.pt file, a DCP folder of any layout,
or bare weights such as the original SwinIR's with --config NAME), whatever its class: what differs is the task.

- sr: each time's field, downsampled as in training, from a split of the training layout (--data_dir, --split:
  the checkpoint's data and validation split by default), or coarse fields from netCDF / GRIB / Zarr of any
  centre (--input, read by utils/data/foreign.py's rules: the config's channel names, --rename for others).
- forecast: each initial time rolled forward --steps model steps (a forecast fed back, as rollout.py does);
  written as WeatherBench 2 lays forecasts out: ``time`` (initial), ``prediction_timedelta``.
- volume: the whole box of each input (the split's, or --input files in SC22's layout).

- forecast --members M: an ensemble, each member's initial state perturbed as the config's ensemble keys say
  (--perturbation gaussian, spherical, bred or lagged; utils/predict/ensemble.py), on a first dimension
  ``realization``; the members are spread over the ranks with the items, each reproducible on its own.

--times chooses the items: indices (0:8, 0,4,9) or dates (2015-01-03, 2015-01-01:2015-01-31). --tile N predicts
fields and boxes in overlapping N-cell tiles blended over --overlap cells (utils/predict/tiles.py: keep both
multiples of the model's grid, SwinIR's window or the U-Net's 2**levels). Under torchrun the items are split over
the ranks, each writing its own regions of one Zarr store; a run killed part-way continues where it stopped when
started again with the same arguments, and SIGTERM / SIGUSR1 stop it at the next batch (exit code 75). The output
gets its final name only when complete; bad input is one line and exit code 2. A picture of the first item beside
its truth and the error is written beside the output (``<out>.png``) where the data holds the truth.
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from utils.checkpoint.files import barrier, reporting_write_failures
from utils.checkpoint.reading import read_checkpoint
from utils.cli import OneLineParser
from utils.config import ConfigError, EnsembleConfig, field_docs, section_values
from utils.config_checks import validate_ensemble
from utils.data.common import DataError
from utils.data.era5 import channel_sets
from utils.data.files import scan_split
from utils.data.foreign import ForeignDataError, open_fields, parse_rename
from utils.data.volume import split_path
from utils.memory.estimate import GB
from utils.memory.traced import CannotTrace, trace_inference
from utils.observe.pictures import save_diagnostic_png, save_forecast_png, save_sample_png, save_volume_png
from utils.observe.scores import bicubic_upsample
from utils.parallel.distributed import cleanup_distributed, init_distributed, read_dist_env
from utils.precision import AMP_DTYPES, autocast
from utils.predict.ensemble import Ensemble
from utils.predict.inputs import Boxes, CoarseFields, Inputs, SplitFields, hours_to_delta, select, shown
from utils.predict.model import config_from_checkpoint, load_model, output_shape
from utils.predict.store import Layout, Store, channel_values, check_writable, output_format, xarray
from utils.predict.tiles import DEFAULT_OVERLAP, tile_spans, tiled
from utils.stopping import EXIT_STOPPED, StopRequest, heartbeat, stop_watching
from utils.training import configure_backends, pick_device, run_cli, show_progress

TASKS = ("sr", "forecast", "diagnostic", "volume")
DEFAULT_STEPS = 4


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineParser(prog="predict.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="a run folder (its newest checkpoint), a step_N.pt file, a DCP step_N folder, or bare "
                             "weights (with --config)")
    parser.add_argument("--out", required=True, help="the output: OUT.zarr (a Zarr store) or OUT.nc (netCDF)")
    parser.add_argument("--data_dir", default=None, help="data root of the training layout (default: the checkpoint's)")
    parser.add_argument("--split", default=None, help="split to predict (default: the checkpoint's valid_split)")
    parser.add_argument("--input", nargs="+", default=None,
                        help="sr: coarse netCDF / GRIB / Zarr files or globs; volume: SC22-layout .h5 boxes")
    parser.add_argument("--rename", default=None, help="sr --input: the sources' names for channels, e.g. t2=t2m")
    parser.add_argument("--times", default=None, help="items to predict: 0:8, 0,4,9, 2015-01-03, "
                                                      "2015-01-01:2015-01-31 (default: all)")
    parser.add_argument("--steps", type=int, default=None, help=f"forecast: model steps per initial time "
                                                                f"(default {DEFAULT_STEPS})")
    parser.add_argument("--members", type=int, default=None, help="forecast: an ensemble of this many members "
                                                                  "(default: one deterministic forecast)")
    ensemble = parser.add_argument_group("ensemble (--members: the checkpoint's config's keys, overridden here)")
    for name, doc in field_docs(EnsembleConfig).items():
        ensemble.add_argument(f"--{name}", dest=f"cfg__{name}", metavar="V", default=argparse.SUPPRESS,
                              help=doc)  # text, typed by the config as a YAML value is
    parser.add_argument("--tile", type=int, default=0, help="tile side in input cells (default 0: whole fields)")
    parser.add_argument("--overlap", type=int, default=DEFAULT_OVERLAP,
                        help=f"input cells shared by neighbouring tiles (default {DEFAULT_OVERLAP})")
    parser.add_argument("--batch_size", type=int, default=1, help="items per forward pass (default 1)")
    parser.add_argument("--amp_dtype", choices=list(AMP_DTYPES), default="none",
                        help="autocast dtype of the forward pass (default none: fp32)")
    parser.add_argument("--task", choices=TASKS, default=None, help="refuse a checkpoint of any other task")
    parser.add_argument("--config", default=None, help="bare weights: the named config that describes the model")
    parser.add_argument("--config_file", default=None, help="bare weights: the YAML file that holds --config")
    parser.add_argument("--picture", default=None, help="picture of the first item (default <out>.png; none: no picture)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (worth it for many items)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: CUDA if available")
    parser.add_argument("--progress", choices=["auto", "always", "never"], default="auto", help="progress bar")
    parser.add_argument("--dist_timeout_s", type=float, default=300.0,
                        help="seconds a rank waits for the others (a batch must take less)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    for name, least in (("steps", 1), ("members", 2), ("tile", 0), ("overlap", 0), ("batch_size", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise ConfigError(f"--{name} must be >= {least}, got {value}")
    if args.tile and args.overlap >= args.tile:
        raise ConfigError(f"--overlap {args.overlap} must be smaller than --tile {args.tile}")
    output_format(Path(args.out))
    check_writable(Path(args.out))
    xarray()  # the store's writers, before any work: one line that names the one missing
    if Path(args.out).exists():
        raise DataError(f"--out {args.out} exists: choose another name, or delete it to predict again")


# ----------------------------------------------------------------------------------------- inputs


def open_inputs(cfg, args) -> Inputs:
    """What the task reads: a split of the training layout, or --input files (the task decides which kinds)."""
    task, data_dir = cfg.data.task, Path(cfg.data.data_dir)
    split = args.split or cfg.data.valid_split
    if args.steps is not None and task != "forecast":
        raise ConfigError(f"--steps is for forecasts; this checkpoint's task is {task}")
    if task == "volume":
        return Boxes([Path(p) for p in args.input] if args.input else [split_path(data_dir, split)], cfg.model.in_chans)
    if task == "forecast":
        if args.input:
            raise ConfigError("--input is for coarse fields (task sr) and boxes (task volume); a forecaster starts "
                              "from a split of the training layout: --data_dir, --split")
        return SplitFields(data_dir / split, cfg.model.in_chans, upscale=1, lead=cfg.data.lead)
    if task == "diagnostic":
        if args.input:
            raise ConfigError("--input is for coarse fields (task sr) and boxes (task volume); a diagnostic model reads "
                              "its input channels from a split of the training layout: --data_dir, --split")
        sets = channel_sets(cfg, scan_split(data_dir / split)[0])
        return SplitFields(data_dir / split, cfg.model.in_chans, upscale=1, channel_sets=sets)
    if not args.input:
        return SplitFields(data_dir / split, cfg.model.in_chans, upscale=cfg.model.upscale)
    try:  # the reading rules of datasets/convert.py: names, axes, units, orientation
        fields = open_fields(args.input, cfg.data.channel_names, parse_rename(args.rename) if args.rename else None)
    except ForeignDataError as error:  # a model cannot do without a channel, as a conversion can
        needs = f"the model takes {', '.join(cfg.data.channel_names)}"
        raise DataError(str(error).replace(" or drop the channel", f"; {needs}")) from None
    return CoarseFields(fields, args.input)


def probe(cfg, model, device: torch.device, inputs: Inputs, args) -> tuple[int, tuple[int, ...]]:
    """(the model's scale, the output's shape per item) from the input's shape, every tile shape tried on the meta
    device (a real forward of zeros where an operator has no meta kernel): a grid the model cannot take stops here."""
    shape = tuple(inputs.read(0).shape)
    spatial = shape[1:]
    lengths = [sorted({s for _, s in tile_spans(n, args.tile, args.overlap)}) if args.tile else [n] for n in spatial]
    found = {}
    for sizes in itertools.product(*lengths):
        out = output_shape(cfg, (shape[0], *sizes))
        if out is None:
            with torch.no_grad():
                out = tuple(model(torch.zeros((1, shape[0], *sizes), device=device)).shape[1:])
        found[sizes] = out
    sizes, out = next(iter(found.items()))
    scale = out[-1] // sizes[-1]
    for sizes, out in found.items():
        if tuple(out[1:]) != tuple(scale * n for n in sizes):
            raise DataError(f"the model maps a {'x'.join(map(str, sizes))} input to {'x'.join(map(str, out[1:]))}: a "
                            "prediction needs an output on the input's grid times one whole scale")
    if cfg.data.task == "forecast" and (out[0], scale) != (shape[0], 1):
        raise DataError(f"a forecaster's output is fed back as its input, but the model maps {shape} to {out}")
    return scale, (out[0], *(scale * n for n in spatial))


class _InTurn:
    """An executor that runs each task at once, in the calling thread (concurrent.futures has none)."""

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False

    def submit(self, fn, *args) -> Future:
        done = Future()
        done.set_result(fn(*args))
        return done


def _executor(overlap: bool):
    return ThreadPoolExecutor(1) if overlap else _InTurn()


def memory_needed(model, device: torch.device, args, input_shape: tuple[int, ...]) -> Optional[int]:
    """Bytes one batch's forward needs on the device (parameters, the input, the forward's own tensors, tiles and
    their blend; nothing kept for a backward), traced on fake tensors; None where the model cannot be traced.
    A GPU without that much memory stops here in one line, before anything is written."""
    traced_on = device if device.type == "cuda" else torch.device("cpu")  # CUDA's autocast and kernels on a GPU
    try:
        need = trace_inference(model, lambda call, x: Predictor(call, traced_on, args, None).one_step(x),
                               input_shape, traced_on)
    except CannotTrace as error:
        print(f"memory: not estimated ({error})", flush=True)
        return None
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    if total is not None and need > total:
        raise DataError(f"one batch needs an estimated {need / GB:.1f} GB and {torch.cuda.get_device_name(device)} has "
                        f"{total / GB:.1f} GB: predict in tiles (--tile N) or with a smaller --batch_size")
    return need


# ----------------------------------------------------------------------------------------- prediction


class Predictor:
    """The model applied to a batch of items: whole or in tiles, under autocast, rolled forward for forecasts."""

    def __init__(self, model, device: torch.device, args, steps: Optional[int], ensemble: Optional[Ensemble] = None):
        self.model, self.device, self.args, self.steps, self.ensemble = model, device, args, steps, ensemble

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        heartbeat()  # a long batch of tiles is not a hang (utils.stopping.StepWatchdog)
        with autocast(self.device, self.args.amp_dtype):
            return self.model(x).float()

    def one_step(self, x: torch.Tensor) -> torch.Tensor:
        if self.args.tile:
            return tiled(self._forward, x, self.args.tile, self.args.overlap, x.dim() - 2)
        return self._forward(x)

    @torch.no_grad()
    def __call__(self, batch: torch.Tensor, items: Sequence[int] = (), member: Optional[int] = None) -> torch.Tensor:
        """(items, [leads], channels, *grid) on the CPU; of ensemble member ``member`` where given (``batch``:
        the inputs it starts from, ``items``: the items it forecasts)."""
        x = batch.to(self.device)
        if self.steps is None:
            return self.one_step(x).cpu()
        extra = 0
        if member is not None:
            x = self.ensemble.perturb(x, items, member, self.one_step)
            extra = self.ensemble.extra_steps(member)  # a lagged member's steps up to the initial time
        leads = []
        for step in range(extra + self.steps):  # each forecast fed back in fp32, as rollout.py does
            x = self.one_step(x)
            if step >= extra:
                leads.append(x.cpu())
        return torch.stack(leads, dim=1)


def layout_grid_latitude(inputs: Inputs, scale: int, out_shape) -> Optional[np.ndarray]:
    """The output grid's latitudes (degrees), where it has them."""
    grid = inputs.grid(scale, out_shape[1:])
    return grid["latitude"][0] if "latitude" in grid else None


def layout_for(cfg, inputs: Inputs, out_shape, scale: int, steps: Optional[int], members: Optional[int]) -> Layout:
    leads = step = None
    if steps is not None:
        step = inputs.step()
        if step.assumed:
            inputs.notes.append(f"prediction_timedelta: {step} per sample assumed (the data records no step)")
        counts = np.arange(1, steps + 1) * cfg.data.lead * step.count
        # A month is no fixed duration: its leads stay counts of months (evaluate.py matches the month reached).
        leads = hours_to_delta(counts) if step.unit == "h" else counts
    channels = list(cfg.data.channel_names) or [f"channel {c}" for c in range(out_shape[0])]
    units = getattr(inputs, "units", None) or [None] * len(channels)
    return Layout(channels, units, inputs.dim, inputs.grid(scale, out_shape[1:]), leads,
                  step.times(cfg.data.lead) if step else None, members)


def describe(cfg, saved, args, inputs: Inputs, chosen: list[int], steps: Optional[int],
             ensemble: Optional[Ensemble]) -> tuple[dict, dict, dict]:
    """(the store's attributes, its item coordinate's attributes, the request a resumed run must repeat)."""
    source = inputs.source
    attrs = {"Conventions": "CF-1.8", "title": f"predictions of a {cfg.model.model} model, task {cfg.data.task}",
             "source": f"predict.py: checkpoint {saved.path} (step {saved.step}), config {cfg.name}, model_class "
                       f"{cfg.model.model_class}", "inputs": source, "task": cfg.data.task,
             "amp_dtype": args.amp_dtype, "tiles": f"{args.tile} cells, overlap {args.overlap}" if args.tile else "none"}
    if inputs.notes:
        attrs["comment"] = "; ".join(inputs.notes)
    if ensemble is not None:
        attrs["ensemble"] = ", ".join(f"{k} {v}" for k, v in ensemble.describe().items())
    item_attrs = {"long_name": "initial time of the forecast" if steps else "valid time"} if inputs.dim == "time" \
        else {"long_name": "input box", "units": "1"}
    request = {"checkpoint": str(saved.path.resolve()), "step": saved.step, "inputs": source, "rename": args.rename,
               "items": [str(c) for c in np.asarray(inputs.coords)[chosen]], "steps": steps, "tile": args.tile,
               "overlap": args.overlap, "batch_size": args.batch_size, "amp_dtype": args.amp_dtype,
               **({"ensemble": ensemble.describe()} if ensemble is not None else {})}
    return attrs, item_attrs, request


def save_picture(path: Path, cfg, inputs: Inputs, first: int, out: Path, steps: Optional[int]) -> bool:
    """The first item's prediction (read back from the output) beside its truth and the error; False without truth."""
    truth = inputs.truth(first, 1 if steps else 0)
    if truth is None:
        return False
    xr = xarray()
    names = list(cfg.data.channel_names)
    opened = xr.open_zarr(out, chunks=None) if out.suffix == ".zarr" else xr.open_dataset(out)
    with opened as ds:
        ds = ds.isel(realization=0) if "realization" in ds.dims else ds  # an ensemble's first member
        pred = torch.from_numpy(channel_values(ds, names)[0])
    x = inputs.read(first)
    if cfg.data.task == "sr":
        save_sample_png(path, x, bicubic_upsample(x, truth.shape[-1] // x.shape[-1], size=truth.shape[-2:]), pred,
                        truth, names)
    elif cfg.data.task == "forecast":
        shown = [names.index(n) for n in cfg.data.key_channels[:2]] or None
        save_forecast_png(path, x, truth, pred[0], names, channels=shown)
    elif cfg.data.task == "diagnostic":
        shown = [names.index(n) for n in cfg.data.key_channels[:2]] or None
        save_diagnostic_png(path, None, truth, pred, names, channels=shown)
    else:
        save_volume_png(path, x, pred, truth, getattr(inputs, "input_names", None), names)
    return True


# ----------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    env = read_dist_env()
    if env.world_size > 1:
        env, device = init_distributed(args.dist_timeout_s)
    else:
        device = pick_device(args.device)
    rank, world = env.rank, env.world_size

    saved = read_checkpoint(args.checkpoint)
    overrides = {"data_dir": args.data_dir} if args.data_dir else {}
    # The ensemble keys checked on their own: a bad one is said as itself, not as a checkpoint that fails to build.
    ensemble_keys = section_values("ensemble", {k[len("cfg__"):]: v for k, v in vars(args).items()
                                                if k.startswith("cfg__")})
    validate_ensemble(EnsembleConfig(**ensemble_keys))
    overrides.update(ensemble_keys)
    tasks = (args.task,) if args.task else TASKS
    cfg = config_from_checkpoint(saved, overrides, tasks, f"--task {args.task} takes no other task",
                                 config_name=args.config or "",
                                 config_file=Path(args.config_file) if args.config_file else None)
    steps = (args.steps or DEFAULT_STEPS) if cfg.data.task == "forecast" else None
    said = [k[len("cfg__"):] for k in vars(args) if k.startswith("cfg__")]
    if (args.members or said) and cfg.data.task != "forecast":
        raise ConfigError(f"--members and the ensemble keys are for forecasts; this checkpoint's task is {cfg.data.task}")
    if said and not args.members:
        raise ConfigError(f"--{said[0]} perturbs an ensemble's members: give --members M")
    inputs = open_inputs(cfg, args)
    chosen = select(np.asarray(inputs.coords), args.times)
    configure_backends(cfg)
    model = load_model(cfg, saved, device)
    scale, out_shape = probe(cfg, model, device, inputs, args)
    need = memory_needed(model, device, args, (args.batch_size, *inputs.read(0).shape))
    if args.compile:
        model = torch.compile(model)
    ensemble = None
    if args.members:
        latitude = layout_grid_latitude(inputs, scale, out_shape)
        ensemble = Ensemble(cfg, args.members, latitude, inputs)
        for member in range(args.members):  # a lagged member without its start: said before anything is written
            for item in chosen:
                ensemble.start(item, member)
    layout = layout_for(cfg, inputs, out_shape, scale, steps, args.members)
    attrs, item_attrs, request = describe(cfg, saved, args, inputs, chosen, steps, ensemble)

    store = Store(args.out, request)
    batch = args.batch_size
    batches = [chosen[u:u + batch] for u in range(0, len(chosen), batch)]
    # A unit is one batch of items of one member (None: the deterministic forecast); units are dealt to the ranks
    # in turn, so that M members of few times keep every rank busy.
    units = [(member, items) for member in (range(args.members) if args.members else [None]) for items in batches]
    done = store.prepare(lambda: layout.template(np.asarray(inputs.coords)[chosen], attrs, item_attrs, batch),
                         len(units))
    mine = [u for u in range(len(units)) if u % world == rank and u not in done]
    predictor = Predictor(model, device, args, steps, ensemble)
    if rank == 0:
        resumed = f", {sum(len(units[u][1]) for u in done)} written before" if done else ""
        what = f"{steps} steps of {layout.lead_text} from each " if steps else ""
        members = f" x {args.members} members ({cfg.ensemble.perturbation})" if args.members else ""
        print(f"predict: {cfg.data.task} with {saved.path} (step {saved.step}) on {device}: {what}{len(chosen)} of "
              f"{inputs.count(len(inputs))}{members}{resumed}, {world} rank{'s' if world > 1 else ''}", flush=True)
        how = f"in {args.tile}-cell tiles" if args.tile else "whole"
        if need is not None:
            print(f"memory: {need / GB:.3g} GB estimated for one batch of {inputs.count(args.batch_size)} ({how}), "
                  "parameters included", flush=True)

    cfg.train.run_dir, cfg.train.ckpt_every_minutes, cfg.dist.dist_timeout_s = str(store.progress), 0.0, args.dist_timeout_s
    stop = StopRequest(cfg)  # SIGTERM / SIGUSR1: every rank stops after the same batch
    rounds = len(mine)
    if world > 1:
        counts = torch.tensor([rounds])
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        rounds = int(counts)
    todo = sum(len(units[u][1]) for u in range(len(units)) if u not in done)
    bar = tqdm(total=todo, disable=rank != 0 or not show_progress(args.progress), unit=inputs.dim)
    started = time.perf_counter()

    def read(unit: int) -> torch.Tensor:
        member, items = units[unit]
        return torch.stack([inputs.read(ensemble.start(i, member) if ensemble else i) for i in items])

    def write(values: np.ndarray, unit: int) -> None:
        member, items = units[unit]
        with reporting_write_failures("prediction", store.partial, hint="free space and run the same command again "
                                      "to continue"):
            store.write(layout.region(values), chosen.index(items[0]), unit, member)

    # On a GPU, reading the next batch and writing the last one overlap the prediction: one thread each, one batch
    # ahead. On the CPU they would share its cores and the GIL with the forward (2 cores, 48-cell tiles: 5.9 times/s
    # with the threads, 8.3 without), so they run in turn there.
    overlap = device.type == "cuda"
    with _executor(overlap) as reader, _executor(overlap) as writer:
        batch = reader.submit(read, mine[0]) if mine else None
        written_unit = None
        for r in range(rounds):
            asked, _ = stop.agreed()
            if asked:
                break
            written = 0
            if r < len(mine):
                x = batch.result()
                batch = reader.submit(read, mine[r + 1]) if r + 1 < len(mine) else None
                values = predictor(x, units[mine[r]][1], units[mine[r]][0]).numpy()
                if written_unit is not None:
                    written_unit.result()
                written_unit = writer.submit(write, values, mine[r])
                written = len(units[mine[r]][1])
            if world > 1:
                count = torch.tensor([written])
                dist.all_reduce(count)
                written = int(count)
            bar.update(written)
        if written_unit is not None:
            written_unit.result()  # recorded as done only once written
    bar.close()
    stop_watching()
    if stop.signal:
        if rank == 0:
            print(f"stopped by {stop.signal}: {store.partial} holds what is written; run the same command again to "
                  f"continue (exit code {EXIT_STOPPED})", flush=True)
        cleanup_distributed()
        return EXIT_STOPPED
    barrier()
    if rank == 0:
        out = store.finish(len(units))
        elapsed = time.perf_counter() - started
        members = f" x {args.members} members" if args.members else ""
        print(f"wrote {out}: {inputs.count(len(chosen))}{members} of {', '.join(layout.variables)} "
              f"({todo / max(elapsed, 1e-9):.2f} {inputs.plural}/s)", flush=True)
        if device.type == "cuda":
            print(f"memory: {torch.cuda.max_memory_allocated(device) / GB:.3g} GB measured (the peak of this run, "
                  "torch.cuda.max_memory_allocated)", flush=True)
        picture = Path(args.picture) if args.picture and args.picture != "none" else out.with_suffix(".png")
        if args.picture != "none" and save_picture(picture, cfg, inputs, chosen[0], out, steps):
            print(f"picture of {inputs.dim} {shown(np.asarray(inputs.coords)[chosen[0]])}: {picture}", flush=True)
    barrier()
    cleanup_distributed()
    return 0


if __name__ == "__main__":
    run_cli(main)
