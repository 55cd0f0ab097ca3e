"""Lorentz model of hyperbolic space with curvature -c (MERU, HYPE). DESIGN §2.1.

Points are stored by their space components x ∈ R^n; the time component x_t = sqrt(1/c + |x|^2) is
derived. Every function has a row-wise form (x[i] with y[i], broadcasting over leading dims) and a
`pairwise_` form (every row of x with every row of y, shape (N, M)) that runs as one matrix product.

Two formulations, on purpose:
- Row-wise forms are accurate to a few ulps in every regime (near-identical points, far-apart points of
  unequal norms, points inside a cone, norms up to the 2^15 clamp); see `_rowwise_z` and
  `exterior_angle`. d(x, x) is exactly 0.
- Pairwise forms use z = c (x_t y_t - x·y) - 1 from one matmul, as MERU and HYPE do. Its absolute error
  is about c |x| |y| eps, fine for trained embeddings (|x| of a few units) but not for near-identical
  points; use the row-wise form there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hype.geometry._numerics import (
    SINH_MAX,
    TINY,
    Tensor,
    acos_resolved,
    acosh1p,
    angle_from,
    geometry_op,
    safe_div,
    safe_norm,
    safe_sqrt,
    scaled_gap,
    sq_norm,
    unit_clamp,
)
from hype.geometry._tiles import run_tiles, tile_grid

DEFAULT_K = 0.1  # MERU's minimum-radius constant of the entailment cone

Curv = float | Tensor


@geometry_op
def time_component(x: Tensor, curv: Curv) -> Tensor:
    """x_t = sqrt(1/c + |x|^2), shape x.shape[:-1]."""
    return torch.sqrt(1.0 / curv + sq_norm(x))


@geometry_op
def inner(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """Row-wise Lorentz inner product <x,y>_L = x·y - x_t y_t (<= -1/c on the manifold)."""
    return (x * y).sum(-1) - time_component(x, curv) * time_component(y, curv)


@geometry_op
def pairwise_inner(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """<x_i, y_j>_L for all pairs, shape (N, M)."""
    return x @ y.T - time_component(x, curv)[:, None] * time_component(y, curv)[None, :]


def _rowwise_z(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """z = -c<x,y>_L - 1 >= 0, accurate to a few ulps of z; exactly 0 when x == y.

    Three forms, chosen per row by which one does not cancel:
    - difference form z = c (|x-y|^2 - (x_t-y_t)^2) / 2, x_t - y_t = (x-y)·(x+y) / (x_t+y_t): exact for
      near-identical points, but the two squares cancel when x - y is nearly light-like (far-apart points
      of unequal norms, a point far beyond another on its ray), e.g. 1e-4 relative at |y| = 1e4. Used where
      it loses at most one bit ((x_t-y_t)^2 <= |x-y|^2 / 2), which is where trained embeddings lie, so
      those results keep their bits;
    - product form z = c (x_t y_t - x·y) - 1 (MERU's), used where neither subtraction loses a bit
      (x·y <= x_t y_t / 2 and z >= 1): far-apart points;
    - sum form z = c (|x| - |y|)^2 / (c (x_t y_t + |x||y|) + 1) + c ||y| x - |x| y|^2 / (2 |x||y|), from
      x_t y_t - |x||y| - 1/c = (|x| - |y|)^2 / (c (x_t y_t + |x||y| + 1/c)) and |x||y| - x·y: two
      non-negative terms, each from `scaled_gap` without cancellation; everywhere else (a point far
      beyond another near its ray, i.e. inside its entailment cone).
    """
    xt, yt = time_component(x, curv), time_component(y, curv)
    dt = ((x - y) * (x + y)).sum(-1) / (xt + yt)
    sq = sq_norm(x - y)
    by_difference = torch.clamp(curv * (sq - dt * dt) / 2.0, min=0.0)
    dot, tt = (x * y).sum(-1), xt * yt
    w = curv * (tt - dot)
    a, b = safe_norm(x), safe_norm(y)
    gap, sq_gap = scaled_gap(x, y, a, b)
    ab = a * b
    norm_gap = sq_gap / (a + b)
    by_sum = curv * (norm_gap * norm_gap / (curv * (tt + ab) + 1.0) + sq_norm(gap) / (2.0 * ab))
    z = torch.where((2.0 * dot <= tt) & (w >= 2.0), w - 1.0, by_sum)
    return torch.where(2.0 * dt * dt <= sq, by_difference, z)


def _pairwise_z(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    return torch.clamp(-curv * pairwise_inner(x, y, curv) - 1.0, min=0.0)


@geometry_op
def distance(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """Row-wise geodesic distance d_L = acosh(-c<x,y>_L) / sqrt(c)."""
    return acosh1p(_rowwise_z(x, y, curv)) / curv**0.5


@geometry_op
def pairwise_distance(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """d_L(x_i, y_j) for all pairs, shape (N, M)."""
    return acosh1p(_pairwise_z(x, y, curv)) / curv**0.5


@geometry_op
def squared_distance(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    return distance(x, y, curv) ** 2


@geometry_op
def pairwise_squared_distance(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    return pairwise_distance(x, y, curv) ** 2


@geometry_op
def exp_map0(v: Tensor, curv: Curv) -> Tensor:
    """Exponential map at the origin: tangent vector v -> space components sinh(√c|v|)/(√c|v|) · v.

    The sinh argument is clamped at asinh(2^15) (MERU), so |x| <= 2^15/√c; v = 0 maps to 0 with an
    identity Jacobian.
    """
    r = curv**0.5 * safe_norm(v)
    return (torch.sinh(torch.clamp(r, max=SINH_MAX)) / r)[..., None] * v


@geometry_op
def log_map0(x: Tensor, curv: Curv) -> Tensor:
    """Logarithmic map at the origin (inverse of `exp_map0` below its clamp): asinh(√c|x|)/(√c|x|) · x."""
    r = curv**0.5 * safe_norm(x)
    return (torch.asinh(r) / r)[..., None] * x


@geometry_op
def half_aperture(x: Tensor, curv: Curv, K: float = DEFAULT_K) -> Tensor:
    """aper(x) = asin(min(1, 2K / (√c |x|))); exactly π/2 (with zero gradient) inside radius 2K/√c."""
    return _aperture_of_norm(safe_norm(x), curv, K)


def _aperture_of_norm(norm: Tensor, curv: Curv, K: float) -> Tensor:
    s = 2.0 * K / (curv**0.5 * norm)
    return torch.where(s >= 1.0, torch.full_like(s, math.pi / 2), torch.asin(unit_clamp(s)))


def _exterior_from_inner(xt: Tensor, yt: Tensor, xnorm: Tensor, w: Tensor) -> Tensor:
    # With w = -c<x,y>_L and z = w - 1 >= 0: numerator y_t + x_t c<x,y>_L = y_t - x_t w,
    # and (c<x,y>_L)^2 - 1 = z (z + 2) without cancellation (w^2 - 1 is fewer roundings once w >= 2).
    z = torch.clamp(w - 1.0, min=0.0)
    num = yt - xt * w
    den = xnorm * safe_sqrt(torch.where(w >= 2.0, w * w - 1.0, z * (z + 2.0)))
    return acos_resolved(safe_div(num, den))


@geometry_op
def exterior_angle(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """Row-wise exterior angle at x of the triangle O-x-y (π minus the angle Oxy), accurate to a few ulps.

    The acos form cos ext = c (x_t x·y - |x|^2 y_t) / (|x| sqrt((c<x,y>_L)^2 - 1)) (MERU's `oxy_angle`,
    `pairwise_exterior_angle`) loses most digits for small angles, i.e. pairs inside the cone. Since the
    squared denominator minus the squared numerator is c |x ∧ y|^2 (expand with x_t^2 = 1/c + |x|^2),
        ext = atan2(|x ∧ y|, sqrt(c) (x_t x·y - |x|^2 y_t)),
    with |x ∧ y| = ||y|x - |x|y| ||y|x + |x|y| / (2|x||y|) and
    x_t x·y - |x|^2 y_t = |x| (|y|^2 - |x|^2) / (c (x_t |y| + |x| y_t)) - x_t ||y|x - |x|y|^2 / (2|x||y|),
    every term free of cancellation (`scaled_gap`). π/2 for x == y, as in MERU.
    """
    xt, yt = time_component(x, curv), time_component(y, curv)
    a, b = safe_norm(x), safe_norm(y)
    gap, sq_gap = scaled_gap(x, y, a, b)
    two_ab = 2.0 * a * b
    wedge = safe_norm(gap) * safe_norm(b[..., None] * x + a[..., None] * y) / two_ab
    cos_part = -a * sq_gap / (curv * (xt * b + a * yt)) - xt * sq_norm(gap) / two_ab
    return angle_from(torch.where(sq_norm(x - y) == 0, torch.zeros_like(wedge), wedge), curv**0.5 * cos_part)


@geometry_op
def pairwise_exterior_angle(x: Tensor, y: Tensor, curv: Curv) -> Tensor:
    """Exterior angle at x_i towards y_j for all pairs, shape (N, M): x are apexes, y points.

    One matmul gives every cosine; the pairs it cannot resolve (near-identical points, angles near 0 or π:
    the NEAR and EDGE_ANGLE bounds below) are recomputed by the row-wise `exterior_angle`, differentiably,
    so the result is never less accurate than MERU's `oxy_angle` on the same pairs."""
    xt, yt = time_component(x, curv), time_component(y, curv)
    w = -curv * pairwise_inner(x, y, curv)
    ext = _exterior_from_inner(xt[:, None], yt[None, :], torch.linalg.vector_norm(x, dim=-1)[:, None], w)
    with torch.no_grad():
        c = float(curv)
        wd = w.detach()
        near = (wd * wd - 1.0) < NEAR * c * (xt.detach()[:, None] * yt.detach()[None, :]) * wd
        edge = (ext.detach() < EDGE_ANGLE) | (ext.detach() > math.pi - EDGE_ANGLE)
        i, j = (near | edge).nonzero(as_tuple=True)
    if i.numel():
        ext = ext.index_put((i, j), exterior_angle(x[i], y[j], curv))
    return ext


@geometry_op
def entailment_energy(x: Tensor, y: Tensor, curv: Curv, K: float = DEFAULT_K) -> Tensor:
    """E(x -> y) = ext(x, y) - aper(x), row-wise; negative when y lies inside x's cone."""
    return exterior_angle(x, y, curv) - half_aperture(x, curv, K)


@geometry_op
def pairwise_entailment_energy(x: Tensor, y: Tensor, curv: Curv, K: float = DEFAULT_K) -> Tensor:
    """E(x_i -> y_j) for all pairs, shape (N, M)."""
    return pairwise_exterior_angle(x, y, curv) - half_aperture(x, curv, K)[:, None]


@geometry_op
def entailment_loss(x: Tensor, y: Tensor, curv: Curv, K: float = DEFAULT_K) -> Tensor:
    """Row-wise MERU entailment loss L_e = max(0, E(x -> y))."""
    return torch.clamp(entailment_energy(x, y, curv, K), min=0.0)


# ---------------------------------------------------------------- inference-time reductions
# CPU tile: large enough for near-full matmul speed and few Python-level calls per tile (threads share
# the GIL between torch ops), small enough that the epilogue's passes run in cache (2 MB buffers, L2/L3).
# Measured with bench/score_specificity.py and per-op timings on a 2-core AVX-512 Xeon.
CPU_TILE = (512, 1024)


# Pairs whose one-matmul cosine is ill-conditioned, recomputed by the row-wise `exterior_angle` (a few ulps):
# - NEAR: (w^2 - 1)/w < NEAR * c x_t y_t, with w = -c<x,y>_L. w comes from a sum of terms of size c x_t y_t,
#   so its rounding error is a few eps * c x_t y_t; below this bound it costs (w^2 - 1) more than ~1e-5 of
#   its value (near-identical points, or any pair once the norms reach ~1e3); above it the matmul form has
#   the conditioning of the authors' form. Trained embeddings (c x_t y_t of a few units) only reach it for
#   near-duplicates (sqrt(c) d_L below ~0.1-0.2).
# - EDGE_ANGLE: angles within this of 0 or π (a point inside a narrow cone); acos of a rounded cosine
#   has resolution eps / angle there, 3.5e-4 rad at worst in fp32.
NEAR = 1e-2
EDGE_ANGLE = 0.03
_EDGE_COS = math.cos(EDGE_ANGLE)
_FALLBACK_CHUNK = 1 << 16  # flagged pairs per `exterior_angle` call: bounds the gathered (k, n) rows


@dataclass(frozen=True, eq=False)
class PreparedPoints:
    """Per-point quantities of `mean_entailment_energy`, computed once for a reused set (references)."""

    x: Tensor  # space components, compute dtype
    t: Tensor  # time components
    norm: Tensor  # |x|, floored at 1e-15 so no quotient is 0/0
    aper: Tensor  # half-aperture
    sq: Tensor  # |x|^2 in float64: the per-point constants below are derived from it, rounded once
    _cache: dict = field(default_factory=dict, repr=False)

    def operand(self, role: str, curv: float) -> Tensor:
        """Matmul operand (N, n+1): the product of an apex's and a point's rows is (x_t/|x|) num, with
        num = c (x_t x·y - |x|^2 y_t) the numerator of cos ext.

        apex x: (x_t/|x|) [c x_t x, -c|x|^2]; point y: [y, y_t]. The numerator comes out of the matmul
        directly, which measures more accurate than deriving it from -c<x,y>_L (HYPE's route; 0.7x the
        error far apart, bench/RESULTS.md). Cached per (role, c).
        """
        key = (role, curv)
        if key not in self._cache:
            if role == "apex":
                xt, norm = self._exact(curv)
                scale, last = (curv * xt * xt / norm).to(self.x.dtype), (-curv * norm * xt).to(self.x.dtype)
                op = torch.cat([self.x * scale[:, None], last[:, None]], dim=1)
            else:
                op = torch.cat([self.x, self.t[:, None]], dim=1)
            self._cache[key] = op
        return self._cache[key]

    def constants(self, curv: float) -> dict[str, Tensor]:
        """Per-apex constants of the epilogue, each rounded once from float64: -|x|/x_t, -x_t^2, x_t."""
        key = ("constants", curv)
        if key not in self._cache:
            xt, norm = self._exact(curv)
            exact = {"k": -norm / xt, "neg_t2": -xt * xt, "t": xt}
            self._cache[key] = {name: v.to(self.x.dtype) for name, v in exact.items()}
        return self._cache[key]

    def _exact(self, curv: float) -> tuple[Tensor, Tensor]:
        return torch.sqrt(1.0 / curv + self.sq), torch.sqrt(self.sq.clamp(min=TINY))


@torch.no_grad()
@geometry_op
def prepare(x: Tensor, curv: Curv, K: float = DEFAULT_K) -> PreparedPoints:
    sq = sq_norm(x)  # once: on a 20,000-point reference set each pass over x costs milliseconds
    norm = safe_sqrt(sq)
    return PreparedPoints(x, torch.sqrt(1.0 / curv + sq), norm, _aperture_of_norm(norm, curv, K), sq.double())


def _near_floor(xt: Tensor | float, yt: Tensor | float, curv: float) -> Tensor | float:
    """x_t^2 (w^2 - 1) at the NEAR bound, (w^2 - 1)/w = T with T = NEAR c x_t y_t (increasing in both)."""
    big_t = NEAR * curv * xt * yt
    return xt * xt * big_t * (big_t + (big_t * big_t + 4.0) ** 0.5) / 2.0


@torch.no_grad()
def mean_entailment_energy(
    apex: PreparedPoints, points: PreparedPoints, curv: Curv, *, dim: int, hinge: bool = False
) -> Tensor:
    """Mean over `dim` of E(apex_i -> point_j) (or of max(0, E) with `hinge`), for all pairs.

    The formula of `pairwise_entailment_energy`, arranged for inference on large (N, M) blocks. Per
    pair, with m = (x_t/|x|) num from one matmul of `PreparedPoints.operand`s and W = x_t (-c<x,y>_L):

        W = y_t - (|x|/x_t) m,   cos ext = num / (|x| sqrt((c<x,y>_L)^2 - 1)) = m / sqrt(W^2 - x_t^2)

    i.e. two `addcmul`s with per-row / per-column constants, a sqrt and a division, then acos and a row
    sum: every pass runs in place on a slice that stays in cache (`CPU_TILE`, one tile per core,
    `_tiles.run_tiles`); on GPU the whole block is one tile. Two reductions per tile check that no pair
    is ill-conditioned (NEAR, EDGE_ANGLE); where one is, `_resolve` recomputes those pairs with the
    row-wise `exterior_angle`, so every value is at least as accurate as HYPE's own form (bench/RESULTS.md).
    Without the hinge the aperture leaves the loop (mean(ext - aper) = mean(ext) - mean(aper)). No
    autograd; use the pairwise functions for training.
    """
    c = float(curv)
    # The output is indexed by rows, the mean runs along columns: rows are the apexes for dim=1.
    apex_rows = dim == 1
    keep, other = (apex, points) if apex_rows else (points, apex)
    rows_op = keep.operand("apex" if apex_rows else "point", c)
    cols_op = other.operand("point" if apex_rows else "apex", c)
    n_rows, n_cols = rows_op.shape[0], cols_op.shape[0]

    def along(v: Tensor, apex_side: bool) -> Tensor:  # a per-point vector as a broadcastable row/column
        return v[:, None] if apex_side == apex_rows else v[None, :]

    const = apex.constants(c)
    k, neg_t2, apex_t = along(const["k"], True), along(const["neg_t2"], True), along(const["t"], True)
    point_t = along(points.t, False)
    aper = along(apex.aper, True)

    on_cpu = rows_op.device.type == "cpu"
    tiles, (tile_r, tile_c) = tile_grid(n_rows, n_cols, *(CPU_TILE if on_cpu else (n_rows, n_cols)))
    partial = rows_op.new_zeros(-(-n_cols // tile_c), n_rows)

    def pick(v: Tensor, apex_side: bool, r: slice, cs: slice) -> Tensor:
        return v[r] if apex_side == apex_rows else v[:, cs]

    # Largest x_t and y_t of each row / column tile: a per-tile bound on the NEAR floor, for one reduction.
    t_rows, t_cols = (apex_t, point_t) if apex_rows else (point_t, apex_t)
    row_max = [float(v.max()) for v in t_rows.flatten().split(tile_r)] if tiles else []
    col_max = [float(v.max()) for v in t_cols.flatten().split(tile_c)] if tiles else []

    def work(r: slice, cs: slice, scratch: dict) -> None:
        if "w" not in scratch:
            scratch["w"] = rows_op.new_empty(tile_r * tile_c)
            scratch["s"] = rows_op.new_empty(tile_r * tile_c)
        shape = (r.stop - r.start, cs.stop - cs.start)
        m = scratch["w"][: shape[0] * shape[1]].view(shape)
        den = scratch["s"][: shape[0] * shape[1]].view(shape)
        xt, yt = pick(apex_t, True, r, cs), pick(point_t, False, r, cs)
        torch.mm(rows_op[r], cols_op[cs].T, out=m)  # (x_t/|x|) num
        torch.addcmul(yt, m, pick(k, True, r, cs), out=den)  # W
        torch.addcmul(pick(neg_t2, True, r, cs), den, den, out=den)  # W^2 - x_t^2 = x_t^2 (w^2 - 1)
        # No clamps: a negative square or a cosine beyond ±1 fails these checks and is recomputed.
        floor = _near_floor(row_max[r.start // tile_r], col_max[cs.start // tile_c], c)
        near = bool(den.amin() < floor)
        cos = m.div_(den.sqrt_())
        lo, hi = (float(v) for v in torch.aminmax(cos))
        if near or not (lo >= -_EDGE_COS and hi <= _EDGE_COS):  # written so that NaN fails it
            ext = _resolve(cos, den, floor**0.5, xt, yt, (r, cs), apex_rows, apex.x, points.x, c)
        else:
            ext = cos.acos_()
        if hinge:
            ext.sub_(pick(aper, True, r, cs)).clamp_(min=0.0)
        torch.sum(ext, dim=1, out=partial[cs.start // tile_c, r])

    with torch.autocast(device_type=rows_op.device.type, enabled=False):
        run_tiles(tiles, work, threads=None if on_cpu else 1)
        mean = partial.sum(0) / max(n_cols, 1)
        if hinge:
            return mean
        return mean - (apex.aper if apex_rows else apex.aper.mean())


def _resolve(
    cos: Tensor,
    den: Tensor,
    den_floor: float,
    xt: Tensor,
    yt: Tensor,
    tile: tuple[slice, slice],
    apex_rows: bool,
    apex_x: Tensor,
    point_x: Tensor,
    c: float,
) -> Tensor:
    """acos of a tile's cosines, in place, with its ill-conditioned pairs taken from `exterior_angle`.

    Flagged pairs are few: rows holding one are found by three row reductions, candidates in those rows
    against the tile's bound `den_floor`, and the per-pair bound sorts out the candidates. NaN (from a
    negative square) fails every test.
    """
    bad_rows = ~((den.amin(1) >= den_floor) & (cos.amin(1) >= -_EDGE_COS) & (cos.amax(1) <= _EDGE_COS))
    rows = bad_rows.nonzero().flatten()
    d, cs = den[rows], cos[rows]
    i, j = (~((d >= den_floor) & (cs >= -_EDGE_COS) & (cs <= _EDGE_COS))).nonzero(as_tuple=True)
    i = rows[i]
    d, cs = den[i, j], cos[i, j]
    near = ~(d * d >= _near_floor(xt.expand_as(den)[i, j], yt.expand_as(den)[i, j], c))
    keep = near | ~((cs >= -_EDGE_COS) & (cs <= _EDGE_COS))
    i, j = i[keep], j[keep]
    ext = cos.acos_()
    rows, cols = i + tile[0].start, j + tile[1].start
    ai, pj = (rows, cols) if apex_rows else (cols, rows)
    for s in range(0, i.numel(), _FALLBACK_CHUNK):
        part = slice(s, s + _FALLBACK_CHUNK)
        ext[i[part], j[part]] = exterior_angle(apex_x[ai[part]], point_x[pj[part]], c)
    return ext
