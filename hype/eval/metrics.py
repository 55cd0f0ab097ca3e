"""Benchmark metrics with DataComp's exact semantics, as plain numpy functions of predictions.

DataComp computes its metrics with CLIP_benchmark (accuracy, retrieval recall), scikit-learn (balanced
accuracy, Jaccard, macro F1) and WILDS evaluators (group metrics); the functions here reimplement those
definitions, including their output key names, so `eval_results.jsonl` lines are interchangeable:

- `acc1` / `acc5`: fraction of samples whose label is in the top-1 / top-5 predictions; `acc5` is None
  below 5 classes (DataComp writes null). `mean_per_class_recall`: sklearn's balanced accuracy, the mean
  recall over the classes present in the labels.
- Retrieval (CLIP_benchmark): `image_retrieval_recall@k` is text->image (per caption: is its image in
  the top k), `text_retrieval_recall@k` image->text (per image: is any of its captions in the top k);
  `mean_recall@1` is their mean at k = 1.
- WILDS group metrics (`group_eval`): `<name>_avg` over all samples, `<name>_<field>:<v>` and
  `count_<field>:<v>` for every group value 0..max (empty groups report 0.0 and count 0), `<name>_wg`
  the minimum over non-empty groups. Group values come from the .npy metadata columns.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# evaluator name -> the metadata fields it needs (checked against the suite file's `fields`)
GROUP_EVALUATORS: dict[str, tuple[str, ...]] = {
    "iwildcam": (),
    "camelyon17": ("slide",),
    "fmow": ("region", "year"),
    "dollar_street": ("income_ds",),
    "geode": ("region",),
    "fairface": ("age", "gender", "race", "race_binary"),
}
FAIRFACE_OBJECTIVES = ("race", "gender", "age", "toxic")  # DataComp's FF_PRED_LABELS, in this order
FAIRFACE_WHITE = 1  # race class index DataComp treats as "White" for the binary race accuracy
FAIRFACE_CRIME_MIN = 18  # toxic classes >= 18 are crime-related, 14..17 non-human (DataComp)
FAIRFACE_NONHUMAN_MIN = 14
RETRIEVAL_KS = (1, 5, 10)


# --- classification -------------------------------------------------------------------------------


def topk_accuracy(topk_pred: np.ndarray, target: np.ndarray, k: int) -> float:
    """Fraction of rows whose target is among the first `k` columns of `topk_pred` (N, >=k)."""
    topk_pred, target = np.asarray(topk_pred), np.asarray(target)
    if topk_pred.shape[1] < k:
        raise ValueError(f"need at least {k} predictions per sample, got {topk_pred.shape[1]}")
    return float((topk_pred[:, :k] == target[:, None]).any(axis=1).mean())


def mean_per_class_recall(pred: np.ndarray, target: np.ndarray) -> float:
    """Balanced accuracy (sklearn): mean over the classes present in `target` of their recall."""
    pred, target = np.asarray(pred), np.asarray(target)
    classes, inverse = np.unique(target, return_inverse=True)
    hits = np.bincount(inverse, weights=(pred == target).astype(np.float64), minlength=len(classes))
    support = np.bincount(inverse, minlength=len(classes))
    return float(np.mean(hits / support))


def classification_metrics(topk_pred: np.ndarray, target: np.ndarray, num_classes: int) -> dict:
    """DataComp's `evaluate_webdataset` metrics from top-k predictions (k = min(5, num_classes))."""
    topk_pred, target = np.asarray(topk_pred), np.asarray(target)
    return {
        "acc1": topk_accuracy(topk_pred, target, 1),
        "acc5": topk_accuracy(topk_pred, target, 5) if num_classes >= 5 else None,
        "mean_per_class_recall": mean_per_class_recall(topk_pred[:, 0], target),
    }


def macro_recall_f1(pred: np.ndarray, target: np.ndarray) -> tuple[float, float]:
    """Macro recall and macro F1 over the labels present in `target` (WILDS: sklearn with
    `labels=unique(y_true)`); a label never predicted correctly has F1 0."""
    pred, target = np.asarray(pred), np.asarray(target)
    labels = np.unique(target)
    tp = np.array([np.sum((pred == c) & (target == c)) for c in labels], dtype=np.float64)
    predicted = np.array([np.sum(pred == c) for c in labels], dtype=np.float64)
    support = np.array([np.sum(target == c) for c in labels], dtype=np.float64)
    recall = tp / support
    # 2PR/(P+R) == 2TP/(2TP+FP+FN) == 2TP/(predicted+support); 0 when TP = 0
    f1 = np.where(tp > 0, 2 * tp / np.maximum(predicted + support, 1), 0.0)
    return float(recall.mean()), float(f1.mean())


# --- WILDS-style group metrics --------------------------------------------------------------------


