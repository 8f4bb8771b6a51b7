"""The seam error of tiled prediction: a field (or box) that fits predicted whole and in tiles, per tile and overlap.

    python benchmarks/seam_error.py --checkpoint runs/quickstart --tiles 32 48 --overlaps 0 8 16 24
    python benchmarks/seam_error.py --checkpoint runs/unet3d_quickstart --tiles 32 --overlaps 8 16

For each tile side and overlap (input cells; utils/predict/tiles.py) the tiled prediction of the first item of the
checkpoint's validation split (``--item``) is compared with the whole field's, channel by channel, relative to that
channel's standard deviation over the field: the largest difference (``max``) and the root mean square (``rms``),
the worst channel of each. ``--amp_dtype bf16`` adds the error of a bf16 forward of the whole field against fp32's
(autocast), the yardstick a seam error should stay under. Prints the device and torch version with the table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_model import cpu_description  # noqa: E402

from predict import Predictor, open_inputs  # noqa: E402
from utils.checkpoint.reading import read_checkpoint  # noqa: E402
from utils.predict.model import config_from_checkpoint, load_model  # noqa: E402
from utils.predict.tiles import tile_count  # noqa: E402
from utils.training import pick_device, run_cli  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run folder, a step_N.pt file or a DCP folder")
    parser.add_argument("--tiles", type=int, nargs="+", default=[32, 48], help="tile sides (input cells)")
    parser.add_argument("--overlaps", type=int, nargs="+", default=[0, 8, 16, 24], help="overlaps (input cells)")
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--split", default=None)
    parser.add_argument("--item", type=int, default=0, help="which item of the split (default: the first)")
    parser.add_argument("--amp_dtype", default="none", help="also compare a whole-field forward in this dtype")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return parser.parse_args(argv)


def relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max, rms) of |a - b| per channel over b's standard deviation, worst channel (item tensors: C, *grid)."""
    dims = tuple(range(1, b.dim()))
    std = b.double().std(dim=dims)
    diff = (a.double() - b.double()).abs()
    return (float((diff.amax(dim=dims) / std).max()), float((diff.pow(2).mean(dim=dims).sqrt() / std).max()))


def main(argv=None) -> int:
    args = parse_args(argv)
    device = pick_device(args.device)
    saved = read_checkpoint(args.checkpoint)
    cfg = config_from_checkpoint(saved, {"data_dir": args.data_dir} if args.data_dir else {}, ("sr", "volume"),
                                 "tiles are for fields and boxes (tasks sr and volume)")
    options = argparse.Namespace(split=args.split, input=None, rename=None, steps=None, tile=0, overlap=0,
                                 amp_dtype="none")
    inputs = open_inputs(cfg, options)
    model = load_model(cfg, saved, device)
    x = inputs.read(args.item)[None]
    whole = Predictor(model, device, options, None)
    started = time.perf_counter()
    reference = whole(x)[0]
    seconds = time.perf_counter() - started
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_description()
    print(f"seam error of {saved.path} (step {saved.step}, {cfg.model.model_class}), item {args.item}: input "
          f"{'x'.join(map(str, x.shape[2:]))} -> {'x'.join(map(str, reference.shape[1:]))}, whole in {seconds:.2f} s")
    print(f"device: {where}; torch {torch.__version__}, python {platform.python_version()}")
    print(f"{'tile':>5s} {'overlap':>7s} {'tiles':>5s} {'max':>9s} {'rms':>9s} {'seconds':>8s}")
    for tile in args.tiles:
        for overlap in args.overlaps:
            if overlap >= tile:
                continue
            tiled = Predictor(model, device, argparse.Namespace(tile=tile, overlap=overlap, amp_dtype="none"), None)
            started = time.perf_counter()
            pred = tiled(x)[0]
            seconds = time.perf_counter() - started
            worst, rms = relative(pred, reference)
            print(f"{tile:5d} {overlap:7d} {tile_count(x.shape[2:], tile, overlap):5d} {worst:9.2e} {rms:9.2e} "
                  f"{seconds:8.2f}")
    if args.amp_dtype != "none":
        low = Predictor(model, device, argparse.Namespace(tile=0, overlap=0, amp_dtype=args.amp_dtype), None)
        worst, rms = relative(low(x)[0], reference)
        print(f"whole field in {args.amp_dtype} against fp32: max {worst:.2e}, rms {rms:.2e}")
    return 0


if __name__ == "__main__":
    run_cli(main)
