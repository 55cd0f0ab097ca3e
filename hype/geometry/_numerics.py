"""The one place for the dtype policy and every clamp used by the geometry modules.

Policy: every geometric quantity is computed in float32 (float64 when any input is float64) with
autocast disabled, whatever the caller's dtype or autocast context. Half precision overflows |x|^2 for
hyperbolic embeddings and loses the 1 - cos θ needed near identical points.

Clamps, and why each is safe:
- `safe_sqrt` / `safe_norm`: the argument is clamped at `TINY` (far below any real squared norm), so the
  derivative of sqrt at 0 (infinite) is never evaluated; below the clamp the gradient is zero.
- `unit_clamp`: acos/asin arguments are clamped into [-1 + δ, 1 - δ] with δ = eps/2, the spacing of the
  compute dtype just below 1 (2^-24 ≈ 6e-8 in fp32): the closest values to ±1 that are not ±1. A δ like
  1e-8 would round to 0 in fp32 and leave an infinite derivative. The clamp bounds the derivative by
  1/sqrt(2δ) (≈ 2.9e3 in fp32) and moves angles by at most sqrt(2δ) (3.5e-4 rad in fp32) near 0 and π,
  which is fp32's own resolution through acos there. Where an angle must be resolved near 0 or π (the
  row-wise exterior angles and geodesics), it is computed with `angle_from` instead of acos.
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
    """Margin that keeps acos/asin arguments strictly inside (-1, 1) in `dtype`: one ulp below 1."""
    return torch.finfo(dtype).eps / 2


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


def scaled_gap(x: Tensor, y: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """(|y| x - |x| y, |x|^2 - |y|^2) for a = |x|, b = |y|, both accurate to a few ulps of their size.

    Written out, |y| x - |x| y cancels for near-identical vectors and |x| - |y| for vectors of similar norm.
    Instead: |x|^2 - |y|^2 = (x - y)·(x + y), and with m the smaller norm and s its vector,
    |y| x - |x| y = (|y| - |x|) s + m (x - y), where x - y is exact for close vectors (Sterbenz) and
    |y| - |x| = (|y|^2 - |x|^2) / (|x| + |y|). `a`, `b` must be positive (`safe_norm`).
    """
    diff = x - y
    sq_gap = (diff * (x + y)).sum(-1)
    shorter_x = (a <= b)[..., None]
    m, s = torch.where(shorter_x, a[..., None], b[..., None]), torch.where(shorter_x, x, y)
    return (-sq_gap / (a + b))[..., None] * s + m * diff, sq_gap


def angle_from(sin: Tensor, cos: Tensor) -> Tensor:
    """The angle in [0, π] with sine and cosine proportional to (sin >= 0, cos): atan2, which keeps full
    relative accuracy near 0 and π where acos of a quotient cannot; π/2 where both vanish (an undefined
    angle, e.g. coincident points), with a finite gradient there too."""
    flat = (sin == 0) & (cos == 0)
    return torch.atan2(
        torch.where(flat, torch.ones_like(sin), sin), torch.where(flat, torch.zeros_like(cos), cos)
    )


def acos_resolved(cos: Tensor) -> Tensor:
    """acos(cos) with the value of acos(clamp(cos, -1, 1)) and the gradient of acos(unit_clamp(cos)).

    The margin of `unit_clamp` exists only to keep the derivative finite; its value floor (3.5e-4 rad
    from 0 and π in fp32) would cost accuracy where fp32 resolves the angle, so the value comes from the
    unclamped argument. Away from ±1 both are the same bits.
    """
    if not (cos.requires_grad and torch.is_grad_enabled()):
        # No gradient to protect (scoring, eval): one acos pass, no margin, no extra full-size tensors.
        return torch.acos(torch.clamp(cos, -1.0, 1.0))
    inside = torch.acos(unit_clamp(cos))
    return inside + (torch.acos(torch.clamp(cos, -1.0, 1.0)) - inside).detach()
