"""Accuracy of the fp32 geometry against a high-precision reference, next to the authors' fp32 forms.

For every function and input regime it prints the max and median error of `hype.geometry` in fp32 and of
the authors' formula in fp32 on the same inputs (relative for distances, absolute radians for angles),
and their ratio (ours / authors, max over max; <= 1 means at least as accurate). The reference is
`tests/reference.py`'s mpmath arithmetic at 50 digits on the exact fp32 inputs, with the exterior angles
taken through the law of cosines on distances, a different route than the code under test.

Authors' forms, restated (not imported; their repositories are not dependencies):
- MERU / HYPE distance: acosh of c (x_t y_t - x·y), clamped below at 1 + 1e-8, over sqrt(c).
- MERU `oxy_angle` / HYPE `entailment`: with L = c <x,y>_L, acos of (y_t + L x_t) / (|x| sqrt(max(L^2 - 1,
  1e-8)) + 1e-8), the argument clamped to [-1 + 1e-8, 1 - 1e-8] (which is [-1, 1] in fp32).
- MERU half aperture: asin of 2K / (sqrt(c) |x| + 1e-8), clamped the same way.
- EuCLIP: pairwise Euclidean distance sqrt(|x|^2 - 2 x·y + |y|^2); elliptic acos(x̂·ŷ) (unclamped); Euclidean
  exterior angle acos((y - x)·x / (|y - x| |x|)).
A NaN from an authors' form counts as an infinite error (shown as `nan`).

    python bench/geometry_accuracy.py            # about 10 s; the table is Markdown for bench/RESULTS.md
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import mp_aper, mp_dist, mp_euc_dist, mp_euc_ext, mp_ext, mp_sphere_geodesic  # noqa: E402

from hype.geometry import euclidean, lorentz, sphere  # noqa: E402

F32 = torch.float32


# ---------------------------------------------------------------- the authors' forms, in fp32
def _time(x: torch.Tensor, c: float) -> torch.Tensor:
    return torch.sqrt(1 / c + (x * x).sum(-1))


def meru_distance(x, y, c):
    w = -c * ((x * y).sum(-1) - _time(x, c) * _time(y, c))
    return torch.acosh(torch.clamp(w, min=1 + 1e-8)) / c**0.5


def meru_pairwise_distance(x, y, c):
    w = -c * (x @ y.T - _time(x, c)[:, None] * _time(y, c)[None, :])
    return torch.acosh(torch.clamp(w, min=1 + 1e-8)) / c**0.5


def meru_oxy_angle(x, y, c):
    xt, yt = _time(x, c), _time(y, c)
    L = c * ((x * y).sum(-1) - xt * yt)
    den = x.norm(dim=-1) * torch.sqrt(torch.clamp(L * L - 1, min=1e-8)) + 1e-8
    return torch.acos(torch.clamp((yt + L * xt) / den, -1 + 1e-8, 1 - 1e-8))


def hype_pairwise_ext(x, y, c):
    xt, yt = _time(x, c)[:, None], _time(y, c)[None, :]
    L = c * (x @ y.T - xt * yt)
    den = x.norm(dim=-1)[:, None] * torch.sqrt(torch.clamp(L * L - 1, min=1e-8)) + 1e-8
    return torch.acos(torch.clamp((yt + L * xt) / den, -1 + 1e-8, 1 - 1e-8))


def meru_aper(x, c, K):
    return torch.asin(torch.clamp(2 * K / (x.norm(dim=-1) * c**0.5 + 1e-8), -1 + 1e-8, 1 - 1e-8))


def euclip_pairwise_distance(x, y):
    return ((x * x).sum(-1)[:, None] - 2 * x @ y.T + (y * y).sum(-1)[None, :]).sqrt()


def euclip_elliptic(x, y):
    xn, yn = x / x.norm(dim=-1, keepdim=True), y / y.norm(dim=-1, keepdim=True)
    return torch.acos(xn @ yn.T)


def euclip_ext(x, y):
    d = y - x
    return torch.acos((d * x).sum(-1) / (d.norm(dim=-1) * x.norm(dim=-1)))


# ---------------------------------------------------------------- input regimes (fp32 values)
def _unit(rng, n, dim):
    v = rng.normal(size=(n, dim))
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def regimes(n: int, dim: int, seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Pairs (x_i, y_i) rounded to fp32, as float64 arrays holding the exact fp32 values."""
    rng = np.random.default_rng(seed)
    radius = lambda lo, hi: np.exp(rng.uniform(np.log(lo), np.log(hi), size=(n, 1)))  # noqa: E731
    out = {
        # Like trained MERU embeddings: norms of a few units, independent directions.
        "independent": (_unit(rng, n, dim) * radius(0.3, 3), _unit(rng, n, dim) * radius(0.3, 3)),
        # Far apart with unequal norms: a point near the origin and one at |y| = 1e2 .. 1e4.
        "far, unequal norms": (_unit(rng, n, dim) * radius(0.3, 3), _unit(rng, n, dim) * radius(1e2, 1e4)),
    }
    # Inside the cone: y beyond x on nearly the same ray (small perpendicular offset), ext < aper.
    x = _unit(rng, n, dim) * radius(0.5, 3)
    perp = rng.normal(size=(n, dim))
    perp -= (perp * x).sum(-1, keepdims=True) * x / (x * x).sum(-1, keepdims=True)
    perp /= np.linalg.norm(perp, axis=-1, keepdims=True)
    lam = radius(1.2, 20)
    out["inside the cone"] = (
        x,
        lam * x + perp * radius(1e-4, 1e-1) * lam * np.linalg.norm(x, axis=-1)[:, None],
    )
    # Near-identical: y = x + a tiny offset (|y - x| / |x| = 1e-6 .. 1e-2), moderate and huge norms.
    for name, (lo, hi) in {"near-identical": (0.3, 3), "near-identical, |x| ~ 1e4": (3e3, 3e4)}.items():
        x = _unit(rng, n, dim) * radius(lo, hi)
        off = _unit(rng, n, dim) * radius(1e-6, 1e-2) * np.linalg.norm(x, axis=-1)[:, None]
        out[name] = (x, x + off)
    return {
        k: (a.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64))
        for k, (a, b) in out.items()
    }


