"""Landing ``clean + Z`` in a low-precision dtype so that noise below the grid spacing survives.

In BF16 the grid spacing near 1 is 2^-7, so round-to-nearest erases late-stage noise; the
default is variance-matched stochastic rounding (see :func:`land_noise`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ._checks import bad

#: How clean + Z lands in a low-precision dtype; see :func:`land_noise`.
ROUNDINGS = ("stochastic", "stochastic_plain", "nearest")

#: Above this, E[frac(t)(1 - frac(t))] for t ~ N(0, a^2) equals 1/6 to fp64 precision
#: (the periodic correction decays like exp(-2 pi^2 a^2)).
_SR_SATURATED = 1.5
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def fine_dtype(dtype: torch.dtype) -> bool:
    """fp32/fp64: spacing ~1e-7 relative, far below any useful sigma, so no rounding tricks."""
    return dtype.is_floating_point and torch.finfo(dtype).eps <= 2.0**-23


def sr_variance(a: Tensor) -> Tensor:
    """``E[K^2]`` where ``K`` is ``t ~ N(0, a^2)`` stochastically rounded to an integer.

    ``E[K^2] = a^2 + E[frac(t) (1 - frac(t))]``: the Gaussian's variance plus the rounding's own
    variance. Computed in closed form from truncated-normal moments over the unit intervals
    (the integrand is even in t, so only ``t >= 0`` is summed, twice). It rises from
    ``a * sqrt(2/pi)`` for tiny ``a`` to ``a^2 + 1/6`` for ``a >= 1.5``; it is increasing, which
    :func:`matched_noise_scale` inverts.
    """
    a = a.to(torch.float64)
    out = a * a + 1.0 / 6.0
    small = (a > 0) & (a < _SR_SATURATED)
    out = torch.where(a <= 0, torch.zeros_like(a), out)
    if bool(small.any()):
        s = a[small][:, None]
        k = torch.arange(math.ceil(12 * _SR_SATURATED) + 2, dtype=torch.float64)
        alpha, beta = k / s, (k + 1) / s
        pdf_a = _INV_SQRT_2PI * torch.exp(-0.5 * alpha * alpha)
        pdf_b = _INV_SQRT_2PI * torch.exp(-0.5 * beta * beta)
        m0 = torch.special.ndtr(-alpha) - torch.special.ndtr(-beta)  # P(k <= t < k + 1)
        m1 = s * (pdf_a - pdf_b)  # E[t; k <= t < k + 1]
        m2 = s * s * (m0 + alpha * pdf_a - beta * pdf_b)  # E[t^2; ...]
        # (t - k)(k + 1 - t) = -t^2 + (2k + 1) t - k (k + 1)
        per_interval = -m2 + (2 * k + 1) * m1 - k * (k + 1) * m0
        out[small] = (s * s).squeeze(1) + 2.0 * per_interval.sum(dim=1)
    return out


def _neighbours(values: Tensor) -> tuple[Tensor, Tensor]:
    """Next representable value below and above, in the values' own dtype."""
    inf = torch.full_like(values, math.inf)
    return torch.nextafter(values, -inf), torch.nextafter(values, inf)


def _scale_for_spacings(sigma: float, up: Tensor, down: Tensor) -> Tensor:
    """Solve ``(up^2 V(c sigma / up) + down^2 V(c sigma / down)) / 2 = sigma^2`` for ``c``.

    ``V`` is :func:`sr_variance`; the left side is increasing in ``c`` and at ``c = 1`` is at
    least ``sigma^2`` (``V(a) >= a^2``), so ``c`` lies in (0, 1]: bisection, elementwise.
    """
    target = sigma * sigma
    lo = torch.zeros_like(up)
    hi = torch.ones_like(up)
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        var = 0.5 * (up * up * sr_variance(mid * sigma / up) + down * down * sr_variance(mid * sigma / down))
        below = var < target
        lo = torch.where(below, mid, lo)
        hi = torch.where(below, hi, mid)
    return 0.5 * (lo + hi)


@functools.lru_cache(maxsize=256)
def _scale_table(sigma: float, e_lo: int, e_hi: int, d_lo: int, d_hi: int) -> Tensor:
    """``c`` for spacing ``2^(e-1)`` above and ``2^(e-1-d)`` below, flattened over (e, d).

    Cached: sigma is constant within a stage, so the bisection runs about once per stage.
    Callers must not modify the returned tensor.
    """
    ups = torch.arange(e_lo, e_hi + 1, dtype=torch.float64)[:, None].expand(-1, d_hi - d_lo + 1)
    downs = ups - torch.arange(d_lo, d_hi + 1, dtype=torch.float64)[None, :]
    half = torch.full_like(ups, 0.5)
    return _scale_for_spacings(sigma, torch.ldexp(half, ups), torch.ldexp(half, downs)).reshape(-1)


