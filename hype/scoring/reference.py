"""Reference sets S_i (images) and S_t (texts) for HYPE specificity. DESIGN §2.3.

Selection (HYPE §3.3): sort the pool by cos θ, take the top N pairs; score every pool image by its mean
entailment loss against those N texts and every pool text against those N images; the M highest-scoring
images and texts are S_i and S_t. N = M = 20,000 in the paper (values converge from ~3,000).

File format: HYPE's released `reference.pt` is `{"img": (M, n), "txt": (M, n)}` of tangent vectors
(before the exponential map). hype writes the same two tensors as safetensors, plus metadata, and reads
either form; `.pt` files only through `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hype.geometry import lorentz
from hype.io import AnyPath, atomic_path, local_file, storage
from hype.scoring.specificity import DEFAULT_BUDGET_ELEMS, image_specificity, text_specificity

Tensor = torch.Tensor
log = logging.getLogger(__name__)

DEFAULT_N = 20_000
DEFAULT_M = 20_000


class ReferenceError(ValueError):
    """A reference file or selection request that cannot be used."""


@dataclass
class ReferenceSet:
    """Tangent vectors of the reference images and texts (lifted with the scoring model's curvature)."""

    img: Tensor  # (M_i, n)
    txt: Tensor  # (M_t, n)
    meta: dict = field(default_factory=dict)

    def lifted(self, curv: float | Tensor) -> tuple[Tensor, Tensor]:
        """(S_i, S_t) as points on the hyperboloid."""
        return lorentz.exp_map0(self.img, curv), lorentz.exp_map0(self.txt, curv)

    def save(self, path: str | PathLike) -> AnyPath:
        tensors = {"img": self.img.float().contiguous().cpu(), "txt": self.txt.float().contiguous().cpu()}
        with atomic_path(path) as tmp:  # safetensors creates 0600 files; this gives the user's default mode
            save_file(tensors, str(tmp), metadata={"hype_reference": json.dumps(self.meta, sort_keys=True)})
        return storage.location(path)


def select_references(
    images: Tensor,
    texts: Tensor,
    cos_theta: Tensor,
    curv: float | Tensor,
    *,
    n_top: int = DEFAULT_N,
    m: int = DEFAULT_M,
    K: float = lorentz.DEFAULT_K,
    hinge: bool = True,
    budget_elems: int = DEFAULT_BUDGET_ELEMS,
) -> ReferenceSet:
    """The paper's two-step selection over a pool's MERU embeddings (space components).

    `hinge=True` scores candidates by the mean L_e = max(0, E), as the paper describes. N and M are
    reduced (with a warning) when the pool is smaller. Ties in cos θ and in the scores are broken by
    pool index, so the selection is deterministic.
    """
    pool = images.shape[0]
    if texts.shape[0] != pool or cos_theta.shape[0] != pool:
        raise ReferenceError(
            f"images ({images.shape[0]}), texts ({texts.shape[0]}) and cos θ ({cos_theta.shape[0]}) "
            "must describe the same pool"
        )
    if pool == 0:
        raise ReferenceError("cannot select references from an empty pool")
    if n_top < 1 or m < 1:
        raise ReferenceError(f"N and M must be >= 1, got N={n_top}, M={m}")
    if n_top > pool or m > pool:
        log.warning("pool of %d samples: reference sizes reduced from N=%d, M=%d", pool, n_top, m)
        n_top, m = min(n_top, pool), min(m, pool)
    top = _top_indices(cos_theta, n_top)
    img_scores = image_specificity(images, texts[top], curv, K=K, hinge=hinge, budget_elems=budget_elems)
    txt_scores = text_specificity(texts, images[top], curv, K=K, hinge=hinge, budget_elems=budget_elems)
    s_i, s_t = _top_indices(img_scores, m), _top_indices(txt_scores, m)
    meta = {"n_top": n_top, "m": m, "K": K, "hinge": hinge, "curv": float(curv), "pool": pool}
    return ReferenceSet(
        lorentz.log_map0(images[s_i], curv).float(),
        lorentz.log_map0(texts[s_t], curv).float(),
        meta | {"source": "selected"},
    )


def load_reference(path: str | PathLike, dim: int | None = None) -> ReferenceSet:
    """Read a reference file: hype's safetensors or HYPE's released `{"img", "txt"}` .pt (weights_only)."""
    if not storage.is_file(path):
        raise ReferenceError(f"{path}: reference file not found")
    with local_file(path) as local:
        return _read_reference(local, storage.location(path), dim)


def _read_reference(local: Path, path: AnyPath, dim: int | None) -> ReferenceSet:
    meta: dict = {"source": str(path)}
    if local.suffix == ".safetensors":
        try:
            data = load_file(str(local))
        except SafetensorError as e:
            raise ReferenceError(f"{path}: unreadable safetensors file ({e})") from e
    else:
        from hype.io.weights import require_safe_torch_load

        require_safe_torch_load(path)  # before the try: its message says what to upgrade
        try:
            data = torch.load(local, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any refusal means we will not read it
            raise ReferenceError(
                f"{path}: not loadable with torch.load(weights_only=True) ({type(e).__name__}); a reference "
                "file must hold only tensors {'img': (M, n), 'txt': (M, n)}"
            ) from e
    if not isinstance(data, dict) or not {"img", "txt"} <= set(data):
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ReferenceError(f"{path}: expected a dict with 'img' and 'txt' tensors, found {keys}")
    img, txt = data["img"], data["txt"]
    for name, t in (("img", img), ("txt", txt)):
        if not isinstance(t, Tensor) or t.ndim != 2 or t.shape[0] == 0:
            raise ReferenceError(f"{path}: '{name}' must be a non-empty (M, n) tensor")
        if not torch.isfinite(t).all():
            raise ReferenceError(f"{path}: '{name}' contains NaN or inf")
    if img.shape[1] != txt.shape[1] or (dim is not None and img.shape[1] != dim):
        want = dim if dim is not None else img.shape[1]
        raise ReferenceError(
            f"{path}: embedding width img {img.shape[1]} / txt {txt.shape[1]} does not match the "
            f"scoring model's {want}; the reference set must come from the same MERU model"
        )
    return ReferenceSet(img.float(), txt.float(), meta)


def _top_indices(scores: Tensor, k: int) -> Tensor:
    # Stable descending sort: equal scores keep pool order.
    return torch.sort(scores, descending=True, stable=True).indices[:k]
