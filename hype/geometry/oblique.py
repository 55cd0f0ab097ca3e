"""The oblique manifold Ob(num_spheres, sphere_dim): a product of unit spheres. DESIGN §2.2.

An embedding of width n = num_spheres * sphere_dim is viewed as num_spheres sub-vectors of sphere_dim,
each L2-normalized. Normalized embeddings stay flattened, so the summed inner product
Σ_k <u_k, v_k> ∈ [-k, k] is a plain dot product and the pairwise form one matmul.
"""

from __future__ import annotations

import torch

from hype.geometry import sphere
from hype.geometry._numerics import Tensor, acos_resolved, angle_from, geometry_op, safe_norm, safe_sqrt


def _split(x: Tensor, num_spheres: int) -> Tensor:
    n = x.shape[-1]
    if num_spheres < 1 or n % num_spheres:
        raise ValueError(
            f"embedding width {n} is not divisible by num_spheres={num_spheres}; "
            "choose num_spheres so that num_spheres * sphere_dim equals the embedding width"
        )
    return x.reshape(*x.shape[:-1], num_spheres, n // num_spheres)


@geometry_op
def normalize(x: Tensor, num_spheres: int) -> Tensor:
    """L2-normalize each of the num_spheres sub-vectors; returns the flattened (..., n) tensor."""
    return sphere.normalize(_split(x, num_spheres)).reshape(x.shape)


@geometry_op
def inner(u: Tensor, v: Tensor) -> Tensor:
    """Row-wise Σ_k <u_k, v_k> of already-normalized embeddings."""
    return (u * v).sum(-1)


@geometry_op
def pairwise_inner(u: Tensor, v: Tensor) -> Tensor:
    return u @ v.T


@geometry_op
def geodesic(u: Tensor, v: Tensor, num_spheres: int) -> Tensor:
    """Row-wise product-manifold geodesic sqrt(Σ_k θ_k^2) of normalized embeddings.

    θ_k = 2 atan2(|u_k - v_k|, |u_k + v_k|): accurate for near-identical sub-vectors, where arccos(<u_k, v_k>)
    resolves only sqrt(eps); π/2 for a zero sub-vector, like the pairwise form.
    """
    us, vs = _split(u, num_spheres), _split(v, num_spheres)
    return safe_sqrt(((2.0 * angle_from(safe_norm(us - vs), safe_norm(us + vs))) ** 2).sum(-1))


@geometry_op
def pairwise_geodesic(u: Tensor, v: Tensor, num_spheres: int) -> Tensor:
    """Geodesic for all pairs, (N, M); memory N * M * num_spheres, so call it on chunks."""
    cos = torch.einsum("ikm,jkm->ijk", _split(u, num_spheres), _split(v, num_spheres))
    return safe_sqrt((acos_resolved(cos) ** 2).sum(-1))
