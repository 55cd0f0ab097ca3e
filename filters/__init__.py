"""The bundled selection rules, one module per rule, each a `hype.select.rules.Rule` that registers itself
in `hype.select.rules.RULES` when imported (a plug-in: hype's library code never imports this package).

Score rules give each row a number (the selection keeps the top rows); mask rules give a keep-mask
(applied before ranking). `hype.select.rules.make_rule("basic:min_side=64")` builds a rule from a spec.

| rule | kind | module |
|---|---|---|
| hype | score | weighted sum of the HYPE terms (paper Eq. 1) |
| clip_score | score | cos θ, DataComp's CLIP-score baseline |
| specificity | score | ε_i + ε_t |
| random | score | seeded hash of the uid |
| image_cluster | mask | c_IN > 0, DataComp's image-based filter |
| basic | mask | DataComp's basic filter (language, caption length, image size) |
| intersect | mask | uid in an external subset file (e.g. DFN) |
| decontaminate | mask | not near an evaluation image (`hype score --decontaminate`) |
| dedup | mask | near-duplicates out but one keeper per group (`hype score` neardup stage) |
| combine | score | weighted sum of score columns, weights inline or from a file (`hype fit`'s) |
| negclip | score | negCLIPLoss: cos θ minus the contrastive normalization (needs `embed.clip_txt=true`) |
| normsim | score | NormSim: p-norm of an image's CLIP similarities to a target set (never the eval images) |
| dbp | score | density-based pruning: per-cluster quotas from cluster complexity, `inner` rule inside |

`union` with an external subset file is part of selection itself (`hype.select.union`).
"""

from __future__ import annotations

# isort: off
# Registration order is the order `hype select` lists the rules in (its error messages): scores, then masks.
from hype.filters.hype import HypeScore
from hype.filters.clip_score import ClipScore
from hype.filters.specificity import Specificity
from hype.filters.random import RandomScore
from hype.filters.combine import Combine
from hype.filters.negclip import NegClip
from hype.filters.normsim import NormSim
from hype.filters.dbp import DensityPruning
from hype.filters.image_cluster import ImageCluster
from hype.filters.basic import BasicFilter
from hype.filters.uid_set import Intersect
from hype.filters.decontaminate import Decontaminate
from hype.filters.dedup import Dedup

# isort: on

__all__ = [
    "HypeScore",
    "ClipScore",
    "Specificity",
    "RandomScore",
    "Combine",
    "NegClip",
    "NormSim",
    "DensityPruning",
    "ImageCluster",
    "BasicFilter",
    "Intersect",
    "Decontaminate",
    "Dedup",
]
