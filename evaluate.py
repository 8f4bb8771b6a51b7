"""Judge forecasts by WeatherBench 2's definitions: RMSE, bias, MAE and ACC per variable, level and lead time, beside
persistence and climatology, and zonal energy spectra.

    python evaluate.py --forecast runs/vit_quickstart/forecasts.zarr --truth datasets/synthetic_vit --out scores.nc
    python evaluate.py --forecast f.zarr --truth era5_1440x721.zarr --climatology era5_climatology.zarr --out s.nc
    python evaluate.py --forecast f.zarr --truth datasets/synthetic_vit --out s.nc --png scorecard.png

--forecast: a store in WeatherBench 2's layout (predict.py writes one). --truth: a data folder of the training layout
(the split that holds the forecast's initial times, where it was made, or --split) or a Zarr store / netCDF file in
the forecast's layout. Each (initial time, lead) is verified at initial time + lead (for monthly data, lead counts
calendar months), matched exactly to the truth's recorded times, or by calendar month (year, month) where the truth is
monthly (its times a month apart: archives stamp each month at its centre, at hours that wander); pairs the truth
lacks are dropped and counted in the output's attributes. The climatology (ACC's reference and a baseline) is a file
of WeatherBench 2's layout (--climatology), or the mean by day of year and hour of day (monthly data: by calendar
month) of the truth folder's training split (--climatology_split).

The output (utils/predict/scores.py has the definitions): netCDF with a data variable per forecast variable, dims
``forecast`` (model, persistence, climatology), ``metric`` (rmse, bias, mae, acc), ``lead_time``, [``level``]; the
zonal energy spectra in its group ``spectra`` (xr.open_dataset(out, group="spectra")). --png writes a scorecard
(the model's RMSE relative to --reference, per variable and lead) and ``<png>.curves.png`` (RMSE and ACC against
lead). An ensemble (a ``realization`` dimension: predict.py --members) is scored as its mean by those metrics and
by WeatherBench 2's probabilistic ones (CRPS, spreads, spread-skill ratio: more ``metric`` entries; rank histograms in
the group ``rank_histogram``; utils/predict/ensemble_scores.py), --deterministic scoring a deterministic forecast of
the same times beside it; --png then adds ``<png>.ensemble.png`` (CRPS against lead, rank histograms). Bad input is
one line and exit code 2; the outputs get their names only when complete.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import numpy as np

from utils.checkpoint.files import replaced_atomically, reporting_write_failures
from utils.cli import OneLineParser
from utils.data.common import DataError
from utils.predict.scores import (BASELINES, MONTHS, evaluate, grid_of, index_in, lead_times, match_by_month,
                                  scored_pairs, verifying_times)
from utils.predict.truth import Climatology, FolderTruth, StoreTruth, open_store
from utils.training import run_cli

CURVE_ROWS = (("geopotential", 500.0), ("temperature", 850.0), ("2m_temperature", None),
              ("10m_u_component_of_wind", None))  # WeatherBench 2's headline variables, where present
STYLES = {"model": "o-", "deterministic": "D-.", "persistence": "s--", "climatology": "^:"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = OneLineParser(prog="evaluate.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forecast", required=True, help="the forecasts: a Zarr store or netCDF file (predict.py's)")
    parser.add_argument("--truth", required=True, help="a data folder of the training layout, or a Zarr / netCDF "
                                                       "store in the forecast's layout")
    parser.add_argument("--out", required=True, help="the scores: OUT.nc")
    parser.add_argument("--split", default=None, help="truth folder: the split to verify against (default: the one "
                                                      "holding most of the forecast's initial times)")
    parser.add_argument("--climatology", default=None, help="a climatology file of WeatherBench 2's layout (default: "
                                                            "from the truth folder's --climatology_split)")
    parser.add_argument("--climatology_split", default="train", help="truth folder: the split the climatology is "
                                                                     "computed from (default train)")
    parser.add_argument("--baselines", nargs="*", choices=BASELINES, default=list(BASELINES),
                        help="baselines scored beside the model (default: both; none: give the flag alone)")
    parser.add_argument("--png", default=None, help="scorecard picture (and <png>.curves.png beside it)")
    parser.add_argument("--reference", choices=BASELINES, default=None,
                        help="the scorecard's reference (default persistence; climatology for fields without leads)")
    parser.add_argument("--chunk", type=int, default=8, help="initial times read at once (default 8)")
    parser.add_argument("--deterministic", default=None, help="ensembles: a deterministic forecast of the same times "
                        "and leads (predict.py without --members) scored beside them")
    parser.add_argument("--seed", type=int, default=0, help="ensembles: the seed of the rank histogram's ties "
                                                            "(default 0)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if Path(args.out).suffix.lower() not in (".nc", ".nc4"):
        raise DataError(f"--out {args.out}: name a netCDF file (.nc)")
    for out in (args.out, args.png):
        if out and Path(out).exists():
            raise DataError(f"--out/--png {out} exists: choose another name, or delete it to evaluate again")
    if args.png and Path(args.png).suffix.lower() != ".png":
        raise DataError(f"--png {args.png}: name a .png file")
    if args.chunk < 1:
        raise DataError(f"--chunk must be >= 1, got {args.chunk}")


def without_leads_at_lead_0(ds, args):
    """A store of fields at their own times (predict.py's for tasks sr and diagnostic: no prediction_timedelta) is
    scored at lead 0; persistence, which at lead 0 is the truth itself, is left out."""
    if "prediction_timedelta" in ds.dims or "time" not in ds.dims:
        return ds  # grid_of says what else is wrong
    dropped = "persistence" in args.baselines
    args.baselines = [b for b in args.baselines if b != "persistence"]
    if args.reference == "persistence":
        raise DataError(f"{args.forecast} holds fields without lead times (a diagnostic or super-resolution model's): "
                        "persistence is no reference at lead 0; give --reference climatology or leave it out")
    print(f"evaluate: {args.forecast} holds fields without lead times: scored at their own times (lead 0)"
          + (", without persistence (at lead 0 it is the truth)" if dropped else ""), flush=True)
    return ds.expand_dims(prediction_timedelta=[np.timedelta64(0, "ns")], axis=1)


def split_folders(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.h5")))


def stamp(t) -> str:
    return str(np.datetime_as_string(np.datetime64(t), unit="m"))


def forecast_split(root: Path, ds, grid) -> Path:
    """The split the forecast was made on: the one holding most of its initial times (ties, or none anywhere: most of
    its verifying times); said on the console. None holding either: one line listing what each split holds."""
    folders = split_folders(root)
    if not folders:
        raise DataError(f"--truth {root}: no split folder with .h5 files, and not a Zarr store")
    leads, monthly = lead_times(ds)
    initial = np.asarray(ds["time"].values).astype("datetime64[ns]")
    verifying = verifying_times(initial, leads, monthly)
    held, spans = [], []
    for folder in folders:
        times = FolderTruth(folder, grid).times
        by_month = match_by_month(times, monthly)
        held.append((int((index_in(initial, times, by_month) >= 0).sum()),
                     int((index_in(verifying, times, by_month) >= 0).sum()), folder))
        spans.append(f"{folder.name} {stamp(times.min())} to {stamp(times.max())}")
    starts, ends, split = max(held, key=lambda h: h[:2])
    if not starts and not ends:
        raise DataError(f"--truth {root}: no split holds any of the forecast's {len(initial)} initial times "
                        f"({stamp(initial.min())} to {stamp(initial.max())}) or their verifying times (splits: "
                        f"{', '.join(spans)}); give the data the forecast was made from")
    print(f"evaluate: truth split {split.name}: it holds {starts} of the forecast's {len(initial)} initial times "
          f"and {ends} of its {verifying.size} verifying times (--split to choose another)", flush=True)
    return split


def open_truth(args, ds, grid):
    """(the truth, the climatology or None) from --truth, --split, --climatology."""
    root = Path(args.truth)
    climatology = Climatology.from_file(Path(args.climatology), grid) if args.climatology else None
    if not root.is_dir() or root.suffix == ".zarr":
        return StoreTruth(root, grid), climatology
    split = root / args.split if args.split else forecast_split(root, ds, grid)
    truth = FolderTruth(split, grid)
    scored_pairs(ds, truth)  # no verifying time there: said before a climatology is looked for
    source = root / args.climatology_split
    if climatology is None and (source.is_dir() or "climatology" in args.baselines):  # else: no ACC, said in attrs
        if source.resolve() == split.resolve():
            raise DataError(f"--climatology_split {args.climatology_split} is the split being verified: a climatology "
                            "of the truth itself would flatter ACC; give another split or --climatology FILE")
        climatology = Climatology.from_split(FolderTruth(source, grid))
    return truth, climatology


def rows_of(scores) -> list[tuple[str, str, Optional[float]]]:
    """(label, variable, level) of every scored row: a variable, or a variable at one level it has."""
    rows = []
    for name, var in scores.data_vars.items():
        if "level" not in var.dims:
            rows.append((name, name, None))
            continue
        for level in scores["level"].values:
            if np.isfinite(var.sel(forecast="model", metric="rmse", level=level).values).any():
                rows.append((f"{name} {level:g}", name, float(level)))
    return rows


def metric_of(scores, name: str, level: Optional[float], forecast: str, metric: str) -> np.ndarray:
    var = scores[name].sel(forecast=forecast, metric=metric)
    return np.asarray((var.sel(level=level) if level is not None else var).values, dtype=np.float64)


def lead_labels(scores) -> tuple[list[float], str]:
    leads = scores["lead_time"]
    if leads.attrs.get("units") == MONTHS:
        return [float(v) for v in leads.values], "months"
    return [float(v / np.timedelta64(1, "h")) for v in leads.values], "h"


def save_scorecard(path: Path, scores, reference: str, dpi: int = 110) -> None:
    """The model's RMSE relative to the reference's, in %, per row and lead: blue better, red worse."""
    from matplotlib.figure import Figure  # no pyplot: no global figure state, Agg canvas on save

    rows = rows_of(scores)
    leads, unit = lead_labels(scores)
    change = np.array([100 * (metric_of(scores, n, lv, "model", "rmse") / metric_of(scores, n, lv, reference, "rmse")
                              - 1) for _, n, lv in rows])
    # Beyond +-100 % the colour saturates: a baseline twice as good says enough, and -100 % is the floor.
    bound = min(float(np.nanmax(np.abs(change))), 100.0) if np.isfinite(change).any() else 1.0
    fig = Figure(figsize=(1.2 + 0.55 * len(leads) + 2.2, 0.8 + 0.28 * len(rows)), layout="constrained")
    ax = fig.subplots()
    image = ax.imshow(change, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    for (i, j), value in np.ndenumerate(change):
        if np.isfinite(value):
            ax.text(j, i, f"{value:+.0f}", ha="center", va="center", fontsize=7,
                    color="white" if abs(value) > 0.6 * bound else "black")
    ax.set_xticks(range(len(leads)), [f"{v:g}" for v in leads], fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows], fontsize=8)
    ax.set_xlabel(f"lead time ({unit})")
    fig.colorbar(image, ax=ax, label=f"RMSE vs {reference} (%)")
    ax.set_title(f"model RMSE relative to {reference} (negative: better)", fontsize=9)
    _save(fig, path, dpi)


def save_curves(path: Path, scores, dpi: int = 110) -> None:
    """RMSE (top) and ACC (bottom) against lead for up to four rows, every forecast scored."""
    from matplotlib.figure import Figure

    rows = rows_of(scores)
    shown = [r for r in rows if (r[1], r[2]) in CURVE_ROWS] or rows[:4]
    leads, unit = lead_labels(scores)
    fig = Figure(figsize=(3.4 * len(shown) + 0.4, 5.6), layout="constrained")
    axes = fig.subplots(2, len(shown), squeeze=False, sharex=True)
    for column, (label, name, level) in enumerate(shown):
        for row, metric in enumerate(("rmse", "acc")):
            ax = axes[row, column]
            for forecast in scores["forecast"].values:
                ax.plot(leads, metric_of(scores, name, level, str(forecast), metric), STYLES[str(forecast)],
                        label=str(forecast))
            ax.grid(alpha=0.3)
            ax.set_title(f"{label} {metric.upper()}", fontsize=9)
        axes[1, column].set_xlabel(f"lead time ({unit})")
    axes[0, 0].legend(fontsize=8)
    _save(fig, path, dpi)


def save_ensemble(path: Path, scores, ranks, dpi: int = 110) -> None:
    """An ensemble's CRPS (top) against lead beside every other forecast scored (a deterministic one's CRPS is its
    MAE), and (bottom) its rank histogram at each lead, with the flat histogram of a reliable ensemble."""
    from matplotlib.figure import Figure

    rows = rows_of(scores)
    shown = [r for r in rows if (r[1], r[2]) in CURVE_ROWS] or rows[:4]
    leads, unit = lead_labels(scores)
    fig = Figure(figsize=(3.4 * len(shown) + 0.4, 5.6), layout="constrained")
    axes = fig.subplots(2, len(shown), squeeze=False)
    bins = ranks["rank"].values
    for column, (label, name, level) in enumerate(shown):
        ax = axes[0, column]
        for forecast in scores["forecast"].values:
            kind = str(forecast)
            ax.plot(leads, metric_of(scores, name, level, kind, "crps"), STYLES[kind],
                    label="ensemble" if kind == "model" else kind)
        ax.grid(alpha=0.3)
        ax.set_title(f"{label} CRPS", fontsize=9)
        ax.set_xlabel(f"lead time ({unit})")
        ax = axes[1, column]
        histogram = ranks[name] if level is None else ranks[name].sel(level=level)
        for k, lead in enumerate(leads):
            ax.step(bins, histogram.values[k], where="mid", label=f"{lead:g} {unit}")
        ax.axhline(1 / len(bins), color="black", linestyle=":", linewidth=1, label="reliable")
        ax.set_title(f"{label} rank of the truth", fontsize=9)
        ax.set_xlabel("members below the truth")
    axes[0, 0].legend(fontsize=8)
    axes[1, 0].legend(fontsize=7)
    axes[1, 0].set_ylabel("frequency (area-weighted)")
    _save(fig, path, dpi)


def _save(fig, path: Path, dpi: int) -> None:
    with replaced_atomically(path) as temporary:
        fig.savefig(temporary, format="png", dpi=dpi)


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    forecast = without_leads_at_lead_0(open_store(Path(args.forecast)), args)
    args.reference = args.reference or ("persistence" if "persistence" in args.baselines else "climatology")
    if args.png and args.reference not in args.baselines:
        raise DataError(f"--reference {args.reference} is not among --baselines ({', '.join(args.baselines) or 'none'})")
    grid = grid_of(forecast)
    truth, climatology = open_truth(args, forecast, grid)
    deterministic = open_store(Path(args.deterministic)) if args.deterministic else None
    scores, spectra, ranks, notes = evaluate(forecast, truth, climatology, args.baselines, args.chunk, args.seed,
                                             deterministic)
    scores.attrs = {"Conventions": "CF-1.8", "title": "forecast scores by WeatherBench 2's definitions",
                    "source": f"evaluate.py: forecast {args.forecast}, truth {truth.where}",
                    "latitude_weights": "sin(upper cell bound) - sin(lower cell bound), normalised to mean 1; bounds "
                                        "halfway between rows, the poles beyond the first and last (WeatherBench 2)",
                    "rmse": "sqrt of the time mean of the weighted spatial MSE", "bias": "forecast - truth",
                    "acc": "time mean of each time's uncentred anomaly correlation; anomalies from the climatology",
                    **notes}
    spectra.attrs = {"title": "zonal energy spectra (utils/predict/scores.py)", "source": scores.attrs["source"]}
    out = Path(args.out)
    with reporting_write_failures("scores", out, hint="free space and run it again"), \
            replaced_atomically(out) as temporary:
        scores.to_netcdf(temporary)
        spectra.to_netcdf(temporary, mode="a", group="spectra")
        if ranks is not None:
            ranks.attrs = {"title": "rank histograms of the truth among the ensemble's members "
                                    "(utils/predict/ensemble_scores.py)", "source": scores.attrs["source"],
                           "ties": f"broken at random, seed {args.seed}"}
            ranks.to_netcdf(temporary, mode="a", group="rank_histogram")
    print(f"evaluate: verifying times matched {notes['verifying_times_matched']}", flush=True)
    print(f"evaluate: {len(grid.variables)} variables, {len(scores.lead_time)} leads, {notes['verifying_times_scored']}"
          f" verifying times scored, {notes['verifying_times_dropped']} dropped (not in the truth) against "
          f"{truth.where}; climatology: {notes['climatology']}", flush=True)
    rows = rows_of(scores)
    leads, unit = lead_labels(scores)
    for label, name, level in rows[:4]:
        print(f"{label}: lead {leads[0]:g} {unit} RMSE " + ", ".join(
            f"{k} {metric_of(scores, name, level, str(k), 'rmse')[0]:.4g}" for k in scores["forecast"].values),
            flush=True)
    if ranks is not None:
        for label, name, level in rows[:4]:
            print(f"{label}: lead {leads[0]:g} {unit} CRPS " + ", ".join(
                f"{'ensemble' if k == 'model' else k} {metric_of(scores, name, level, str(k), 'crps')[0]:.4g}"
                for k in scores["forecast"].values) + f"; spread-skill ratio "
                f"{metric_of(scores, name, level, 'model', 'spread_skill_ratio')[0]:.3g}", flush=True)
    print(f"wrote {out} (spectra in its group 'spectra'{', rank histograms in rank_histogram' if ranks is not None else ''})",
          flush=True)
    if args.png:
        png = Path(args.png)
        save_scorecard(png, scores, args.reference)
        curves = png.with_suffix(".curves.png")
        save_curves(curves, scores)
        pictures = [png, curves]
        if ranks is not None:
            pictures.append(png.with_suffix(".ensemble.png"))
            save_ensemble(pictures[-1], scores, ranks)
        print(f"pictures: {', '.join(map(str, pictures))}", flush=True)
    return 0


if __name__ == "__main__":
    run_cli(main)
