"""Probabilistic scores of an ensemble forecast (a store with a ``realization`` dimension; evaluate.py), by
WeatherBench 2's definitions (weatherbench2/metrics.py; Rasp et al. 2024), with the latitude weights and the time
means of the deterministic scores (utils/predict/scores.py). For M members X_1..X_M and the truth Y at a cell:

- CRPS = skill - spread, skill = (1/M) sum_m |X_m - Y| (E|X - Y|), spread = sum_ij |X_i - X_j| / (2M(M-1)) (half of
  E|X - X'|, the fair estimator: unbiased for the ensemble's distribution, so that a small ensemble is not
  penalised for its size; WB2's CRPSSpread); each is a time mean of spatial means, and CRPS their difference.
  The pair sum is computed from the sorted members, sum_ij |X_i - X_j| = 2 sum_k (2k - M + 1) X_(k) (k from 0),
  in M log M rather than M^2;
- ensemble-mean RMSE = sqrt(time mean of the spatial mean of (mean_m X_m - Y)^2) (WB2's EnsembleMeanRMSE: the
  root after the time mean, as the deterministic RMSE);
- debiased ensemble-mean RMSE = sqrt(time mean of the spatial mean of (mean_m X_m - Y)^2 - s^2 / M), s^2 the
  members' variance with ddof 1 (WB2's DebiasedEnsembleMeanMSE, under the root): the ensemble mean's MSE has a
  bias s^2 / M against an infinite ensemble's, which this removes; NaN where the difference is negative;
- ensemble spread = sqrt(time mean of the spatial mean of s^2) (WB2's EnsembleStddev, ddof 1), and the
  spread-skill ratio = spread / ensemble-mean RMSE (WB2's SpreadSkillRatio; near 1 for a reliable ensemble,
  below 1 under-dispersive);
- rank histogram: at each cell the rank of Y among the members, the count of members below it (0..M), ties with
  members broken at random (uniform among the tied positions, from a generator seeded by --seed, the initial time's
  index and the lead, so that the result does not depend on how the times are read); per lead, the time mean of
  each time's area-weighted frequency of each rank (sum 1). Flat for a reliable ensemble, U-shaped for an
  under-dispersive one.

A deterministic forecast scored beside an ensemble (persistence, climatology) is a one-member ensemble: its CRPS is
its MAE (WB2's convention), its spread and spread-skill ratio 0, its ensemble-mean RMSE its RMSE; the debiased RMSE
needs two members: NaN.
"""

from __future__ import annotations

import numpy as np

ENSEMBLE_METRICS = ("crps", "crps_skill", "crps_spread", "ensemble_mean_rmse", "debiased_ensemble_mean_rmse",
                    "ensemble_spread", "spread_skill_ratio")
REALIZATION = "realization"  # WeatherBench 2's ensemble dimension


def _spatial_mean(x: np.ndarray, weights: np.ndarray) -> np.ndarray:
    return (x * weights[:, None]).mean(axis=(-2, -1))


def fair_spread(members: np.ndarray) -> np.ndarray:
    """sum_ij |X_i - X_j| / (2M(M-1)) over the first axis (module docstring)."""
    m = members.shape[0]
    ordered = np.sort(members, axis=0)
    coefficients = (2 * np.arange(m) - m + 1).reshape(-1, *[1] * (members.ndim - 1))
    return (coefficients * ordered).sum(axis=0) / (m * (m - 1))


def per_time(members: np.ndarray, truth: np.ndarray, weights: np.ndarray) -> dict[str, np.ndarray]:
    """Each initial time's spatial means (time, [level]) of members (M, time, [level], lat, lon) against truth."""
    x, y = members.astype(np.float64), truth.astype(np.float64)
    mean = x.mean(axis=0)
    return {"skill": _spatial_mean(np.abs(x - y).mean(axis=0), weights),
            "spread": _spatial_mean(fair_spread(x), weights),
            "mean_se": _spatial_mean((mean - y) ** 2, weights),
            "variance": _spatial_mean(x.var(axis=0, ddof=1), weights)}


def ranks(members: np.ndarray, truth: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The truth's rank among the members at each cell (module docstring): members (M, ...), truth (...)."""
    below = (members < truth).sum(axis=0)
    tied = (members == truth).sum(axis=0)
    return below + np.floor(rng.random(truth.shape) * (tied + 1)).astype(np.int64)


def rank_frequencies(rank: np.ndarray, members: int, weights: np.ndarray) -> np.ndarray:
    """Area-weighted frequency of each rank 0..M of one time's ranks ([level], lat, lon) -> ([level], M + 1)."""
    flat = rank.reshape(-1, *rank.shape[-2:])
    cell = np.broadcast_to(weights[:, None], flat.shape[-2:]).ravel()
    freq = np.stack([np.bincount(r.ravel(), weights=cell, minlength=members + 1) / cell.sum() for r in flat])
    return freq.reshape(*rank.shape[:-2], members + 1)


class EnsembleSums:
    """Per variable: sums over initial times of each lead's :func:`per_time` statistics and rank frequencies."""

    def __init__(self, variables, members: int, leads: int, seed: int):
        self.members, self.leads, self.seed = members, leads, seed
        self.stats: dict = {name: {} for name in variables}
        self.hist: dict = {name: None for name in variables}

    def add(self, lead: int, rows: np.ndarray, members: dict, truth: dict, weights: np.ndarray) -> None:
        """``rows``: the scored initial times' indices in the forecast (their tie-breaking seeds)."""
        for name, values in members.items():
            stats = per_time(values, truth[name], weights)
            for key, value in stats.items():
                into = self.stats[name].setdefault(key, np.zeros((self.leads, *value.shape[1:])))
                into[lead] += value.sum(axis=0)
            for k, row in enumerate(rows):
                rng = np.random.default_rng([self.seed, int(row), lead])
                freq = rank_frequencies(ranks(values[:, k], truth[name][k], rng), self.members, weights)
                # A level the variable lacks (NaN) has no rank: NaN, as its deterministic scores are.
                freq = np.where(np.isnan(stats["skill"][k])[..., None], np.nan, freq)
                if self.hist[name] is None:
                    self.hist[name] = np.zeros((self.leads, *freq.shape))
                self.hist[name][lead] += freq

    def metrics(self, name: str, count: np.ndarray) -> dict[str, np.ndarray]:
        """ENSEMBLE_METRICS of a variable from its sums, ``count`` initial times per lead (shaped to broadcast)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = {k: v / count for k, v in self.stats[name].items()}
            rmse = np.sqrt(mean["mean_se"])
            spread = np.sqrt(mean["variance"])
            debiased = mean["mean_se"] - mean["variance"] / self.members
            return {"crps": mean["skill"] - mean["spread"], "crps_skill": mean["skill"], "crps_spread": mean["spread"],
                    "ensemble_mean_rmse": rmse, "debiased_ensemble_mean_rmse": np.sqrt(np.where(debiased >= 0,
                                                                                                  debiased, np.nan)),
                    "ensemble_spread": spread, "spread_skill_ratio": spread / rmse}

    def histogram(self, name: str, count: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.hist[name] / count


def as_one_member(deterministic: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ENSEMBLE_METRICS of a deterministic forecast from its RMSE and MAE (module docstring)."""
    zero = np.zeros_like(deterministic["rmse"])
    return {"crps": deterministic["mae"], "crps_skill": deterministic["mae"], "crps_spread": zero,
            "ensemble_mean_rmse": deterministic["rmse"], "debiased_ensemble_mean_rmse": np.full_like(zero, np.nan),
            "ensemble_spread": zero, "spread_skill_ratio": zero}