# ---------------------------------------------------------------- measurement
def _err(got: torch.Tensor, ref: np.ndarray, relative: bool) -> np.ndarray:
    g = got.detach().double().numpy()
    e = np.abs(g - ref)
    if relative:
        e = e / np.maximum(np.abs(ref), 1e-300)
    return np.where(np.isfinite(g), e, np.inf)


def _fmt(v: float) -> str:
    return "nan" if not np.isfinite(v) else f"{v:.1e}"


def run(n: int, dim: int, c: float, K_h: float, K_e: float) -> list[tuple]:
    rows = []
    for name, (x64, y64) in regimes(n, dim).items():
        x, y = torch.tensor(x64, dtype=F32), torch.tensor(y64, dtype=F32)
        ref_d = mp_dist(x64, y64, c)
        ref_ext = mp_ext(x64, y64, c)
        ref_ed = mp_euc_dist(x64, y64)
        ref_eext = mp_euc_ext(x64, y64)
        ref_geo = mp_sphere_geodesic(x64, y64)
        cases = [
            ("lorentz.distance", True, lorentz.distance(x, y, c), meru_distance(x, y, c), ref_d),
            (
                "lorentz.pairwise_distance",
                True,
                lorentz.pairwise_distance(x, y, c).diagonal(),
                meru_pairwise_distance(x, y, c).diagonal(),
                ref_d,
            ),
            (
                "lorentz.exterior_angle",
                False,
                lorentz.exterior_angle(x, y, c),
                meru_oxy_angle(x, y, c),
                ref_ext,
            ),
            (
                "lorentz.pairwise_exterior_angle",
                False,
                lorentz.pairwise_exterior_angle(x, y, c).diagonal(),
                hype_pairwise_ext(x, y, c).diagonal(),
                ref_ext,
            ),
            (
                "lorentz.mean_entailment_energy (+aper)",
                False,
                _mean_path_ext(x, y, c, K_h),
                hype_pairwise_ext(x, y, c).diagonal(),
                ref_ext,
            ),
            ("euclidean.distance", True, euclidean.distance(x, y), (x - y).norm(dim=-1), ref_ed),
            (
                "euclidean.pairwise_distance",
                True,
                euclidean.pairwise_distance(x, y).diagonal(),
                euclip_pairwise_distance(x, y).diagonal(),
                ref_ed,
            ),
            ("euclidean.exterior_angle", False, euclidean.exterior_angle(x, y), euclip_ext(x, y), ref_eext),
            (
                "sphere.pairwise_geodesic",
                False,
                sphere.pairwise_geodesic(x, y).diagonal(),
                euclip_elliptic(x, y).diagonal(),
                ref_geo,
            ),
            ("sphere.geodesic", False, sphere.geodesic(x, y), euclip_elliptic(x, y).diagonal(), ref_geo),
        ]
        if name == "independent":
            ref_aper = mp_aper(x64, c, K_h)
            cases.append(
                (
                    "lorentz.half_aperture",
                    False,
                    lorentz.half_aperture(x, c, K_h),
                    meru_aper(x, c, K_h),
                    ref_aper,
                )
            )
        for fn, relative, ours, theirs, ref in cases:
            eo, et = _err(ours, ref, relative), _err(theirs, ref, relative)
            rows.append(
                (fn, name, "rel" if relative else "rad", eo.max(), np.median(eo), et.max(), np.median(et))
            )
    return rows


def _mean_path_ext(x: torch.Tensor, y: torch.Tensor, c: float, K: float) -> torch.Tensor:
    """The exterior angle as the scoring path computes it: mean_entailment_energy on one pair at a time."""
    out = []
    for i in range(x.shape[0]):
        a, p = lorentz.prepare(x[i : i + 1], c, K), lorentz.prepare(y[i : i + 1], c, K)
        out.append(lorentz.mean_entailment_energy(a, p, c, dim=1) + a.aper)
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="pairs per regime")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--curv", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = run(args.n, args.dim, args.curv, lorentz.DEFAULT_K, euclidean.DEFAULT_K)
    print(f"fp32, {args.n} pairs per regime, dim {args.dim}, c = {args.curv}; error vs 50-digit reference\n")
    print("| function | regime | unit | ours max | ours median | authors max | authors median | max ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for fn, regime, unit, om, omed, tm, tmed in rows:
        ratio = om / tm if np.isfinite(tm) and tm > 0 else (0.0 if np.isfinite(om) else math.nan)
        cells = [fn, regime, unit, _fmt(om), _fmt(omed), _fmt(tm), _fmt(tmed), f"{ratio:.2f}"]
        print("| " + " | ".join(cells) + " |")
    print(f"\n({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
