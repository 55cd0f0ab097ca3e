"""HYPE specificity ε_i and ε_t against reference sets, streamed in chunks. DESIGN §2.3.

    ε_t(x) = mean_{y ∈ S_i} E(x -> y)      a pool text x as the apex, reference images as points
    ε_i(y) = mean_{x ∈ S_t} E(x -> y)      reference texts as apexes, a pool image y as the point

E is the raw entailment energy ext - aper (the released code's convention; larger = more specific), or
the paper's hinged L_e = max(0, E) with `hinge=True`. Embeddings are MERU space components.

Cost: a dense (pool x M) computation. The pool is processed in chunks sized so a chunk's intermediates
stay under `budget_elems`, so peak memory does not depend on the pool size: on GPU the kernel holds
(rows x M) blocks; on CPU it works in fixed cache-sized tiles (`lorentz.CPU_TILE`) and a chunk only
holds per-row operands and partial sums, so chunks are longer and the tiles' threads sync less often.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hype.geometry import lorentz

Tensor = torch.Tensor

DEFAULT_BUDGET_ELEMS = 1 << 24  # 16M elements: ~64 MB per fp32 intermediate


def chunk_rows(n_refs: int, budget_elems: int = DEFAULT_BUDGET_ELEMS) -> int:
    """Pool rows per chunk so that rows x n_refs stays within the element budget."""
    return max(1, budget_elems // max(1, n_refs))


def _rows_per_chunk(x: Tensor, n_refs: int, budget_elems: int) -> int:
    if x.device.type != "cpu":
        return chunk_rows(n_refs, budget_elems)
    # per row: the matmul operand (n + 1) and one partial sum per column tile
    return chunk_rows(x.shape[-1] + 1 + -(-n_refs // lorentz.CPU_TILE[1]), budget_elems)


def _chunks(x: Tensor, rows: int) -> Iterator[Tensor]:
    for start in range(0, x.shape[0], rows):
        yield x[start : start + rows]


@torch.no_grad()
def text_specificity(
    texts: Tensor,
    ref_images: Tensor,
    curv: float | Tensor,
    *,
    K: float = lorentz.DEFAULT_K,
    hinge: bool = False,
    budget_elems: int = DEFAULT_BUDGET_ELEMS,
) -> Tensor:
    """ε_t for every text (N,) against reference images (M, n): mean over M of E(text -> image)."""
    ref = lorentz.prepare(ref_images.to(texts.device), curv, K)
    rows = _rows_per_chunk(texts, ref.x.shape[0], budget_elems)
    out = [
        lorentz.mean_entailment_energy(lorentz.prepare(chunk, curv, K), ref, curv, dim=1, hinge=hinge)
        for chunk in _chunks(texts, rows)
    ]
    return torch.cat(out) if out else texts.new_zeros(0, dtype=torch.float32)


@torch.no_grad()
def image_specificity(
    images: Tensor,
    ref_texts: Tensor,
    curv: float | Tensor,
    *,
    K: float = lorentz.DEFAULT_K,
    hinge: bool = False,
    budget_elems: int = DEFAULT_BUDGET_ELEMS,
) -> Tensor:
    """ε_i for every image (N,) against reference texts (M, n): mean over M of E(text -> image)."""
    ref = lorentz.prepare(ref_texts.to(images.device), curv, K)
    rows = _rows_per_chunk(images, ref.x.shape[0], budget_elems)
    out = [
        lorentz.mean_entailment_energy(ref, lorentz.prepare(chunk, curv, K), curv, dim=0, hinge=hinge)
        for chunk in _chunks(images, rows)
    ]
    return torch.cat(out) if out else images.new_zeros(0, dtype=torch.float32)
