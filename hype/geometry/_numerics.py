"""The one place for the dtype policy and every clamp used by the geometry modules.

Policy: every geometric quantity is computed in float32 (float64 when any input is float64) with
autocast disabled, whatever the caller's dtype or autocast context. Half precision overflows |x|^2 for
hyperbolic embeddings and loses the 1 - cos θ needed near identical points.

Clamps, and why each is safe:
- `safe_sqrt` / `safe_norm`: the argument is clamped at `TINY` (far below any real squared norm), so the
  derivative of sqrt at 0 (infinite) is never evaluated; below the clamp the gradient is zero.
- `unit_clamp`: acos/asin arguments are clamped into [-1 + δ, 1 - δ] with δ = 4 ulp(1) of the compute
  dtype (≈ 4.8e-7 in fp32). A δ like 1e-8 would round to 0 in fp32 and leave an infinite derivative.
  The clamp bounds the derivative by 1/sqrt(2δ) (≈ 1e3 in fp32) and moves angles by at most
  sqrt(2δ) (≈ 1e-3 rad in fp32) near 0 and π, which is below fp32's angular resolution through acos.
- `safe_div`: denominators of angle cosines are floored at `DEN_FLOOR` = 1e-12, so that the quotient's
  backward term num/den^2 stays finite in fp32 (an inf there times the zero gradient of the following
  clamp would be NaN).
- `SINH_MAX = asinh(2**15)`: MERU's bound on the exponential map, keeping |x| <= 2**15 / sqrt(c) so |x|^2
  stays finite in fp32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch

Tensor = torch.Tensor
F = TypeVar("F", bound=Callable)

TINY = 1e-30  # floor of squared norms: normal in fp32 (min ≈ 1.2e-38), sqrt(TINY) = 1e-15
DEN_FLOOR = 1e-12
SINH_MAX = math.asinh(2.0**15)


def compute_dtype(*xs: object) -> torch.dtype:
    """float64 if any tensor input is float64, else float32."""
    for x in xs:
        if isinstance(x, Tensor) and x.dtype == torch.float64:
            return torch.float64
    return torch.float32


def delta(dtype: torch.dtype) -> float:
    """Margin that keeps acos/asin arguments strictly inside (-1, 1) in `dtype`."""
    return 4.0 * torch.finfo(dtype).eps


def geometry_op(fn: F) -> F:
    """Run `fn` with autocast off and every floating tensor argument cast to the compute dtype.

    Non-tensor arguments (a float curvature, K, an int) pass through unchanged. Integer tensors are
    left alone.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        dtype = compute_dtype(*args, *kwargs.values())

        def cast(v):
            return v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v

        args = tuple(cast(a) for a in args)
        kwargs = {k: cast(v) for k, v in kwargs.items()}
        device_type = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
        with torch.autocast(device_type=device_type, enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def safe_sqrt(x: Tensor) -> Tensor:
    return torch.sqrt(torch.clamp(x, min=TINY))


def sq_norm(x: Tensor) -> Tensor:
    return (x * x).sum(dim=-1)


def safe_norm(x: Tensor) -> Tensor:
    """Euclidean norm over the last dim, >= 1e-15, with a zero (not NaN) gradient at the zero vector."""
    return safe_sqrt(sq_norm(x))


def safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den for a non-negative `den` that may vanish (see DEN_FLOOR)."""
    return num / torch.clamp(den, min=DEN_FLOOR)


def unit_clamp(x: Tensor) -> Tensor:
    d = delta(x.dtype)
    return torch.clamp(x, -1.0 + d, 1.0 - d)


def as_tensor(value: float | Tensor, like: Tensor) -> Tensor:
    """A scalar hyperparameter (curvature, K) as a tensor on `like`'s device and dtype."""
    if isinstance(value, Tensor):
        return value.to(device=like.device, dtype=like.dtype)
    return torch.tensor(float(value), device=like.device, dtype=like.dtype)


def acosh1p(z: Tensor) -> Tensor:
    """acosh(1 + z) for z >= 0, accurate for small z and with a finite gradient at z = 0.

    acosh(1 + z) = log1p(z + sqrt(z (z + 2))); computing 1 + z first would lose z below fp32's eps.
    """
    z = torch.clamp(z, min=0.0)
    return torch.log1p(z + safe_sqrt(z * (z + 2.0)))
