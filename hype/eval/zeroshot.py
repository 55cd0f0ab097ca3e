"""Geometry-aware zero-shot classification, retrieval and WinoGAViL scoring.

Every ranking goes through the model's own geometry: class embeddings are the geometry's prompt ensemble
(`model.geometry.ensemble`: normalize-mean-normalize on spheres, tangent-space mean in hyperbolic space,
the plain centroid in Euclidean space), and scores are `model.similarity` (cos θ, -d_L, -|x-y|², ...),
where larger means more similar for every geometry. Only top-k indices leave the device, so memory does
not grow with the number of classes × samples, and retrieval scores images against captions in tiles
while keeping a running top-k, so it never holds the N_text × N_image matrix.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hype.eval.metrics import jaccard, select_top, winogavil_prompt
from hype.eval.readers import ReadStats

Tensor = torch.Tensor


@dataclass
class EncodeOptions:
    device: torch.device
    batch_size: int = 64
    amp: bool = False  # bf16 autocast in the towers (the geometry always runs in fp32)

    def autocast(self):
        if not self.amp:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)


@torch.no_grad()
def encode_texts(model, texts: Sequence[str], opts: EncodeOptions) -> Tensor:
    """Embeddings (T, n) on `opts.device` of `texts`, in batches."""
    tokenizer = model.tokenizer()
    out = []
    for start in range(0, len(texts), max(1, opts.batch_size)):
        tokens = tokenizer(list(texts[start : start + opts.batch_size])).to(opts.device)
        with opts.autocast():
            out.append(model.encode_text(tokens).float())
    return torch.cat(out) if out else torch.empty(0, model.config.embed_dim, device=opts.device)


@torch.no_grad()
def encode_images(model, images: Tensor, opts: EncodeOptions) -> Tensor:
    images = images.to(opts.device, non_blocking=True)
    with opts.autocast():
        return model.encode_image(images).float()


@torch.no_grad()
def class_embeddings(
    model, classnames: Sequence[str], templates: Sequence[str], opts: EncodeOptions
) -> Tensor:
    """One embedding per class (C, n): the geometry's ensemble of the class's prompt embeddings."""
    # Prompts are short: encode them in larger batches than images (CPU matmuls like wide batches).
    text_opts = EncodeOptions(opts.device, max(256, 4 * opts.batch_size), opts.amp)
    per_chunk = max(1, text_opts.batch_size // len(templates))  # classes whose prompts encode together
    out = []
    for start in range(0, len(classnames), per_chunk):
        chunk = classnames[start : start + per_chunk]
        prompts = [t.format(c=c) for c in chunk for t in templates]
        emb = encode_texts(model, prompts, text_opts)
        emb = emb.view(len(chunk), len(templates), -1)
        out.append(model.geometry.ensemble(emb, curv=model.curv))
    return torch.cat(out)


def _progress(progress, n: int) -> None:
    if progress is not None:
        progress.update(n)


@dataclass
class ClassificationOutput:
    topk: list[np.ndarray]  # per head: (N, k_head) class indices, best first
    labels: np.ndarray  # (N,) (-1 where the task has no .cls)
    meta: np.ndarray | None  # (N, F)
    stats: ReadStats


@torch.no_grad()
def run_classification(
    model,
    batches: Iterable[dict],
    heads: Sequence[Tensor],
    ks: Sequence[int],
    opts: EncodeOptions,
    progress=None,
) -> ClassificationOutput:
    """Top-k classes of every image for each head (a head is a (C, n) class embedding matrix)."""
    topk: list[list[np.ndarray]] = [[] for _ in heads]
    labels, meta, stats = [], [], ReadStats()
    for batch in batches:
        stats.merge(batch["stats"])
        if batch["images"] is None:
            continue
        emb = encode_images(model, batch["images"], opts)
        for h, (head, k) in enumerate(zip(heads, ks, strict=True)):
            scores = model.similarity(emb, head)
            topk[h].append(scores.topk(k, dim=1).indices.cpu().numpy())
        labels.append(batch["labels"].numpy())
        if batch["meta"] is not None:
            meta.append(batch["meta"])
        _progress(progress, len(emb))
    return ClassificationOutput(
        topk=[np.concatenate(t) if t else np.zeros((0, k), np.int64) for t, k in zip(topk, ks, strict=True)],
        labels=np.concatenate(labels) if labels else np.zeros(0, np.int64),
        meta=np.concatenate(meta) if meta else None,
        stats=stats,
    )


@dataclass
class RetrievalOutput:
    images_per_text: np.ndarray  # (T, k)
    texts_per_image: np.ndarray  # (I, k)
    text_to_image: np.ndarray  # (T,)
    stats: ReadStats


@torch.no_grad()
def run_retrieval(
    model, batches: Iterable[dict], opts: EncodeOptions, k: int = 10, progress=None, tile: int = 4096
) -> RetrievalOutput:
    """Embed every image and its captions, then rank both ways with a running top-k over tiles."""
    image_emb, text_emb, text_to_image, stats = [], [], [], ReadStats()
    n_images = 0
    for batch in batches:
        stats.merge(batch["stats"])
        if batch["images"] is None:
            continue
        image_emb.append(encode_images(model, batch["images"], opts))
        captions = [c for caps in batch["captions"] for c in caps]
        text_emb.append(encode_texts(model, captions, opts))
        text_to_image += [n_images + i for i, caps in enumerate(batch["captions"]) for _ in caps]
        n_images += len(batch["captions"])
        _progress(progress, len(batch["captions"]))
    if not n_images:
        empty = np.zeros((0, k), np.int64)
        return RetrievalOutput(empty, empty, np.zeros(0, np.int64), stats)
    images, texts = torch.cat(image_emb), torch.cat(text_emb)
    sim = model.similarity
    return RetrievalOutput(
        images_per_text=streaming_topk(lambda q, c: sim(c, q).T, texts, images, k, tile),
        texts_per_image=streaming_topk(lambda q, c: sim(q, c), images, texts, k, tile),
        text_to_image=np.asarray(text_to_image, np.int64),
        stats=stats,
    )


def streaming_topk(
    score: Callable[[Tensor, Tensor], Tensor], queries: Tensor, candidates: Tensor, k: int, tile: int = 4096
) -> np.ndarray:
    """Indices (Q, min(k, C)) of the best candidates of each query, best first, where
    `score(queries_tile, candidates_tile)` gives (q, c) scores. Memory O(tile × (tile + k))."""
    k = min(k, len(candidates))
    out = []
    for qs in range(0, len(queries), tile):
        q = queries[qs : qs + tile]
        best_val = torch.full((len(q), 0), float("-inf"), device=q.device)
        best_idx = torch.zeros((len(q), 0), dtype=torch.int64, device=q.device)
        for cs in range(0, len(candidates), tile):
            s = score(q, candidates[cs : cs + tile]).float()
            val = torch.cat([best_val, s], dim=1)
            idx = torch.cat(
                [best_idx, torch.arange(cs, cs + s.shape[1], device=q.device).expand(len(q), -1)], 1
            )
            best_val, pos = val.topk(min(k, val.shape[1]), dim=1)
            best_idx = idx.gather(1, pos)
        out.append(best_idx.cpu().numpy())
    return np.concatenate(out) if out else np.zeros((0, k), np.int64)


@dataclass
class WinoOutput:
    scores: list[float]  # Jaccard of each usable item
    num_candidates: list[int]
    stats: ReadStats


@torch.no_grad()
def run_winogavil(model, batches: Iterable[list[dict]], opts: EncodeOptions, progress=None) -> WinoOutput:
    """Per item: embed the cue prompt and the candidates, choose the |associations| most similar
    candidates, and score the choice with the Jaccard index against the true associations."""
    scores, sizes, stats = [], [], ReadStats()
    for batch in batches:
        _progress(progress, len(batch))
        usable = []
        for entry in batch:
            if entry["error"] is not None:
                stats.skip(entry["error"])
            else:
                usable.append(entry)
        if not usable:
            continue
        image_emb = encode_images(model, torch.cat([e["images"] for e in usable]), opts)
        cue_emb = encode_texts(model, [winogavil_prompt(e["item"].cue) for e in usable], opts)
        start = 0
        for i, entry in enumerate(usable):
            item = entry["item"]
            n = len(item.candidates)
            sims = model.similarity(image_emb[start : start + n], cue_emb[i : i + 1])[:, 0].cpu().numpy()
            start += n
            truth = np.isin(np.asarray(item.candidates), np.asarray(item.associations))
            scores.append(jaccard(truth, select_top(sims, int(truth.sum()))))
            sizes.append(n)
            stats.num_samples += 1
    return WinoOutput(scores, sizes, stats)
