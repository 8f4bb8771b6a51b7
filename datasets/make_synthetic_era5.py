"""Write a synthetic stand-in for SuperBench's ERA5 in exactly its layout, at any size.

    python datasets/make_synthetic_era5.py --out datasets/synthetic_small \\
        --samples-per-year 32 --height 181 --width 360 --seed 0

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
depends only on (seed, split, year, samples, height, width): regenerating one year, or adding
years, leaves the others bit-identical.
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

# SuperBench's per-channel statistics (the targets); utils/data.py holds the same values as
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

    def __init__(self, height: int, width: int, slope: float):
        self.height, self.width = height, width
        self.circle = 2 * (height - 1)  # latitude on a full circle: pole to pole and back
        k_lat = np.fft.fftfreq(self.circle, d=1.0 / self.circle)  # cycles per 360 degrees
        k_lon = np.arange(width // 2 + 1)
        k2 = k_lat[:, None] ** 2 + k_lon[None, :] ** 2
        amplitude = (k2 + LARGEST_SCALE**2) ** (-slope / 2)
        amplitude[0, 0] = 0.0  # the mean comes from the channel's profile, not from the noise
        # Exact variance of irfft(ifft(C)) at a grid point for circular complex C with E|C|^2 =
        # amplitude^2: the zero (and Nyquist) longitude columns keep only their real part.
        per_column = (amplitude**2).sum(axis=0) / self.circle**2
        weights = np.full(k_lon.shape, 2.0)
        weights[0] = 0.5
        if width % 2 == 0:
            weights[-1] = 0.5
        variance = (weights * per_column).sum() / width**2
        # sqrt(1/2): real and imaginary parts each carry half of E|C|^2. Trailing axis of 1 so it
        # scales (real, imag) pairs in float32, cheaper than a complex product.
        self.amplitude = (amplitude * np.sqrt(0.5 / variance)).astype(np.float32)[..., None]

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        white = rng.standard_normal((*self.amplitude.shape[:2], 2), dtype=np.float32)
        white *= self.amplitude
        return np.fft.ifft(white.view(np.complex64)[..., 0], axis=0)[: self.height]

    def to_grid(self, spectrum: np.ndarray) -> np.ndarray:
        return np.fft.irfft(spectrum, n=self.width, axis=1)


@dataclass(frozen=True)
class Grid:
    height: int
    width: int

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

    def channels(self, day: int, temperature: np.ndarray, moisture: np.ndarray, wind: np.ndarray) -> np.ndarray:
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


def generate_samples(grid: Grid, n_samples: int, seed: int, split: str, year: int) -> Iterator[np.ndarray]:
    """Yields ``n_samples`` consecutive days, each (3, height, width) float32."""
    rng = _rng(seed, split, year)
    model = WeatherModel(grid, geography(grid, seed))
    # Advection by the zonal wind is a phase shift of each latitude's Fourier series.
    shift = zonal_wind_deg_per_day(grid.lat_deg)[:, None] / 360.0
    advect = np.exp(-2j * np.pi * np.arange(grid.width // 2 + 1)[None, :] * shift).astype(np.complex64)
    noises = {name: SpectralNoise(grid.height, grid.width, latent.slope) for name, latent in LATENTS.items()}
    state = {name: noise.draw(rng) for name, noise in noises.items()}
    for step in range(-SPIN_UP_STEPS, n_samples):
        for name, latent in LATENTS.items():
            renewal = np.float32(np.sqrt(1 - latent.rho**2))
            state[name] = np.float32(latent.rho) * advect * state[name] + renewal * noises[name].draw(rng)
        if step >= 0:
            grids = {name: noises[name].to_grid(spectrum) for name, spectrum in state.items()}
            yield model.channels(step, **grids)  # sample t is day t of the year, from 1 January


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
    try:
        with h5py.File(partial, "w") as f:
            fields = f.create_dataset(
                "fields", shape=(n_samples, 3, grid.height, grid.width), dtype=np.float32,
                chunks=chunk_shape(grid.height, grid.width, chunk),
            )
            fields.attrs["channels"] = [name for name, _ in CHANNELS]
            fields.attrs["units"] = [unit for _, unit in CHANNELS]
            f.attrs.update({"synthetic": True, "seed": seed, "split": split, "year": year,
                            "generator": "datasets/make_synthetic_era5.py"})
            for t, sample in enumerate(generate_samples(grid, n_samples, seed, split, year)):
                fields[t] = sample
                if bar is not None:
                    bar.update(1)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


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
) -> list[Path]:
    """Write ``<out_dir>/<split>/<year>.h5`` for train, valid and any ``extra_splits``
    (e.g. ``{"test": [2017]}``) and return the paths written.

    ``chunk``: side of the stored tiles (0 = contiguous). ``progress``: tqdm bar; None shows it
    when stderr is a terminal.
    """
    extra_splits = {name: list(years) for name, years in (extra_splits or {}).items()}
    for name in ("train", "valid"):
        if name in extra_splits:
            raise GenerationError(f"split {name!r} comes from --{name}-years; do not give it with --split")
    splits = {"train": list(train_years), "valid": list(valid_years), **extra_splits}
    _check_arguments(samples_per_year, height, width, chunk, splits)
    grid = Grid(height, width)
    out = Path(out_dir)
    jobs = [(split, year) for split, years in splits.items() for year in years]
    show = sys.stderr.isatty() if progress is None else progress
    written = []
    with tqdm(total=len(jobs) * samples_per_year, unit="day", disable=not show,
              desc=f"synthetic ERA5 {height}x{width}") as bar:
        for split, year in jobs:
            (out / split).mkdir(parents=True, exist_ok=True)
            bar.set_postfix_str(f"{split}/{year}.h5")
            written.append(write_year(out / split / f"{year}.h5", grid, samples_per_year, seed, split, year, chunk, bar))
    return written


def _check_arguments(samples_per_year, height, width, chunk, splits) -> None:
    if samples_per_year < 1:
        raise GenerationError(f"--samples-per-year must be >= 1, got {samples_per_year}")
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


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (not the usage block)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(
        description="Write a synthetic stand-in for SuperBench's ERA5 (<out>/<split>/<year>.h5, key 'fields').",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", required=True, type=Path, help="output root (one folder per split)")
    parser.add_argument("--samples-per-year", type=int, default=DAYS_PER_YEAR, help="days per file")
    parser.add_argument("--height", type=int, default=721, help="latitude rows, both poles included (ERA5: 721)")
    parser.add_argument("--width", type=int, default=1440, help="longitude columns (ERA5: 1440)")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same bytes")
    parser.add_argument("--train-years", type=int, nargs="*", default=list(DEFAULT_TRAIN_YEARS), help="files in train/")
    parser.add_argument("--valid-years", type=int, nargs="*", default=list(DEFAULT_VALID_YEARS), help="files in valid/")
    parser.add_argument("--split", type=_parse_split, action="append", default=[], metavar="NAME=YEARS",
                        help="another split, e.g. --split test=2017 --split valid_2=2016,2018")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="side of the stored tiles; 0 = contiguous")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    extra_splits: dict[str, list[int]] = {}
    for name, years in args.split:  # --split test=2017 --split test=2018 adds up
        extra_splits.setdefault(name, []).extend(years)
    try:
        files = make_synthetic_era5(
            args.out, args.samples_per_year, args.height, args.width, args.seed,
            args.train_years, args.valid_years, extra_splits=extra_splits, chunk=args.chunk,
            progress=False if args.quiet else None,
        )
    except GenerationError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except OSError as e:
        parser.exit(2, f"{parser.prog}: error: cannot write under {args.out}: {e.strerror or e}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted; completed files were kept, the partial one removed\n")
    size_gb = sum(f.stat().st_size for f in files) / 1e9
    print(f"wrote {len(files)} files ({size_gb:.2f} GB) under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
