"""Write a synthetic stand-in for SuperBench's ERA5 (or NERSC's) in exactly its layout, at any size.

    python datasets/make_synthetic_era5.py --out datasets/synthetic_small \\
        --samples-per-year 32 --height 181 --width 360 --seed 0
    python datasets/make_synthetic_era5.py --out datasets/synthetic_vit --channels nersc20 \\
        --hours-per-step 6 --samples-per-year 730 --height 33 --width 64 --train-years 2008 2010

writes ``<out>/train/<year>.h5`` (one per training year) and ``<out>/valid/<year>.h5``, each with one
dataset ``fields`` of shape ``(samples_per_year, 3, height, width)``, float32, in physical units:

    channel 0  10 m kinetic energy (m^2 s^-2)   >= 0, mean ~ 6.3, std ~ 3.7
    channel 1  2 m temperature (K)              mean ~ 278, std ~ 21, colder toward the poles
    channel 2  total column water vapour        >= 0, mean ~ 18, std ~ 16 (kg m^-2)

Row 0 is 90N and the last row 90S (``height`` rows including both poles, as ERA5's 721); the
columns cover 360 degrees of longitude and the fields are periodic across the date line.

How the fields are made (so they behave like weather, not like noise):
- Latent Gaussian fields with a power-law spectrum (amplitude ~ k^-slope in cycles per 360
  degrees): correlated at large scales with fine-scale detail down to the grid scale, so bicubic
  interpolation of a downsampled field is good but not perfect. The spectrum is set in physical
  wavenumbers, so a larger grid shows the same planet with more fine detail.
- Periodic in longitude by construction (Fourier series along each latitude row); latitude is
  synthesised on a doubled (pole-to-pole-and-back) circle and cut, so the poles are not coupled.
- Coherent in time: each day the latent fields are advected by a zonal wind that depends on
  latitude (westerly jets near 45 degrees, easterly trades) and renewed by an AR(1) innovation,
  ``x[t+1] = rho * shift(x[t]) + sqrt(1 - rho^2) * noise``. Day t+1 is thus mostly day t moved
  east or west by a known, latitude-dependent amount: next-step forecasting is learnable.
- Physical marginals: temperature = a latitudinal profile with a seasonal cycle (northern summer
  in July) + a static "geography" pattern + anomalies; kinetic energy and water vapour are
  log-normal (hence >= 0) around latitude profiles (jets; moist tropics), water vapour rising with
  temperature (Clausius-Clapeyron-like). The constants are solved so that the grid-point mean and
  std over a year match SuperBench's statistics (exactly in expectation, approximately in a file).

Every file is written sample by sample into chunked storage (tiles of ``--chunk`` pixels, one
channel of one day each), so memory stays at a few samples whatever the size, and a crop reads
only the tiles it touches. Each file is written to ``<year>.h5.<pid>.partial`` and renamed when
complete: an interrupted run never leaves a file that looks complete. The content of a file
depends only on (seed, split, year, samples, height, width, channels, hours per step):
regenerating one year, or adding years, leaves the others bit-identical. The command line then
writes ``<out>/stats/`` from the train split (``compute_stats.py``; ``--no-stats`` skips it).

Other layouts (``--channels``, ``--hours-per-step``; the defaults above stay byte-identical):
- ``--channels nersc20``: NERSC's 20 channels (u10, v10, t2m, sp, msl, t850, u1000, v1000, z1000,
  u850, v850, z850, u500, v500, z500, t500, z50, r500, r850, tcwv) in physical units, with
  illustrative ERA5-like magnitudes; any other count gives dimensionless "channel i" fields.
  Each file records the names and units in the ``fields`` attributes ``channels`` and ``units``,
  and the time step in ``hours_per_step``.
- These fields are built for forecasting (``ForecastWeather``): the next state is a fixed,
  latitude- and layer-dependent transformation of the current one (eddies drifting east with the
  westerlies or west with the trades, damped more at small scales) plus an innovation of a few
  percent of the variance per 6 hours, so that a linear one-step predictor beats persistence by
  1.7x to 3.5x in RMSE on every channel at 6-hourly steps on a 5.6 degree grid (datasets/README.md).
- ``--hours-per-step 6``: NERSC's time step; ``--samples-per-year`` counts samples (a year is
  1460) and the seasonal cycle follows the sample's time. SuperBench's three channels at other
  steps scale their daily drift and persistence to the step.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import h5py
import numpy as np
from tqdm import tqdm

if __package__:  # imported as datasets.make_synthetic_era5
    from .compute_stats import OneLineParser, StatsError, compute_stats, errors_as_one_line
else:  # run as a script: datasets/ is on sys.path
    from compute_stats import OneLineParser, StatsError, compute_stats, errors_as_one_line

# SuperBench's per-channel statistics (the targets); utils/data/era5.py holds the same values as
# SUPERBENCH_MEAN/STD (a test checks they agree). Not imported from there: this script needs no torch.
TARGET_MEAN = (6.3024, 278.3945, 18.4262)
TARGET_STD = (3.7376, 21.0588, 16.4687)
CHANNELS = (
    ("kinetic energy 10 m", "m2 s-2"),
    ("temperature 2 m", "K"),
    ("total column water vapour", "kg m-2"),
)
DEFAULT_TRAIN_YEARS = (2008, 2010, 2011, 2013)
DEFAULT_VALID_YEARS = (2015,)
DEFAULT_CHUNK = 128
DAYS_PER_YEAR = 365
SPIN_UP_STEPS = 20  # days simulated before the first written one, so day 0 is already advected
LARGEST_SCALE = 4.0  # cycles per 360 degrees where the power law flattens (avoids infinite variance)


class GenerationError(ValueError):
    """Bad arguments for the generator, reported as one line."""


@dataclass(frozen=True)
class Latent:
    """One latent unit-variance Gaussian field that evolves in time."""

    slope: float  # amplitude ~ k^-slope: larger is smoother
    rho: float  # day-to-day persistence of the (advected) field


# Temperature anomalies are smooth and persistent; wind and moisture have more fine-scale
# structure and decorrelate faster, as in the real atmosphere.
LATENTS = {
    "temperature": Latent(slope=1.75, rho=0.92),
    "moisture": Latent(slope=1.5, rho=0.85),
    "wind": Latent(slope=1.35, rho=0.8),
}
GEOGRAPHY_SLOPE = 1.5
TEMPERATURE_ANOMALY_K = 7.0  # std of the moving temperature anomalies
GEOGRAPHY_K = 4.0  # std of the static temperature pattern
MOISTURE_PER_KELVIN = 0.045  # log water vapour per kelvin of the temperature profile
MOISTURE_FROM_TEMPERATURE = 0.6  # correlation of moisture anomalies with temperature anomalies


def zonal_wind_deg_per_day(lat_deg: np.ndarray) -> np.ndarray:
    """Eastward drift in degrees of longitude per day: westerly jets near 45 N/S, easterly trades."""
    jets = 4.0 * np.exp(-(((np.abs(lat_deg) - 45.0) / 15.0) ** 2))
    trades = -1.5 * np.exp(-((lat_deg / 15.0) ** 2))
    return jets + trades


def temperature_shape(lat_deg: np.ndarray, day: np.ndarray) -> np.ndarray:
    """Unscaled temperature profile (lat x day): warm tropics, cold poles (Antarctica coldest),
    and a seasonal swing of opposite sign in each hemisphere, warmest in the north in mid-July."""
    s = np.sin(np.deg2rad(lat_deg))[None, :]
    season = np.cos(2 * np.pi * (np.asarray(day, dtype=float)[:, None] - 196.0) / DAYS_PER_YEAR)
    return -(s**2) - 0.3 * np.clip(-s, 0, None) ** 4 + 0.25 * s * season


def wind_shape(lat_deg: np.ndarray) -> np.ndarray:
    """Log kinetic-energy profile: storm tracks (stronger in the south) and trade winds."""
    return (
        0.8 * np.exp(-(((lat_deg + 50.0) / 12.0) ** 2))
        + 0.5 * np.exp(-(((lat_deg - 50.0) / 12.0) ** 2))
        + 0.4 * np.exp(-(((np.abs(lat_deg) - 15.0) / 10.0) ** 2))
    )


def lognormal_constants(log_profile: np.ndarray, mean: float, std: float) -> tuple[float, float]:
    """(scale c, anomaly std s) such that c * exp(profile + s * N(0, 1)), averaged over the profile's
    grid points, has the given mean and std (closed form for log-normal moments)."""
    m1 = np.mean(np.exp(log_profile))
    m2 = np.mean(np.exp(2 * log_profile))
    s2 = np.log1p((std / mean) ** 2) + 2 * np.log(m1) - np.log(m2)
    if s2 <= 0:  # cannot happen with the profiles above; guards edits to them
        raise AssertionError("latitude profile varies more than the target std allows")
    s = float(np.sqrt(s2))
    return float(mean / (m1 * np.exp(s2 / 2))), s


class SpectralNoise:
    """Draws unit-variance Gaussian fields with a power-law spectrum, periodic in longitude.

    Fields are returned as their Fourier series along longitude, shape (height, width//2 + 1),
    so that advection (a shift in longitude) is a phase factor; ``to_grid`` makes the grid.
    """

    def __init__(self, height: int, width: int, slope: float, largest_scale: float = LARGEST_SCALE):
        self.height, self.width = height, width
        self.circle = 2 * (height - 1)  # latitude on a full circle: pole to pole and back
        k_lat = np.fft.fftfreq(self.circle, d=1.0 / self.circle)  # cycles per 360 degrees
        k_lon = np.arange(width // 2 + 1)
        k2 = k_lat[:, None] ** 2 + k_lon[None, :] ** 2
        amplitude = (k2 + largest_scale**2) ** (-slope / 2)
        amplitude[0, 0] = 0.0  # the mean comes from the channel's profile, not from the noise
        variance = grid_variance(amplitude**2, width)
        # sqrt(1/2): real and imaginary parts each carry half of E|C|^2. Trailing axis of 1 so it
        # scales (real, imag) pairs in float32, cheaper than a complex product.
        self.amplitude = (amplitude * np.sqrt(0.5 / variance)).astype(np.float32)[..., None]
        # Stds of the zonal derivative (spectral) and of the meridional central difference of a
        # unit field, so that derived fields (geostrophic winds) can be made unit-variance too.
        power = amplitude**2 / variance
        self.k_lon = k_lon
        self.dx_std = float(np.sqrt(grid_variance(power * k_lon[None, :] ** 2, width)))
        central_difference = np.sin(2 * np.pi * k_lat / self.circle)[:, None]
        self.dy_std = float(np.sqrt(grid_variance(power * central_difference**2, width)))

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        white = rng.standard_normal((*self.amplitude.shape[:2], 2), dtype=np.float32)
        white *= self.amplitude
        return np.fft.ifft(white.view(np.complex64)[..., 0], axis=0)[: self.height]

    def to_grid(self, spectrum: np.ndarray) -> np.ndarray:
        return np.fft.irfft(spectrum, n=self.width, axis=1)

    def dx(self, spectrum: np.ndarray) -> np.ndarray:
        """Unit-variance eastward derivative on the grid (exact: a product in Fourier space)."""
        return np.fft.irfft(spectrum * (1j * self.k_lon / self.dx_std).astype(np.complex64), n=self.width, axis=1)

    def dy(self, grid: np.ndarray) -> np.ndarray:
        """Unit-variance northward derivative (central differences; one-sided at the poles)."""
        return np.gradient(grid, axis=0) * np.float32(-1.0 / self.dy_std)  # row 0 is the north pole


def grid_variance(power: np.ndarray, width: int) -> float:
    """Exact variance of irfft(ifft(C)) at a grid point for circular complex C with E|C|^2 = power
    (latitude circle x width//2+1): the zero (and Nyquist) longitude columns keep only their real part."""
    circle = power.shape[0]
    per_column = power.sum(axis=0) / circle**2
    weights = np.full(power.shape[1], 2.0)
    weights[0] = 0.5
    if width % 2 == 0:
        weights[-1] = 0.5
    return (weights * per_column).sum() / width**2


@dataclass(frozen=True)
class Grid:
    """Where and when the fields are sampled, and which fields: rows, columns, hours between
    samples, and the channel count (3: SuperBench's, 20: NERSC's, any other: generic)."""

    height: int
    width: int
    hours_per_step: int = 24
    channels: int = 3

    @property
    def lat_deg(self) -> np.ndarray:
        return np.linspace(90.0, -90.0, self.height)


class WeatherModel:
    """Turns latent fields into the three channels; constants solved from the grid's profiles."""

    def __init__(self, grid: Grid, geography: np.ndarray):
        lat = grid.lat_deg
        year = np.arange(DAYS_PER_YEAR)
        t_shape = temperature_shape(lat, year)
        profile_std = np.sqrt(TARGET_STD[1] ** 2 - TEMPERATURE_ANOMALY_K**2 - GEOGRAPHY_K**2)
        self.t_scale = profile_std / t_shape.std()
        self.t_offset = TARGET_MEAN[1] - self.t_scale * t_shape.mean()
        self.lat = lat
        self.geography = geography
        self.ke_log_profile = wind_shape(lat)[:, None].astype(np.float32)  # float32: big grids stay fast
        self.ke_scale, self.ke_anomaly = lognormal_constants(wind_shape(lat), TARGET_MEAN[0], TARGET_STD[0])
        q_profile = MOISTURE_PER_KELVIN * self.t_scale * t_shape
        self.q_scale, self.q_anomaly = lognormal_constants(q_profile, TARGET_MEAN[2], TARGET_STD[2])

    def channels(self, day: float, temperature: np.ndarray, moisture: np.ndarray, wind: np.ndarray) -> np.ndarray:
        t_shape = temperature_shape(self.lat, np.array([day % DAYS_PER_YEAR]))[0][:, None].astype(np.float32)
        out = np.empty((3, *temperature.shape), dtype=np.float32)
        out[0] = self.ke_scale * np.exp(self.ke_log_profile + self.ke_anomaly * wind)
        out[1] = (
            self.t_offset + self.t_scale * t_shape + TEMPERATURE_ANOMALY_K * temperature + GEOGRAPHY_K * self.geography
        )
        correlated = MOISTURE_FROM_TEMPERATURE * temperature + np.sqrt(1 - MOISTURE_FROM_TEMPERATURE**2) * moisture
        out[2] = self.q_scale * np.exp(MOISTURE_PER_KELVIN * self.t_scale * t_shape + self.q_anomaly * correlated)
        return out


def _rng(seed: int, *keys: str | int) -> np.random.Generator:
    """Independent, reproducible stream per (seed, keys): files do not depend on one another."""
    words = [seed] + [zlib.crc32(k.encode()) if isinstance(k, str) else int(k) for k in keys]
    return np.random.default_rng(np.random.SeedSequence(words))


def geography(grid: Grid, seed: int) -> np.ndarray:
    """Static pattern shared by every split and year of one seed, like orography and coastlines."""
    noise = SpectralNoise(grid.height, grid.width, GEOGRAPHY_SLOPE)
    return noise.to_grid(noise.draw(_rng(seed, "geography"))).astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Forecasting layouts (Part II): NERSC's 20 channels (or any count) at any time step
# ----------------------------------------------------------------------------------------------

# NERSC's ERA5 channels, in their order (config/vit.yaml's channel_names).
NERSC_CHANNELS = (
    ("u10", "m s-1"), ("v10", "m s-1"), ("t2m", "K"), ("sp", "Pa"), ("msl", "Pa"), ("t850", "K"),
    ("u1000", "m s-1"), ("v1000", "m s-1"), ("z1000", "m2 s-2"), ("u850", "m s-1"), ("v850", "m s-1"),
    ("z850", "m2 s-2"), ("u500", "m s-1"), ("v500", "m s-1"), ("z500", "m2 s-2"), ("t500", "K"),
    ("z50", "m2 s-2"), ("r500", "%"), ("r850", "%"), ("tcwv", "kg m-2"),
)
CHANNEL_PRESETS = {"superbench": len(CHANNELS), "nersc20": len(NERSC_CHANNELS)}
METRES_PER_DEGREE = 2 * np.pi * 6.371e6 / 360  # along the equator
DIFFUSION_SCALE = 24.0  # cycles per 360 degrees at which eddies are damped twice as fast as the largest
# Eddies drift with their layer: extratropical ones eastward as a solid body (one angular speed at
# every latitude, so they keep their shape; a latitude-dependent angular speed shears them into
# streaks within days), tropical ones westward with the trades. (Westerly speed at 45 degrees,
# easterly speed at the equator), m/s.
DRIFT_MS = {"lower": (10.0, 10.0), "upper": (16.0, 6.0), "stratosphere": (20.0, 12.0)}
TROPICS_EDGE_DEG = 12.0  # the tropical eddies' share of the variance is 1/2 there, falling off
TROPICS_EDGE_WIDTH_DEG = 3.0  # logistically over this width (the blend is unpredictable: keep it narrow)
REGIMES = ("extratropics", "tropics")
DRY_AIR_GAS_CONSTANT = 287.05  # J kg-1 K-1, for the hypsometric thickness 1000-850 hPa
SCALE_HEIGHT_M = 8400.0  # surface pressure falls by e over this height
LAPSE_RATE_K_PER_M = 0.0065
OROGRAPHY_SLOPE = 2.0
LAYERS = ("lower", "upper", "stratosphere")
TCWV_SCALE, TCWV_ANOMALY = 10.0, 0.25  # kg m-2 at t850 = 273 K, and the log-normal spread


def channel_table(n_channels: int) -> tuple[tuple[str, str], ...]:
    """(name, unit) per channel: SuperBench's 3, NERSC's 20, else "channel i" (dimensionless)."""
    if n_channels == len(CHANNELS):
        return CHANNELS
    if n_channels == len(NERSC_CHANNELS):
        return NERSC_CHANNELS
    return tuple((f"channel {i}", "1") for i in range(n_channels))


def layout_name(grid: Grid) -> str:
    presets = {n: name for name, n in CHANNEL_PRESETS.items()}
    return f"{presets.get(grid.channels, f'{grid.channels}ch')}-{grid.hours_per_step}h"


def _bump(x: np.ndarray, centre: float, width: float) -> np.ndarray:
    return np.exp(-(((x - centre) / width) ** 2))


def layer_wind_ms(layer: str, lat_deg: np.ndarray) -> np.ndarray:
    """The mean eastward wind (m/s) of a layer's u channels: westerly jets in mid-latitudes
    (stronger in the south and aloft), easterly trades. Illustrative, not ERA5's."""
    a = np.abs(lat_deg)
    south = np.where(lat_deg < 0, 1.2, 1.0)
    if layer == "lower":  # 850 hPa; the surface channels take a fraction of it
        return south * 13.0 * _bump(a, 45.0, 15.0) - 8.0 * _bump(lat_deg, 0.0, 15.0)
    if layer == "upper":  # 500 hPa
        return south * 20.0 * _bump(a, 40.0, 14.0) - 3.0 * _bump(lat_deg, 0.0, 12.0)
    return 22.0 * _bump(a, 62.0, 12.0) - 12.0 * _bump(lat_deg, 0.0, 18.0)  # 50 hPa


def drift_deg_per_step(layer: str, regime: str, hours_per_step: int) -> float:
    """Eastward drift of a layer's extratropical or tropical eddies, in degrees of longitude per step."""
    westerly, easterly = DRIFT_MS[layer]
    seconds = hours_per_step * 3600.0
    if regime == "tropics":
        return -easterly * seconds / METRES_PER_DEGREE
    return westerly * seconds / (METRES_PER_DEGREE * np.cos(np.deg2rad(45.0)))


def hadley_v_ms(lat_deg: np.ndarray) -> np.ndarray:
    """Mean northward wind near the surface: the trades converge on the equator."""
    return -2.5 * (lat_deg / 12.0) * np.exp(-((lat_deg / 18.0) ** 2))


@dataclass(frozen=True)
class Eddy:
    """A latent unit-variance field of the forecasting layouts, advected by its layer's wind."""

    layer: str
    slope: float  # amplitude ~ k^-slope
    tau_days: float  # damping time of the largest scales; shorter at small scales (diffusion)
    largest_scale: float  # cycles per 360 degrees where the spectrum flattens


# Pressure is smoothest and longest-lived, then temperature, moisture and the (ageostrophic) wind
# eddies. The lower layer has two pressure and two temperature fields, so that the surface and
# 850 hPa are correlated but not identical.
EDDIES = {
    "p_low": Eddy("lower", 2.5, 20.0, 8.0),
    "p_mid": Eddy("lower", 2.5, 16.0, 8.0),
    "t_low": Eddy("lower", 2.0, 15.0, 8.0),
    "t_mid": Eddy("lower", 2.0, 12.0, 8.0),
    "u_low": Eddy("lower", 2.0, 12.0, 8.0),
    "v_low": Eddy("lower", 2.0, 12.0, 8.0),
    "q_low": Eddy("lower", 2.0, 20.0, 8.0),
    "p_up": Eddy("upper", 2.5, 20.0, 8.0),
    "t_up": Eddy("upper", 2.0, 15.0, 8.0),
    "u_up": Eddy("upper", 2.0, 12.0, 8.0),
    "v_up": Eddy("upper", 2.0, 12.0, 8.0),
    "q_up": Eddy("upper", 2.0, 20.0, 8.0),
    "p_strat": Eddy("stratosphere", 3.0, 30.0, 5.0),
}


def orography(grid: Grid, seed: int) -> np.ndarray:
    """Static surface height (m, >= 0): mountain ranges where a smooth random field is high (about
    30% of the grid is land) and the Antarctic plateau. Shared by every split and year of one seed."""
    noise = SpectralNoise(grid.height, grid.width, OROGRAPHY_SLOPE)
    field = noise.to_grid(noise.draw(_rng(seed, "orography")))
    plateau = 2800.0 * np.clip((-grid.lat_deg - 68.0) / 10.0, 0.0, 1.0)[:, None]
    return np.maximum(1500.0 * np.clip(field - 0.5, 0.0, 2.5), plateau).astype(np.float32)


def _mix(*terms: tuple[float, np.ndarray]) -> np.ndarray:
    """Weighted sum of unit-variance independent fields, scaled back to unit variance."""
    total = sum(np.float32(w) * x for w, x in terms)
    return total * np.float32(1.0 / np.sqrt(sum(w * w for w, _ in terms)))


class ForecastWeather:
    """Fields whose next state is a fixed function of the current one plus a small surprise.

    Each eddy is two latent fields, one drifting with its layer's extratropical westerlies and one
    with the tropical easterlies, blended by latitude (tropical within about 12 degrees of the
    equator). Each field evolves in the Fourier series of every latitude row as
    ``f[t+1]_k = rho_k * exp(-2 pi i k s) * f[t]_k + sqrt(1 - rho_k^2) * noise_k``: a shift east by
    s turns per step (advection), damping stronger at small scales (rho_k < 1, a diffusion), and
    renewal by noise with the field's own spectrum, so the statistics stay exactly stationary. The
    channels are fixed, latitude-dependent mixtures of one layer's eddies (and their derivatives:
    geostrophic winds) around a climatology with a seasonal cycle. So the next state is the current
    one moved by a known, latitude- and layer-dependent distance (in mid-latitudes 0.5 to 1 grid
    cell per 6 hours at 5.6 degrees) plus an innovation of a few percent of the variance.
    """

    def __init__(self, grid: Grid, seed: int):
        self.grid = grid
        self.days_per_step = grid.hours_per_step / 24
        k = np.arange(grid.width // 2 + 1)
        self.noises = {name: SpectralNoise(grid.height, grid.width, e.slope, e.largest_scale)
                       for name, e in EDDIES.items()}
        # Two latent fields per eddy, one drifting with the extratropical flow and one with the
        # tropical flow, all stepped at once (one draw, one FFT per step: small grids are dominated
        # by per-call overheads). State layout: (eddy, regime, row, wavenumber).
        amplitude, transition, renewal = [], [], []
        for name, e in EDDIES.items():
            rho = np.exp(-self.days_per_step * (1.0 + (k / DIFFUSION_SCALE) ** 2) / e.tau_days)
            for regime in REGIMES:
                drift = drift_deg_per_step(e.layer, regime, grid.hours_per_step) / 360.0
                transition.append(rho * np.exp(-2j * np.pi * k * drift))  # a shift east by `drift` turns
                renewal.append(np.sqrt(1.0 - rho**2))
                amplitude.append(self.noises[name].amplitude)
        self.amplitude = np.stack(amplitude)
        self.transition = np.stack(transition).reshape(len(EDDIES), len(REGIMES), 1, -1).astype(np.complex64)
        self.renewal = np.stack(renewal).reshape(len(EDDIES), len(REGIMES), 1, -1).astype(np.float32)
        # Each eddy is the blend of its two fields, with weights whose squares add to 1 (unit
        # variance): tropical near the equator, extratropical elsewhere.
        share = 1.0 / (1.0 + np.exp((np.abs(grid.lat_deg) - TROPICS_EDGE_DEG) / TROPICS_EDGE_WIDTH_DEG))
        self.blend = np.stack([np.sqrt(1.0 - share), np.sqrt(share)])[:, :, None].astype(np.float32)
        self.lat = grid.lat_deg[:, None].astype(np.float32)
        self.orography = orography(grid, seed)
        self.geography = geography(grid, seed)

    def _draw(self, rng: np.random.Generator) -> np.ndarray:
        """Unit-variance fields as the Fourier series of each row: (eddy, regime, row, wavenumber)."""
        white = rng.standard_normal(self.amplitude.shape[:-1] + (2,), dtype=np.float32)
        white *= self.amplitude
        fields = np.fft.ifft(white.view(np.complex64)[..., 0], axis=1)[:, : self.grid.height]
        return fields.reshape(len(EDDIES), len(REGIMES), *fields.shape[1:])

    def samples(self, n_samples: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
        # No spin-up: the first draw already has the stationary statistics (rigid drift and
        # per-wavenumber damping with matching renewal keep them).
        state = self._draw(rng)
        for step in range(n_samples):
            state = self.transition * state + self.renewal * self._draw(rng)
            yield self.channels(step * self.days_per_step, state)

    def channels(self, day: float, state: np.ndarray) -> np.ndarray:
        spectra = (state * self.blend).sum(axis=1)  # row weights commute with zonal shifts and derivatives
        grids = np.fft.irfft(spectra, n=self.grid.width, axis=2)
        if self.grid.channels == len(NERSC_CHANNELS):
            return self._nersc(day, dict(zip(EDDIES, spectra)), dict(zip(EDDIES, grids)))
        return self._generic(dict(zip(EDDIES, grids)))

    def _generic(self, e: Mapping[str, np.ndarray]) -> np.ndarray:
        """Dimensionless channels: a latitude profile plus a fixed random mixture of one layer's eddies."""
        out = np.empty((self.grid.channels, self.grid.height, self.grid.width), dtype=np.float32)
        profile = np.cos(np.deg2rad(2.0 * self.lat))
        for c in range(self.grid.channels):
            layer = LAYERS[c % 2]  # lower, upper, lower, ...
            names = [name for name, eddy in EDDIES.items() if eddy.layer == layer]
            weights = np.random.default_rng(c).standard_normal(len(names))  # the same mixture for every seed
            out[c] = 0.5 * profile + 0.85 * _mix(*((w, e[name]) for w, name in zip(weights, names)))
        return out

    def _nersc(self, day: float, state: Mapping[str, np.ndarray], e: Mapping[str, np.ndarray]) -> np.ndarray:
        """NERSC's 20 channels in physical units. The magnitudes are illustrative, chosen to be
        roughly ERA5's (e.g. t2m 278 +- 21 K, z500 5.5e4 +- 3e3 m2 s-2, msl 1.01e5 +- 1.3e3 Pa),
        not fitted to it."""
        lat = self.lat
        a = np.abs(lat)
        s = np.sin(np.deg2rad(lat))
        summer = s * np.float32(np.cos(2 * np.pi * (day - 196.0) / DAYS_PER_YEAR))  # > 0 in the summer hemisphere
        t_shape = temperature_shape(self.grid.lat_deg, np.array([day % DAYS_PER_YEAR]))[0][:, None].astype(np.float32)
        n = self.noises

        # Geostrophic winds blow along the isobars (u ~ -dp/dy, v ~ dp/dx, the sign flipping with the
        # Coriolis parameter); near the equator ageostrophic eddies take over. Unit-variance parts,
        # mixed with weights whose squares add to 1, give unit-variance winds.
        geo = (0.8 * np.sign(s) * np.sqrt(np.abs(s))).astype(np.float32)
        ageo = np.sqrt(1.0 - geo**2).astype(np.float32)

        def u_geo(p: str) -> np.ndarray:
            return -n[p].dy(e[p])

        def v_geo(p: str) -> np.ndarray:
            return n[p].dx(state[p])

        out = np.empty((len(NERSC_CHANNELS), self.grid.height, self.grid.width), dtype=np.float32)
        # Lower layer: surface to 850 hPa.
        u_lower = layer_wind_ms("lower", lat)
        msl_clim = (101325.0 + 900.0 * _bump(a, 32.0, 10.0) - 1400.0 * _bump(lat, -62.0, 9.0)
                    - 500.0 * _bump(lat, 58.0, 10.0) + 300.0 * _bump(lat, 80.0, 8.0))
        msl_std = 300.0 + 1700.0 * _bump(a, 58.0, 20.0)
        t850_clim = 296.0 + 40.0 * t_shape
        t850 = t850_clim + (1.2 + 4.5 * _bump(a, 60.0, 25.0)) * _mix((1.0, e["t_low"]), (0.15, e["t_mid"]))
        z1000 = 0.785 * (msl_clim - 1e5) + 0.785 * msl_std * _mix((1.0, e["p_low"]), (-0.12, e["t_mid"]))  # 1 hPa ~ 8 m
        wind_10m_std = 2.5 + 3.0 * _bump(a, 50.0, 20.0)
        u_surface = geo * u_geo("p_low") + ageo * e["u_low"]
        v_surface = geo * v_geo("p_low") + ageo * e["v_low"]
        u850 = geo * _mix((0.85, u_geo("p_low")), (0.5, u_geo("p_mid"))) + ageo * e["u_low"]
        v850 = geo * _mix((0.85, v_geo("p_low")), (0.5, v_geo("p_mid"))) + ageo * e["v_low"]
        out[0] = 0.65 * u_lower + wind_10m_std * u_surface
        out[1] = hadley_v_ms(lat) + wind_10m_std * v_surface
        out[2] = (303.0 + 42.0 * t_shape - LAPSE_RATE_K_PER_M * self.orography + GEOGRAPHY_K * self.geography
                  + (1.5 + 5.5 * _bump(a, 65.0, 25.0)) * _mix((0.7, e["t_low"]), (0.7, e["t_mid"])))
        out[3] = (msl_clim * np.exp(-self.orography / SCALE_HEIGHT_M)
                  + 0.95 * msl_std * _mix((1.0, e["p_low"]), (-0.15, e["t_low"])))
        out[4] = msl_clim + msl_std * e["p_low"]
        out[5] = t850
        out[6] = 0.75 * u_lower + 1.1 * wind_10m_std * _mix((1.0, u_surface), (0.3, u850))
        out[7] = 1.2 * hadley_v_ms(lat) + 1.1 * wind_10m_std * _mix((1.0, v_surface), (0.3, v850))
        out[8] = z1000
        out[9] = u_lower + (3.5 + 4.5 * _bump(a, 50.0, 20.0)) * u850
        out[10] = 0.6 * hadley_v_ms(lat) + (3.0 + 4.0 * _bump(a, 50.0, 20.0)) * v850
        # Hypsometric: the 1000-850 hPa thickness grows with the layer's temperature (~ t850 + 4 K).
        thickness_per_kelvin = DRY_AIR_GAS_CONSTANT * np.log(1000.0 / 850.0)
        out[11] = z1000 + thickness_per_kelvin * (t850 + 4.0) + 0.1 * 0.785 * msl_std * e["p_mid"]
        # Upper layer: 500 hPa.
        out[12] = layer_wind_ms("upper", lat) + (4.0 + 7.0 * _bump(a, 50.0, 20.0)) * (
            geo * u_geo("p_up") + ageo * e["u_up"])
        out[13] = -0.4 * hadley_v_ms(lat) + (4.0 + 6.0 * _bump(a, 50.0, 20.0)) * (
            geo * v_geo("p_up") + ageo * e["v_up"])
        out[14] = (58500.0 - 7000.0 * s**2 + 1200.0 * summer
                   + (250.0 + 1300.0 * _bump(a, 55.0, 22.0)) * _mix((0.9, e["p_up"]), (0.45, e["t_up"])))
        out[15] = (268.0 + 30.0 * t_shape
                   + (1.0 + 3.0 * _bump(a, 55.0, 25.0)) * _mix((0.9, e["t_up"]), (0.45, e["p_up"])))
        # Stratosphere: 50 hPa, cold and low over the winter pole.
        out[16] = 204000.0 - 9000.0 * s**2 + 3500.0 * summer + (300.0 + 2500.0 * _bump(a, 70.0, 15.0)) * e["p_strat"]
        # Humidity: relative humidity in (0, 100) through a logistic function (dry subtropics, moist
        # where air comes from the equator); water vapour log-normal, rising with temperature, its
        # anomalies largest in mid-latitudes (atmospheric rivers).
        def relative(logit):
            return 100.0 / (1.0 + np.exp(-logit))

        out[17] = relative(-0.3 + 1.0 * _bump(lat, 5.0, 12.0) - 0.9 * _bump(a, 25.0, 10.0) + 0.3 * _bump(a, 60.0, 15.0)
                           + 1.6 * _mix((0.85, e["q_up"]), (0.35, e["v_up"]), (0.2, e["t_up"])))
        out[18] = relative(1.3 - 1.5 * _bump(a, 25.0, 10.0)
                           + (0.8 + 0.8 * _bump(a, 40.0, 20.0))
                           * _mix((0.85, e["q_low"]), (0.3, e["v_low"]), (0.25, e["t_mid"])))
        spread = TCWV_ANOMALY * (0.4 + _bump(a, 40.0, 20.0))
        out[19] = TCWV_SCALE * np.exp(0.07 * (t850_clim - 273.0) + spread * _mix((0.8, e["q_low"]), (0.6, e["t_low"])))
        return out


def generate_samples(grid: Grid, n_samples: int, seed: int, split: str, year: int) -> Iterator[np.ndarray]:
    """Yields ``n_samples`` consecutive samples, ``grid.hours_per_step`` apart from 1 January 00 UTC,
    each (grid.channels, height, width) float32."""
    if grid.channels != len(CHANNELS):
        yield from ForecastWeather(grid, seed).samples(n_samples, _rng(seed, split, year, layout_name(grid)))
        return
    rng = _rng(seed, split, year)
    model = WeatherModel(grid, geography(grid, seed))
    # The constants are per day; other steps scale them (x * 1.0 and rho ** 1.0 are exact, so the
    # daily files stay bit-identical to those the SwinIR quickstart was tuned on).
    days_per_step = grid.hours_per_step / 24
    # Advection by the zonal wind is a phase shift of each latitude's Fourier series.
    shift = zonal_wind_deg_per_day(grid.lat_deg)[:, None] / 360.0 * days_per_step
    advect = np.exp(-2j * np.pi * np.arange(grid.width // 2 + 1)[None, :] * shift).astype(np.complex64)
    noises = {name: SpectralNoise(grid.height, grid.width, latent.slope) for name, latent in LATENTS.items()}
    state = {name: noise.draw(rng) for name, noise in noises.items()}
    for step in range(-round(SPIN_UP_STEPS / days_per_step), n_samples):
        for name, latent in LATENTS.items():
            rho = latent.rho**days_per_step
            renewal = np.float32(np.sqrt(1 - rho**2))
            state[name] = np.float32(rho) * advect * state[name] + renewal * noises[name].draw(rng)
        if step >= 0:
            grids = {name: noises[name].to_grid(spectrum) for name, spectrum in state.items()}
            yield model.channels(step * days_per_step, **grids)  # sample t: day t * days_per_step of the year


def chunk_shape(height: int, width: int, chunk: int) -> Optional[tuple[int, int, int, int]]:
    """One channel of one day in tiles of at most chunk x chunk, sized to split the grid evenly
    (721 x 1440 -> 121 x 120; 128 x 128 tiles would store 13% padding); None = contiguous."""
    if chunk == 0:
        return None

    def even(n: int) -> int:
        return -(-n // -(-n // chunk))  # ceil(n / number of tiles)

    return (1, 1, even(height), even(width))


def write_year(path: Path, grid: Grid, n_samples: int, seed: int, split: str, year: int, chunk: int, bar=None) -> Path:
    """Write one file atomically: to ``<name>.<pid>.partial``, renamed once complete."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")  # pid: concurrent runs do not collide
    f = None
    try:
        # No chunk cache: a sample goes to disk in its own write (whole chunks, nothing to re-read), so a full
        # disk fails that write or the flush below, while the file can still be emptied and closed (_discard).
        f = h5py.File(partial, "w", rdcc_nbytes=0)
        fields = f.create_dataset(
            "fields", shape=(n_samples, grid.channels, grid.height, grid.width), dtype=np.float32,
            chunks=chunk_shape(grid.height, grid.width, chunk),
        )
        table = channel_table(grid.channels)
        fields.attrs["channels"] = [name for name, _ in table]
        fields.attrs["units"] = [unit for _, unit in table]
        fields.attrs["hours_per_step"] = grid.hours_per_step
        f.attrs.update({"synthetic": True, "seed": seed, "split": split, "year": year,
                        "generator": "datasets/make_synthetic_era5.py"})
        for t, sample in enumerate(generate_samples(grid, n_samples, seed, split, year)):
            fields[t] = sample
            if bar is not None:
                bar.update(1)
        f.flush()
        closing, f = f, None  # a close that fails leaves h5py's object unusable: _discard must not touch it
        closing.close()
        os.replace(partial, path)
    except BaseException:
        _discard(f, partial)
        raise
    return path


def _discard(f, partial: Path) -> None:
    """Remove a partly written file. On a full disk HDF5 cannot close it (its metadata has no room) and
    retries when the object is freed, printing tracebacks and crashing at exit: emptying it first makes room."""
    if f is not None:
        try:
            os.ftruncate(f.id.get_vfd_handle(), 0)
            f.close()
        except Exception:  # noqa: BLE001 — already failing; the file is removed below either way
            pass
    partial.unlink(missing_ok=True)


def make_synthetic_era5(
    out_dir,
    samples_per_year: int = DAYS_PER_YEAR,
    height: int = 721,
    width: int = 1440,
    seed: int = 0,
    train_years: Sequence[int] = DEFAULT_TRAIN_YEARS,
    valid_years: Sequence[int] = DEFAULT_VALID_YEARS,
    *,
    extra_splits: Optional[Mapping[str, Sequence[int]]] = None,
    chunk: int = DEFAULT_CHUNK,
    progress: Optional[bool] = None,
    channels: int | str = "superbench",
    hours_per_step: int = 24,
    stats: bool = False,
) -> list[Path]:
    """Write ``<out_dir>/<split>/<year>.h5`` for train, valid and any ``extra_splits``
    (e.g. ``{"test": [2017]}``) and return the paths written.

    ``chunk``: side of the stored tiles (0 = contiguous). ``progress``: tqdm bar; None shows it
    when stderr is a terminal. ``channels``: "superbench" (= 3), "nersc20" (= 20) or a count;
    ``hours_per_step``: 24 (daily, SuperBench) or 6 (NERSC); ``samples_per_year`` counts samples.
    ``stats``: also write ``<out_dir>/stats/`` from the train split (compute_stats.py; the command
    line does by default), not listed in the paths returned.
    """
    extra_splits = {name: list(years) for name, years in (extra_splits or {}).items()}
    for name in ("train", "valid"):
        if name in extra_splits:
            raise GenerationError(f"split {name!r} comes from --{name}-years; do not give it with --split")
    splits = {"train": list(train_years), "valid": list(valid_years), **extra_splits}
    n_channels = _channel_count(channels)
    _check_arguments(samples_per_year, height, width, chunk, splits, n_channels, hours_per_step)
    grid = Grid(height, width, hours_per_step, n_channels)
    out = Path(out_dir)
    jobs = [(split, year) for split, years in splits.items() for year in years]
    show = sys.stderr.isatty() if progress is None else progress
    written = []
    with tqdm(total=len(jobs) * samples_per_year, unit="sample", disable=not show,
              desc=f"synthetic ERA5 {n_channels}x{height}x{width} every {hours_per_step} h") as bar:
        for split, year in jobs:
            (out / split).mkdir(parents=True, exist_ok=True)
            bar.set_postfix_str(f"{split}/{year}.h5")
            written.append(write_year(out / split / f"{year}.h5", grid, samples_per_year, seed, split, year, chunk, bar))
    if stats and splits["train"]:
        try:
            compute_stats(out, "train")
        except StatsError as e:  # cannot happen with the files just written; keeps the one-line contract
            raise GenerationError(str(e)) from None
    return written


def _channel_count(channels: int | str) -> int:
    if isinstance(channels, str):
        if channels in CHANNEL_PRESETS:
            return CHANNEL_PRESETS[channels]
        try:
            return int(channels)
        except ValueError:
            raise GenerationError(
                f"--channels must be {' or '.join(CHANNEL_PRESETS)} or a count, got {channels!r}") from None
    return int(channels)


def _check_arguments(samples_per_year, height, width, chunk, splits, channels=3, hours_per_step=24) -> None:
    if samples_per_year < 1:
        raise GenerationError(f"--samples-per-year must be >= 1, got {samples_per_year}")
    if channels < 1:
        raise GenerationError(f"--channels must be >= 1, got {channels}")
    if hours_per_step < 1:
        raise GenerationError(f"--hours-per-step must be >= 1, got {hours_per_step}")
    if height < 3 or width < 4:
        raise GenerationError(f"the grid must be at least 3 x 4 (height x width), got {height} x {width}")
    if chunk < 0:
        raise GenerationError(f"--chunk must be >= 0 (0 = contiguous), got {chunk}")
    for split, years in splits.items():
        if not split or "/" in split or split.startswith("."):
            raise GenerationError(f"split name {split!r} is not a plain folder name")
        if len(set(years)) != len(years):
            raise GenerationError(f"split {split!r} lists a year twice: {years}")


def _parse_split(text: str) -> tuple[str, list[int]]:
    name, _, years = text.partition("=")
    try:
        parsed = [int(y) for y in years.split(",") if y]
    except ValueError:
        parsed = []
    if not name or not parsed:
        raise argparse.ArgumentTypeError(f"expected NAME=YEAR[,YEAR...], got {text!r}")
    return name, parsed


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(
        description="Write a synthetic stand-in for SuperBench's ERA5 (<out>/<split>/<year>.h5, key 'fields').",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path, help="output root (one folder per split)")
    parser.add_argument("--samples-per-year", type=int, default=DAYS_PER_YEAR,
                        help="samples per file (a whole year: 365 daily, 1460 six-hourly)")
    parser.add_argument("--height", type=int, default=721, help="latitude rows, both poles included (ERA5: 721)")
    parser.add_argument("--width", type=int, default=1440, help="longitude columns (ERA5: 1440)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    parser.add_argument("--train-years", type=int, nargs="*", default=list(DEFAULT_TRAIN_YEARS), help="files in train/")
    parser.add_argument("--valid-years", type=int, nargs="*", default=list(DEFAULT_VALID_YEARS), help="files in valid/")
    parser.add_argument("--split", type=_parse_split, action="append", default=[], metavar="NAME=YEARS",
                        help="another split, e.g. --split test=2017 --split valid_2=2016,2018")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="side of the stored tiles; 0 = contiguous")
    parser.add_argument("--channels", default="superbench", metavar="LAYOUT",
                        help="superbench (3: kinetic energy, t2m, tcwv), nersc20 (NERSC's 20) or a count (generic)")
    parser.add_argument("--hours-per-step", type=int, default=24, help="hours between samples (NERSC: 6)")
    parser.add_argument("--no-stats", action="store_true",
                        help="skip <out>/stats/ (normalisation statistics of the train split, compute_stats.py)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    extra_splits: dict[str, list[int]] = {}
    for name, years in args.split:  # --split test=2017 --split test=2018 adds up
        extra_splits.setdefault(name, []).extend(years)
    with errors_as_one_line(parser, GenerationError, args.out, "completed files were kept, the partial one removed"):
        files = make_synthetic_era5(
            args.out, args.samples_per_year, args.height, args.width, args.seed,
            args.train_years, args.valid_years, extra_splits=extra_splits, chunk=args.chunk,
            progress=False if args.quiet else None, channels=args.channels, hours_per_step=args.hours_per_step,
            stats=not args.no_stats,
        )
    size_gb = sum(f.stat().st_size for f in files) / 1e9
    stats = " and stats/ (from train/)" if args.train_years and not args.no_stats else ""
    print(f"wrote {len(files)} files ({size_gb:.2f} GB){stats} under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