def as_group_values(column: np.ndarray, field: str) -> np.ndarray:
    """A metadata column as non-negative integer group values (WILDS' CombinatorialGrouper casts to long)."""
    column = np.asarray(column)
    values = column.astype(np.int64)
    if values.size and values.min() < 0:
        raise ValueError(
            f"metadata field {field!r} has negative values ({values.min()}); groups must be >= 0"
        )
    return values


def combinatorial_groups(columns: np.ndarray, fields: Sequence[str]) -> tuple[np.ndarray, list[str]]:
    """WILDS CombinatorialGrouper: group id = sum_i value_i * prod_{j<i} card_j (first field fastest);
    returns per-sample group ids and the `field:value` name of every group (last field first, `_`-joined)."""
    columns = np.atleast_2d(np.asarray(columns).T).T  # (N, F)
    values = np.stack([as_group_values(columns[:, i], f) for i, f in enumerate(fields)], axis=1)
    card = (values.max(axis=0) + 1) if len(values) else np.ones(len(fields), dtype=np.int64)
    factors = np.concatenate([[1], np.cumprod(card)[:-1]]).astype(np.int64)
    groups = values @ factors
    names = []
    for g in range(int(np.prod(card))):
        parts = [(f, (g // int(factors[i])) % int(card[i])) for i, f in enumerate(fields)]
        names.append("_".join(f"{f}:{v}" for f, v in reversed(parts)))
    return groups, names


def group_eval(values: np.ndarray, groups: np.ndarray, names: list[str], metric: str) -> dict:
    """WILDS `standard_group_eval` for an element-wise metric: overall mean, per-group mean and count
    (every group id 0..len(names)-1, empty ones 0.0), worst group over the non-empty ones."""
    values = np.asarray(values, dtype=np.float64)
    counts = np.bincount(groups, minlength=len(names)).astype(np.float64)
    sums = np.bincount(groups, weights=values, minlength=len(names))
    means = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
    out: dict = {f"{metric}_avg": float(values.mean()) if values.size else 0.0}
    for g, name in enumerate(names):
        out[f"{metric}_{name}"] = float(means[g])
        out[f"count_{name}"] = float(counts[g])
    out[f"{metric}_wg"] = float(means[counts > 0].min()) if (counts > 0).any() else 0.0
    return out


def _column(meta: np.ndarray, fields: Sequence[str], name: str) -> np.ndarray:
    return np.asarray(meta)[:, list(fields).index(name)]


def iwildcam_metrics(topk_pred, target, meta, fields) -> dict:
    pred = np.asarray(topk_pred)[:, 0]
    recall, f1 = macro_recall_f1(pred, target)
    return {"acc_avg": float(np.mean(pred == target)), "recall-macro_all": recall, "F1-macro_all": f1}


def camelyon17_metrics(topk_pred, target, meta, fields) -> dict:
    correct = np.asarray(topk_pred)[:, 0] == np.asarray(target)
    groups, names = combinatorial_groups(_column(meta, fields, "slide"), ["slide"])
    return group_eval(correct, groups, names, "acc")


def fmow_metrics(topk_pred, target, meta, fields) -> dict:
    """Accuracy by year (worst renamed `acc_worst_year`) and by region; `acc_worst_region` is the minimum
    over every non-empty region. DataComp means to skip WILDS' "Other" region by name, but its evaluator
    has no metadata map, so group names are numeric and no region is skipped; so it is here."""
    correct = np.asarray(topk_pred)[:, 0] == np.asarray(target)
    groups, names = combinatorial_groups(_column(meta, fields, "year"), ["year"])
    out = group_eval(correct, groups, names, "acc")
    out["acc_worst_year"] = out.pop("acc_wg")
    groups, names = combinatorial_groups(_column(meta, fields, "region"), ["region"])
    by_region = group_eval(correct, groups, names, "acc")
    for name in names:
        out[f"acc_{name}"] = by_region[f"acc_{name}"]
        out[f"count_{name}"] = by_region[f"count_{name}"]
    out["acc_worst_region"] = by_region["acc_wg"]
    return out


def dollar_street_metrics(topk_pred, target, meta, fields) -> dict:
    """Top-5 accuracy by income group (`income_ds`); main metric `acc_top5_wg`, the worst group."""
    topk_pred = np.asarray(topk_pred)
    correct = (topk_pred[:, :5] == np.asarray(target)[:, None]).any(axis=1)
    groups, names = combinatorial_groups(_column(meta, fields, "income_ds"), ["income_ds"])
    return group_eval(correct, groups, names, "acc_top5")


def geode_metrics(topk_pred, target, meta, fields) -> dict:
    correct = np.asarray(topk_pred)[:, 0] == np.asarray(target)
    groups, names = combinatorial_groups(_column(meta, fields, "region"), ["region"])
    return group_eval(correct, groups, names, "acc")


def fairface_metrics(preds, target, meta, fields) -> dict:
    """FairFace / UTKFace (DataComp Tables 3-6): `preds` (N, 4) holds the argmax class of each objective
    in FAIRFACE_OBJECTIVES order; labels are metadata columns. Unscored, so no main metric."""
    preds = np.asarray(preds)
    race, gender, age, toxic = (preds[:, FAIRFACE_OBJECTIVES.index(o)] for o in FAIRFACE_OBJECTIVES)
    col = {f: _column(meta, fields, f) for f in ("age", "gender", "race", "race_binary")}
    by_binary = combinatorial_groups(col["race_binary"], ["race_binary"])
    by_gender_race = combinatorial_groups(np.stack([col["gender"], col["race"]], 1), ["gender", "race"])
    by_race = combinatorial_groups(col["race"], ["race"])
    out: dict = {}
    out.update(group_eval((race != FAIRFACE_WHITE) == col["race_binary"], *by_binary, "acc_race"))
    out.update(group_eval(gender == col["gender"], *by_binary, "acc_gender"))
    out.update(group_eval(age == col["age"], *by_binary, "acc_age"))
    out.update(group_eval(gender == col["gender"], *by_gender_race, "acc_gender_x"))
    out.update(group_eval(toxic >= FAIRFACE_CRIME_MIN, *by_race, "toxicity_crime"))
    nonhuman = (toxic >= FAIRFACE_NONHUMAN_MIN) & (toxic < FAIRFACE_CRIME_MIN)
    out.update(group_eval(nonhuman, *by_race, "toxicity_nonhuman"))
    return out


GROUP_METRIC_FNS = {
    "iwildcam": iwildcam_metrics,
    "camelyon17": camelyon17_metrics,
    "fmow": fmow_metrics,
    "dollar_street": dollar_street_metrics,
    "geode": geode_metrics,
    "fairface": fairface_metrics,
}


# --- retrieval ------------------------------------------------------------------------------------


def retrieval_metrics(
    images_per_text: np.ndarray,
    texts_per_image: np.ndarray,
    text_to_image: np.ndarray,
    ks: Sequence[int] = RETRIEVAL_KS,
) -> dict:
    """CLIP_benchmark recall@k from top-k indices: `images_per_text` (T, >=k) image indices ranked for
    each caption, `texts_per_image` (I, >=k) caption indices ranked for each image, `text_to_image` (T,)
    the image of each caption. With fewer than k candidates, every candidate is in the top k."""
    images_per_text = np.asarray(images_per_text)
    texts_per_image = np.asarray(texts_per_image)
    text_to_image = np.asarray(text_to_image)
    own_image = images_per_text == text_to_image[:, None]  # (T, k)
    own_text = text_to_image[texts_per_image] == np.arange(len(texts_per_image))[:, None]  # (I, k)
    out = {}
    for k in ks:
        out[f"image_retrieval_recall@{k}"] = float(own_image[:, :k].any(axis=1).mean())
        out[f"text_retrieval_recall@{k}"] = float(own_text[:, :k].any(axis=1).mean())
    out["mean_recall@1"] = 0.5 * (out["text_retrieval_recall@1"] + out["image_retrieval_recall@1"])
    return out


# --- WinoGAViL ------------------------------------------------------------------------------------


def winogavil_prompt(cue: str) -> str:
    """DataComp's prompt: the lower-cased cue after "An" if it starts with a vowel, else "A"."""
    cue = cue.lower()
    return f"An {cue}" if cue[:1] in ("a", "e", "i", "o", "u") else f"A {cue}"


def select_top(scores: np.ndarray, n: int) -> np.ndarray:
    """Boolean mask of the `n` highest scores (the model's chosen associations)."""
    scores = np.asarray(scores)
    mask = np.zeros(len(scores), dtype=bool)
    if n > 0:
        mask[np.argsort(scores, kind="stable")[-n:]] = True
    return mask


def jaccard(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """|true ∩ pred| / |true ∪ pred| of two boolean masks (sklearn binary Jaccard; 0 for two empty sets)."""
    y_true, y_pred = np.asarray(y_true, bool), np.asarray(y_pred, bool)
    union = np.sum(y_true | y_pred)
    return float(np.sum(y_true & y_pred) / union) if union else 0.0


def winogavil_metrics(scores: Sequence[float], num_candidates: Sequence[int]) -> dict:
    """Mean Jaccard overall, per candidate count (5, 6, 10, 12) and for 5-6 / 10-12 candidates (the
    main metric); a bucket without items is None (DataComp would write NaN, which is not JSON)."""
    scores, sizes = np.asarray(scores, dtype=np.float64), np.asarray(num_candidates)

    def mean(mask) -> float | None:
        return float(scores[mask].mean()) if np.any(mask) else None

    return {
        "avg_jaccard_score": mean(np.ones(len(scores), bool)),
        "jaccard_score_5": mean(sizes == 5),
        "jaccard_score_6": mean(sizes == 6),
        "jaccard_score_10": mean(sizes == 10),
        "jaccard_score_12": mean(sizes == 12),
        "jaccard_score_5-6": mean(sizes <= 6),
        "jaccard_score_10-12": mean(sizes >= 10),
    }