def matched_noise_scale(clean: Tensor, sigma: float, dtype: torch.dtype) -> Tensor:
    """Per-element ``c`` in (0, 1] such that stochastic rounding of ``clean + c * Z`` to
    ``dtype``, with ``Z ~ N(0, sigma^2)``, moves the value by a perturbation of mean 0 and
    variance ``sigma^2``.

    Why: with local grid spacing ``u`` and ``Z = sigma * n``, stochastic rounding of
    ``clean + y``, ``y ~ N(0, (a u)^2)``, moves the value by ``u * K`` with
    ``E[K] = 0`` and ``E[K^2] = sr_variance(a)`` (the Gaussian's variance *plus* the rounding's
    own). Solving for the ``a`` that gives ``sigma^2`` yields ``c = a u / sigma``. For
    ``sigma >> u`` this tends to ``sqrt(1 - u^2 / (6 sigma^2)) -> 1``; for ``sigma << u`` the
    value moves by one grid step with probability ~ ``(sigma / u)^2``. The spacing above and
    below ``clean`` differ by 2x at a power of two (1.0 is one: every RMSNorm gain at init);
    one common ``c`` for both sides keeps the mean exactly 0 and matches the variance averaged
    over the sign of ``Z``. Exact when ``clean`` is on the grid and ``clean + c Z`` stays in
    its binade; close otherwise.
    """
    grid = clean.to(torch.float64).to(dtype)
    below, above = _neighbours(grid)
    grid64 = grid.to(torch.float64)
    up = above.to(torch.float64) - grid64
    down = grid64 - below.to(torch.float64)
    ok = torch.isfinite(up) & torch.isfinite(down) & (up > 0) & (down > 0)
    if sigma <= 0 or not bool(ok.any()):
        return torch.ones_like(grid64)
    # Spacings are powers of two, so c takes one value per (exponent above, exponent below)
    # pair present (a handful): solve on a small dense table and gather. Elements without a
    # usable grid (non-finite) get c = 1 through a placeholder spacing of 1.
    _, e_up = torch.frexp(torch.where(ok, up, 1.0))
    _, e_down = torch.frexp(torch.where(ok, down, 1.0))
    e_lo, e_hi = int(e_up.min()), int(e_up.max())
    d = e_up - e_down  # 0 inside a binade, 1 at a power of two
    d_lo, d_hi = int(d.min()), int(d.max())
    table = _scale_table(float(sigma), e_lo, e_hi, d_lo, d_hi)
    index = (e_up - e_lo).long() * (d_hi - d_lo + 1) + (d - d_lo).long()
    return torch.where(ok, table[index], 1.0)


def stochastic_round(x: Tensor, dtype: torch.dtype, uniform: Tensor) -> Tensor:
    """Round ``x`` (fp64) to ``dtype``: up with probability (x - lo) / (hi - lo), so E[out] = x.

    ``uniform`` holds U[0, 1) draws of ``x``'s shape (from a seeded generator, so every rank
    rounds the same way). Values already on the grid stay put; non-finite values round to
    nearest.
    """
    x = x.to(torch.float64)
    cand = x.to(dtype)
    below, above = _neighbours(cand)
    is_low = cand.to(torch.float64) <= x
    lo = torch.where(is_low, cand, below)
    hi = torch.where(is_low, above, cand)
    lo64, hi64 = lo.to(torch.float64), hi.to(torch.float64)
    p_up = (x - lo64) / (hi64 - lo64)
    out = torch.where(uniform < p_up, hi, lo)
    finite = torch.isfinite(lo64) & torch.isfinite(hi64) & torch.isfinite(x)
    return torch.where(finite, out, cand)


def land_noise(
    clean: Tensor,
    z: Tensor,
    sigma: float,
    dtype: torch.dtype,
    rounding: str = "stochastic",
    uniform: Tensor | None = None,
) -> Tensor:
    """``clean + z`` represented in ``dtype`` (CPU in, CPU out), so that the noise survives.

    * fp32 / fp64 ``dtype``: written exactly as ``clean + z`` in that dtype (any rounding).
    * ``"stochastic"`` (default): variance-matched stochastic rounding of ``clean + c * z``
      (:func:`matched_noise_scale`): mean perturbation 0 and std ``sigma`` at every weight
      magnitude; the perturbation keeps the sign of ``z`` and is ``E[.|z] = c z``.
    * ``"stochastic_plain"``: textbook stochastic rounding of ``clean + z``
      (``E[out | z] = clean + z``), whose std overshoots ``sigma`` when sigma is below the
      grid spacing (it adds the rounding's own variance, up to ``spacing^2 / 4``).
    * ``"nearest"``: ``(clean + z)`` in fp32 then round-to-nearest-even, as the authors' code
      does in BF16; erases noise below half the grid spacing. For ablations only.

    ``uniform``: U[0, 1) draws for the stochastic modes (required for them).
    """
    if rounding not in ROUNDINGS:
        raise bad("rounding", f"unknown rounding {rounding!r}; choose one of {ROUNDINGS}")
    if fine_dtype(dtype):
        return clean.to(dtype) + z.to(dtype)
    if rounding == "nearest":
        return (clean.to(torch.float32) + z.to(torch.float32)).to(dtype)
    if uniform is None:
        raise ValueError("land_noise: stochastic rounding needs `uniform`")
    z64 = z.to(torch.float64)
    if rounding == "stochastic":
        z64 = z64 * matched_noise_scale(clean, sigma, dtype)
    return stochastic_round(clean.to(torch.float64) + z64, dtype, uniform)


def realized_std(clean: Tensor, noisy: Tensor) -> float:
    """Std (population, fp64) of the perturbation that actually landed: ``noisy - clean``."""
    delta = noisy.detach().to("cpu", torch.float64) - clean.detach().to("cpu", torch.float64)
    return float(delta.std(correction=0)) if delta.numel() else 0.0

