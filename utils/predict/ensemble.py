"""Ensemble forecasts (predict.py --members M): each member's initial state, perturbed as the config's ``ensemble``
section says (utils/config.py, EnsembleConfig), following earth2studio's catalogue of perturbations:

- ``gaussian``: independent noise in every cell, of standard deviation ``noise_scale`` times the channel's std (the
  std the model normalises with: one fraction means as much for geopotential as for humidity);
- ``spherical``: the same noise, correlated over ``correlation_km`` on the sphere (:class:`SphereSmoother`);
- ``bred``: bred vectors (Toth and Kalnay 1993): noise grown by one model step from the initial state, the
  difference to the unperturbed step rescaled to the noise's size, ``bred_cycles`` times: what remains points along
  the directions in which errors grow fastest;
- ``lagged``: no noise; member k starts k model steps before the initial time and runs k more steps, so that every
  member verifies at the same times (lagged average forecasting, Hoffman and Kalnay 1983). Member 0 is the
  deterministic forecast.

Every perturbed member is perturbed (no unperturbed control): the members are exchangeable, as the fair CRPS and the
rank histogram assume. Member k's noise for item i is drawn from a generator seeded by (``ensemble_seed``, k, i)
alone, on the CPU: a member is the same whichever rank computes it, in whatever order, on whatever device.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch

from utils.data.common import DataError

EARTH_RADIUS_KM = 6371.0  # the mean radius: a correlation length is a distance on the surface


def member_generator(seed: int, member: int, item: int) -> torch.Generator:
    """A generator that depends on (seed, member, item) only: SeedSequence mixes the three into one well-spread
    state (seeds seed + member would make member 1 of seed 0 member 0 of seed 1)."""
    state = np.random.SeedSequence([seed, member, item]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state >> np.uint64(1)))


class SphereSmoother:
    """White noise on a latitude-longitude grid -> noise of unit variance whose correlation between two points falls
    as a Gaussian of their distance on the sphere, exp(-d^2 / 2L^2), L = ``length_km``.

    Chosen over a spherical-harmonic spectrum (earth2studio's CorrelatedSphericalGaussian) because it needs no
    spherical-harmonic transform (no extra package, any grid) and its one parameter is a distance a forecaster
    thinks in. It is separable: along each circle of latitude a periodic Gaussian of the distance along that circle
    (R cos(latitude) times the longitude difference: near the poles a circle is short, and the noise on it nearly
    constant, as on the sphere), then along the meridian a Gaussian of R times the latitude difference. Each kernel
    is scaled to unit L2 norm, so every cell keeps variance 1 (the rows are independent after the first pass). It is
    isotropic to the extent that the two passes commute: well for L small beside the Earth's radius, less toward
    the poles, where the rows mixed by the second pass were smoothed over different longitudes. Cost: an FFT along
    each circle and a (latitudes x latitudes) product per channel: on ERA5's 721 x 1440, about 1.5 GFLOP a channel."""

    def __init__(self, latitude: Sequence[float], width: int, length_km: float):
        lat = np.deg2rad(np.asarray(latitude, dtype=np.float64))
        ratio = EARTH_RADIUS_KM / length_km
        # A kernel exp(-d^2 / L^2) (width L / sqrt 2): white noise smoothed by it has the correlation of the kernel
        # convolved with itself, exp(-d^2 / 2L^2).
        meridian = np.exp(-(ratio * (lat[:, None] - lat[None, :])) ** 2)
        self.meridian = meridian / np.sqrt((meridian ** 2).sum(axis=1, keepdims=True))
        offsets = 2 * np.pi / width * np.minimum(np.arange(width), width - np.arange(width))  # periodic distance
        circle = np.exp(-(ratio * np.cos(lat)[:, None] * offsets[None, :]) ** 2)
        circle /= np.sqrt((circle ** 2).sum(axis=1, keepdims=True))
        self.circle = np.fft.rfft(circle, axis=-1)  # a circular convolution: a product of spectra
        self.width = width

    def __call__(self, white: np.ndarray) -> np.ndarray:
        """(..., latitude, longitude) float64 white noise -> correlated noise of the same shape."""
        along = np.fft.irfft(np.fft.rfft(white, axis=-1) * self.circle, n=self.width, axis=-1)
        return np.einsum("ij,...jk->...ik", self.meridian, along)


class Ensemble:
    """The members of one prediction: their initial states and, for a lagged ensemble, their extra steps."""

    def __init__(self, cfg, members: int, latitude: Optional[Sequence[float]], inputs):
        self.config, self.members, self.inputs = cfg.ensemble, members, inputs
        self.kind = self.config.perturbation
        std = list(cfg.model.std)
        if self.kind != "lagged" and len(std) != cfg.model.in_chans:
            raise DataError(f"perturbation {self.kind} scales its noise by each channel's std, and this checkpoint "
                            f"records {len(std)} for {cfg.model.in_chans} channels: use perturbation lagged")
        self.scale = self.config.noise_scale * torch.tensor(std, dtype=torch.float64).view(-1, 1, 1)
        self.smoother = None
        if self.kind == "spherical":
            if latitude is None:
                raise DataError("perturbation spherical needs the grid's latitudes: the data records none")
            self.smoother = SphereSmoother(latitude, int(inputs.read(0).shape[-1]), self.config.correlation_km)

    def describe(self) -> dict:
        """What the store's attributes and the resume request record of the perturbation."""
        c = self.config
        said = {"members": self.members, "perturbation": self.kind}
        if self.kind != "lagged":
            said.update(noise_scale=c.noise_scale, ensemble_seed=c.ensemble_seed)
        if self.kind == "spherical":
            said["correlation_km"] = c.correlation_km
        if self.kind == "bred":
            said["bred_cycles"] = c.bred_cycles
        return said

    def start(self, item: int, member: int) -> int:
        """The input item member ``member`` of item ``item`` starts from."""
        if self.kind != "lagged" or member == 0:
            return item
        earlier = self.inputs.earlier(item, member)
        if earlier is None:
            raise DataError(f"a lagged ensemble of {self.members} members starts its member k at k model steps "
                            f"before each initial time; the data holds no state {member} step(s) before item {item}: "
                            "choose later --times, or fewer --members")
        return earlier

    def extra_steps(self, member: int) -> int:
        return member if self.kind == "lagged" else 0

    def noise(self, items: Sequence[int], member: int, shape: Sequence[int]) -> torch.Tensor:
        """Each item's noise (items, channels, *grid), float32: standard normal (smoothed for spherical) times
        noise_scale times the channel's std."""
        out = []
        for item in items:
            white = torch.randn(tuple(shape), generator=member_generator(self.config.ensemble_seed, member, item),
                                dtype=torch.float64)
            if self.smoother is not None:
                white = torch.from_numpy(self.smoother(white.numpy()))
            out.append((white * self.scale).float())
        return torch.stack(out)

    def perturb(self, x: torch.Tensor, items: Sequence[int], member: int,
                step: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The members' initial states for a batch ``x`` (items, channels, *grid) on its device."""
        if self.kind == "lagged":
            return x
        delta = self.noise(items, member, x.shape[1:]).to(x.device)
        if self.kind == "bred":
            target = self._rms(delta)  # the size every cycle's vector is rescaled to: the noise's own
            base = step(x)
            for _ in range(self.config.bred_cycles):
                grown = step(x + delta) - base
                size = self._rms(grown)
                # A channel the step does not change (size 0) keeps no perturbation: nothing grows there.
                delta = torch.where(size > 0, grown * target / size.clamp_min(torch.finfo(size.dtype).tiny), 0.0)
        return x + delta

    @staticmethod
    def _rms(x: torch.Tensor) -> torch.Tensor:
        return x.pow(2).mean(dim=tuple(range(2, x.dim())), keepdim=True).sqrt()
