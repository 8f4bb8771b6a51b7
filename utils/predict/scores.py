"""Forecasts judged by WeatherBench 2's definitions (evaluate.py): per variable, level and lead time, the RMSE, bias,
MAE and ACC of the model and of the baselines (persistence, climatology), and zonal energy spectra.

Definitions (WeatherBench 2, weatherbench2/metrics.py; Rasp et al. 2024, "WeatherBench 2"):

- a latitude row's weight is the area of its cells: sin(upper cell bound) - sin(lower cell bound), the bounds
  halfway to the neighbouring rows and, for the first and last rows, at the poles (WeatherBench 2's get_lat_weights:
  the outermost cells reach the poles wherever those rows lie), normalised to mean 1 (not cos(latitude), which gives
  a pole row no weight and the rows beside it too much);
- spatial means are weighted means over latitude and longitude of each initial time's field;
- RMSE = sqrt(time mean of the spatial MSE): the square root after the mean over initial times, not a mean of
  per-time RMSEs; bias (forecast - truth) and MAE are time means of spatial means;
- ACC = time mean of each time's sum(w f' o') / sqrt(sum(w f'^2) sum(w o'^2)), with f' and o' the forecast's and the
  truth's anomalies from the climatology at the verifying time (day of year and hour of day, monthly data's by
  calendar month; WeatherBench 2's is ERA5 1990-2019, here the truth folder's training split or a given file). The
  verifying time is the matched truth record's: exactly initial time + lead, or for monthly data (stamps a month
  apart, at any day and hour) the record of the calendar month reached. The climatology as a forecast has no
  anomaly: its ACC is undefined, NaN. (The training logs' ACC keeps NERSC's convention instead: one time-mean
  climatology, cos-latitude weights; utils/observe/scores.py.)
- zonal energy spectrum of a field, as WeatherBench 2's ZonalEnergySpectrum: per latitude circle, E_k = c_k |X_k|^2 L,
  where X_k is the k-th coefficient of the discrete Fourier transform along longitude divided by the number of
  points, c_0 = 1 and c_k = 2 for every k > 0 (WB2 doubles the Nyquist wavenumber too, so with an even number of
  longitudes the sum exceeds the circle's mean square by that term), and L = 2 pi R cos(latitude) the circle's
  length, R = 6,367.5 km (WB2's: the mean of the equatorial and polar radii). WB2 keeps the latitude dimension; here
  the spectra are averaged over latitudes with the weights above, then over times.

Results: a Dataset with one data variable per forecast variable, dims ``forecast`` (model, persistence,
climatology), ``metric`` (rmse, bias, mae, acc; for an ensemble also utils/predict/ensemble_scores.py's, the
deterministic ones of its mean), ``lead_time``, and ``level`` where the variable has levels; the
coordinate ``samples`` (forecast, lead_time) counts the initial times scored. Spectra: a second Dataset of the same
variables, dims ``forecast`` (the same, and ``truth``: the truth at the model's verifying times), ``lead_time``,
[``level``], ``zonal_wavenumber``. Rank histograms (ensembles): a third Dataset, dims ``lead_time``, [``level``],
``rank``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from utils.data.common import DataError
from utils.predict.ensemble_scores import ENSEMBLE_METRICS, REALIZATION, EnsembleSums, as_one_member
from utils.predict.truth import Climatology, Fields, Grid, is_monthly, months_of
from utils.predict.store import MONTHS, xarray

METRICS = ("rmse", "bias", "mae", "acc")
BASELINES = ("persistence", "climatology")
EARTH_RADIUS_M = 1000 * (6357 + 6378) / 2  # WeatherBench 2's (schema.py)


# ----------------------------------------------------------------------------------------- definitions


def latitude_weights(latitude: Sequence[float]) -> np.ndarray:
    """Each row's share of the sphere's area, normalised to mean 1 (module docstring), in the rows' own order.

    WeatherBench 2's get_lat_weights: on the rows sorted south to north, the cell bounds are the midpoints between
    rows and the poles themselves, so the first and last cells reach the poles whether or not a row lies there (a
    grid without its 90S row, as the project's, gives its southernmost row the whole cap below it)."""
    lat = np.asarray(latitude, dtype=np.float64)
    order = np.argsort(lat)
    ascending = np.deg2rad(lat[order])
    bounds = np.concatenate([[-np.pi / 2], (ascending[1:] + ascending[:-1]) / 2, [np.pi / 2]])
    weights = np.empty_like(ascending)
    weights[order] = np.sin(bounds[1:]) - np.sin(bounds[:-1])
    return weights / weights.mean()


def spatial_mean(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted mean over the last two axes (latitude, longitude) with row weights of mean 1."""
    return (x * weights[:, None]).mean(axis=(-2, -1))


def per_time(forecast: np.ndarray, truth: np.ndarray, climatology: Optional[np.ndarray],
             weights: np.ndarray) -> dict[str, np.ndarray]:
    """Each initial time's spatial means (time, [level]): squared error, error, absolute error, and its ACC."""
    error = forecast.astype(np.float64) - truth
    stats = {"se": spatial_mean(error ** 2, weights), "error": spatial_mean(error, weights),
             "abs": spatial_mean(np.abs(error), weights)}
    if climatology is None:
        stats["acc"] = np.full(stats["se"].shape, np.nan)
        return stats
    f, o = forecast - climatology.astype(np.float64), truth - climatology.astype(np.float64)
    norm = np.sqrt(spatial_mean(f ** 2, weights) * spatial_mean(o ** 2, weights))
    with np.errstate(invalid="ignore", divide="ignore"):  # no anomaly (the climatology itself): undefined
        stats["acc"] = np.where(norm > 0, spatial_mean(f * o, weights) / norm, np.nan)
    return stats


def over_time(sums: dict[str, np.ndarray], count) -> dict[str, np.ndarray]:
    """Metrics from the sums over initial times of :func:`per_time`: means, then the RMSE's root after its mean."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = {k: v / count for k, v in sums.items()}
    return {"rmse": np.sqrt(mean["se"]), "bias": mean["error"], "mae": mean["abs"], "acc": mean["acc"]}


def zonal_spectrum(x: np.ndarray, latitude: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Energy per zonal wavenumber (module docstring): (..., latitude, longitude) -> (..., wavenumber)."""
    n = x.shape[-1]
    power = np.abs(np.fft.rfft(x.astype(np.float64), axis=-1) / n) ** 2
    power[..., 1:] *= 2  # +k and -k, Nyquist included (as WeatherBench 2 counts it)
    length = 2 * np.pi * EARTH_RADIUS_M * np.cos(np.deg2rad(np.asarray(latitude, dtype=np.float64)))
    return (power * (length * weights)[:, None]).mean(axis=-2)


# ----------------------------------------------------------------------------------------- times


def lead_times(ds) -> tuple[np.ndarray, bool]:
    """(the forecast's leads, whether they count calendar months)."""
    leads = ds["prediction_timedelta"]
    monthly = leads.attrs.get("units") == MONTHS
    if not monthly and not np.issubdtype(leads.dtype, np.timedelta64):
        raise DataError(f"prediction_timedelta holds {leads.dtype} values without units '{MONTHS}': neither "
                        "durations nor counts of months")
    return np.asarray(leads.values), monthly


def verifying_times(initial: np.ndarray, leads: np.ndarray, monthly: bool) -> np.ndarray:
    """(time, lead) datetime64[ns]: the initial time plus the lead (calendar months: the same day and hour n
    months later)."""
    import pandas as pd  # xarray's own dependency

    initial = np.asarray(initial).astype("datetime64[ns]")
    if not monthly:
        return initial[:, None] + leads.astype("timedelta64[ns]")[None, :]
    index = pd.DatetimeIndex(initial)
    return np.stack([(index + pd.DateOffset(months=int(n))).to_numpy() for n in leads], axis=1).astype("datetime64[ns]")


def match_by_month(truth_times: np.ndarray, leads_monthly: bool) -> bool:
    """Monthly data (the truth's stamps, :func:`is_monthly`) are matched by calendar month, all else exactly; a
    truth of one time has no spacing: the forecast's leads (counts of months or durations) decide."""
    if len(np.unique(np.asarray(truth_times))) < 2:
        return leads_monthly
    return is_monthly(truth_times)


def index_in(times: np.ndarray, known: np.ndarray, by_month: bool = False) -> np.ndarray:
    """Position of each time in ``known``, -1 where it is absent: the same instant, or (``by_month``) the same
    calendar month (the first such time of ``known``)."""
    key = months_of if by_month else (lambda t: np.asarray(t).astype("datetime64[ns]").astype(np.int64))
    lookup = {}
    for i, t in enumerate(key(known).ravel()):
        lookup.setdefault(int(t), i)
    flat = key(times).ravel()
    return np.array([lookup.get(int(t), -1) for t in flat], dtype=np.int64).reshape(np.shape(times))


MATCHED = {True: "by calendar month (monthly data: the truth's times are a month apart, at any day and hour)",
           False: "exactly (initial time + lead)"}


# ----------------------------------------------------------------------------------------- the evaluation


def grid_of(ds) -> Grid:
    """The forecast's variables (with or without levels) and coordinates, checked to be WeatherBench 2's layout."""
    for dim in ("time", "prediction_timedelta", "latitude", "longitude"):
        if dim not in ds.dims:
            raise DataError(f"the forecast has no dimension '{dim}' (found: {', '.join(ds.dims)}): expected "
                            "WeatherBench 2's layout, as predict.py writes it")
    if not np.issubdtype(ds["time"].dtype, np.datetime64):
        raise DataError("the forecast's initial times are not dates (its data recorded none): no verifying time can "
                        "be matched")
    variables = {}
    ensemble = (REALIZATION,) if REALIZATION in ds.dims else ()  # an ensemble's members first, on every variable
    for name, var in ds.data_vars.items():
        plain = (*ensemble, "time", "prediction_timedelta", "latitude", "longitude")
        if var.dims not in (plain, (*plain[:-2], "level", *plain[-2:])):
            raise DataError(f"forecast variable {name} has dims {var.dims}, expected {plain} with 'level' after the "
                            "lead where it has levels")
        variables[name] = "level" in var.dims
    if not variables:
        raise DataError("the forecast holds no data variable")
    levels = np.asarray(ds["level"].values, dtype=np.float64) if "level" in ds.dims else np.zeros(0)
    return Grid(variables, levels, np.asarray(ds["latitude"].values, dtype=np.float64),
                np.asarray(ds["longitude"].values, dtype=np.float64))


class Sums:
    """Per forecast kind and variable: sums over initial times of each lead's per-time statistics and spectra."""

    def __init__(self, kinds: Sequence[str], grid: Grid, leads: int):
        self.kinds, self.grid = list(kinds), grid
        self.count = {kind: np.zeros(leads, dtype=np.int64) for kind in self.kinds}
        self.stats: dict = {kind: {name: {} for name in grid.variables} for kind in self.kinds}
        self.spectra: dict = {kind: {name: {} for name in grid.variables} for kind in [*self.kinds, "truth"]}
        self.leads = leads

    def add(self, kind: str, lead: int, forecast: dict, truth: dict, climatology: Optional[dict],
            weights: np.ndarray) -> None:
        for name in self.grid.variables:
            stats = per_time(forecast[name], truth[name], climatology[name] if climatology else None, weights)
            self._add(self.stats[kind][name], lead, {k: v.sum(axis=0) for k, v in stats.items()})
            self._add(self.spectra[kind][name], lead, {"energy": self.spectrum(forecast[name], weights)})
            if kind == "model":  # the truth's own spectrum at the model's verifying times
                self._add(self.spectra["truth"][name], lead, {"energy": self.spectrum(truth[name], weights)})
        self.count[kind][lead] += len(next(iter(forecast.values())))

    def spectrum(self, values: np.ndarray, weights: np.ndarray) -> np.ndarray:
        return zonal_spectrum(values, self.grid.latitude, weights).sum(axis=0)

    def _add(self, into: dict, lead: int, values: dict) -> None:
        for key, value in values.items():
            if key not in into:
                into[key] = np.zeros((self.leads, *value.shape))
            into[key][lead] += value


def check_alike(other, ds, grid: Grid) -> None:
    """A forecast scored beside ``ds`` must hold its variables, initial times, leads and grid (no realization)."""
    if REALIZATION in other.dims:
        raise DataError("--deterministic holds an ensemble (a realization dimension): give a deterministic forecast")
    other_grid = grid_of(other)
    for coord in ("time", "prediction_timedelta", "latitude", "longitude"):
        if not np.array_equal(np.asarray(other[coord].values), np.asarray(ds[coord].values)):
            raise DataError(f"--deterministic differs from the forecast in its {coord}: predict both with the same "
                            "--times and --steps")
    missing = sorted(set(grid.variables) - set(other_grid.variables))
    if missing:
        raise DataError(f"--deterministic lacks the forecast's variable(s) {', '.join(missing)}")


def scored_pairs(ds, truth: Fields) -> tuple[np.ndarray, np.ndarray, bool]:
    """(verifying times (time, lead), their positions in the truth, -1 where absent, whether matched by month);
    none there: one line that names where it looked."""
    leads, monthly = lead_times(ds)
    verifying = verifying_times(ds["time"].values, leads, monthly)
    by_month = match_by_month(truth.times, monthly)
    at = index_in(verifying, truth.times, by_month)
    if not (at >= 0).any():
        month = " (matched by calendar month)" if by_month else ""
        span = " to ".join(np.datetime_as_string(np.array([verifying.min(), verifying.max()]), unit="m"))
        raise DataError(f"none of the forecast's {verifying.size} verifying times (from {span}){month} is among the "
                        f"truth's {len(truth.times)} in {truth.where}")
    return verifying, at, by_month


def evaluate(ds, truth: Fields, climatology: Optional[Climatology], baselines: Sequence[str], chunk: int = 8,
             seed: int = 0, deterministic=None) -> tuple:
    """(scores, spectra, rank histograms or None, notes) of the forecast Dataset ``ds`` against ``truth`` (module
    docstring); ``notes``: what the results' attributes should say (how times were matched, times dropped, the
    climatology used). An ensemble (a ``realization`` dimension) is scored as its mean by the deterministic metrics,
    and by utils/predict/ensemble_scores.py's (``seed``: the rank histogram's ties); ``deterministic``: a forecast
    Dataset of the same initial times and leads scored beside it (the same model without perturbations)."""
    grid = grid_of(ds)
    leads, monthly = lead_times(ds)
    initial = np.asarray(ds["time"].values).astype("datetime64[ns]")
    verifying, at, by_month = scored_pairs(ds, truth)
    # A verifying time is the matched record's own stamp: the climatology is looked up at the truth's time.
    verifying = np.where(at >= 0, truth.times[np.maximum(at, 0)], verifying)
    start_at = index_in(initial, truth.times, by_month)
    if "climatology" in baselines and climatology is None:
        raise DataError("the climatology baseline needs a climatology: --climatology FILE, or a truth folder with a "
                        "training split")
    if climatology is not None:
        climatology.prepare(verifying[at >= 0])
    weights = latitude_weights(grid.latitude)
    if deterministic is not None:
        check_alike(deterministic, ds, grid)
    kinds = ["model", *(["deterministic"] if deterministic is not None else []), *[b for b in BASELINES if b in baselines]]
    sums = Sums(kinds, grid, len(leads))
    members = ds.sizes.get(REALIZATION)
    if members is not None and members < 2:
        raise DataError(f"the forecast's ensemble has {members} member: the fair CRPS and the spread need 2 or more")
    ensemble = EnsembleSums(grid.variables, members, len(leads), seed) if members else None
    for first in range(0, len(initial), chunk):
        rows = np.arange(first, min(first + chunk, len(initial)))
        wanted = sorted({*at[rows][at[rows] >= 0].tolist(), *start_at[rows][start_at[rows] >= 0].tolist()})
        read = truth.read(wanted)
        where = {index: k for k, index in enumerate(wanted)}
        fields = lambda indices: {n: v[[where[i] for i in indices]] for n, v in read.items()}
        model = {name: np.asarray(ds[name].isel(time=slice(rows[0], rows[-1] + 1)).values) for name in grid.variables}
        if ensemble is not None:
            spread_out, model = model, {n: v.mean(axis=0, dtype=np.float64) for n, v in model.items()}
        if deterministic is not None:
            alone = {name: np.asarray(deterministic[name].isel(time=slice(rows[0], rows[-1] + 1)).values)
                     for name in grid.variables}
        for lead in range(len(leads)):
            scored = rows[at[rows, lead] >= 0]
            if not len(scored):
                continue
            clim = climatology.at(verifying[scored, lead]) if climatology is not None else None
            observed = fields(at[scored, lead])
            sums.add("model", lead, {n: v[scored - first, lead] for n, v in model.items()}, observed, clim, weights)
            if deterministic is not None:
                sums.add("deterministic", lead, {n: v[scored - first, lead] for n, v in alone.items()}, observed, clim,
                         weights)
            if ensemble is not None:
                ensemble.add(lead, scored, {n: v[:, scored - first, lead] for n, v in spread_out.items()}, observed,
                             weights)
            if "climatology" in kinds:
                sums.add("climatology", lead, clim, observed, clim, weights)
            if "persistence" in kinds:
                kept = start_at[scored] >= 0  # the initial state must be in the truth too
                if kept.any():
                    pick = lambda d: {n: v[kept] for n, v in d.items()} if d is not None else None
                    sums.add("persistence", lead, fields(start_at[scored][kept]), pick(observed), pick(clim), weights)
    notes = {"verifying_times_matched": MATCHED[by_month], "verifying_times_scored": int((at >= 0).sum()),
             "verifying_times_dropped": int((at < 0).sum()),
             "verifying_times_dropped_comment": "forecast (initial time, lead) pairs whose verifying time the truth "
                                                "lacks: not scored",
             "climatology": climatology.source if climatology is not None else "none: no ACC, no climatology baseline"}
    if climatology is not None and climatology.substituted:
        notes["climatology_substituted"] = (f"{climatology.substituted} {climatology.keys} keys the climatology "
                                            "lacks, served by its nearest time of year")
    if ensemble is not None:
        notes["ensemble"] = (f"{members} members (realization); the deterministic metrics are the ensemble mean's; "
                             "crps, spreads and ranks by utils/predict/ensemble_scores.py (WeatherBench 2)")
    return (*to_datasets(sums, ds, leads, monthly, ensemble), notes)


def to_datasets(sums: Sums, ds, leads: np.ndarray, monthly: bool, ensemble: Optional[EnsembleSums] = None) -> tuple:
    """The scores, the spectra and (for an ensemble, else None) the rank histograms as Datasets (module
    docstring)."""
    xr = xarray()
    grid = sums.grid
    lead_attrs = {"long_name": "lead time of the forecast", **({"units": MONTHS} if monthly else {})}
    metrics = (*METRICS, *ENSEMBLE_METRICS) if ensemble is not None else METRICS
    coords = {"metric": ("metric", list(metrics)), "lead_time": ("lead_time", leads, lead_attrs)}
    if len(grid.levels):
        coords["level"] = ("level", grid.levels, dict(ds["level"].attrs))
    scores, spectra, histograms = {}, {}, {}
    for name, leveled in grid.variables.items():
        level = ("level",) if leveled else ()
        units = ds[name].attrs.get("units")
        tables = []
        for k in sums.kinds:
            count = sums.count[k].reshape(-1, *[1] * leveled)
            values = over_time(sums.stats[k][name], count)
            if ensemble is not None:
                values.update(ensemble.metrics(name, count) if k == "model" else as_one_member(values))
            tables.append(np.stack([values[m] for m in metrics]))
        table = np.stack(tables)
        scores[name] = (("forecast", "metric", "lead_time", *level), table.astype(np.float64),
                        {"long_name": ds[name].attrs.get("long_name", name),
                         **({"units": f"{units} (rmse, bias, mae{', crps, spreads' if ensemble else ''}); 1 (acc"
                                      f"{', spread_skill_ratio' if ensemble else ''})"} if units else {})})
        if ensemble is not None:
            histograms[name] = (("lead_time", *level, "rank"),
                                ensemble.histogram(name, sums.count["model"].reshape(-1, *[1] * (1 + leveled))),
                                {"long_name": f"rank histogram of the truth among the members: {name}",
                                 "units": "1"})
        counts = [*[sums.count[k] for k in sums.kinds], sums.count["model"]]
        energy = np.stack([sums.spectra[k][name]["energy"] / np.reshape(c, (-1, *[1] * (1 + leveled)))
                           for k, c in zip([*sums.kinds, "truth"], counts)])
        spectra[name] = (("forecast", "lead_time", *level, "zonal_wavenumber"), energy,
                         {"long_name": f"zonal energy spectrum of {name}",
                          **({"units": f"({units})2 m"} if units else {})})
    samples = xr.DataArray(np.stack([sums.count[k] for k in sums.kinds]), dims=("forecast", "lead_time"),
                           attrs={"long_name": "initial times scored"})
    scores_ds = xr.Dataset(scores, coords={"forecast": ("forecast", sums.kinds), **coords, "samples": samples})
    wavenumbers = spectra[next(iter(spectra))][1].shape[-1]
    spectra_ds = xr.Dataset(spectra, coords={"forecast": ("forecast", [*sums.kinds, "truth"]),
                                             "lead_time": coords["lead_time"], **({"level": coords["level"]} if
                                                                                 "level" in coords else {}),
                                             "zonal_wavenumber": ("zonal_wavenumber", np.arange(wavenumbers),
                                                                  {"long_name": "cycles per latitude circle"})})
    ranks_ds = None
    if ensemble is not None:
        ranks_ds = xr.Dataset(histograms, coords={"lead_time": coords["lead_time"], **(
            {"level": coords["level"]} if "level" in coords else {}), "rank": ("rank", np.arange(ensemble.members + 1), {
                "long_name": "members below the truth (ties broken at random)"})})
    return scores_ds, spectra_ds, ranks_ds
