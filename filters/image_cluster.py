"""`image_cluster`: keep rows with c_IN > 0, DataComp's image-based (ImageNet-cluster) filter.

`hype score` sets c_IN = 10 when a sample's image falls in an ImageNet-like cluster and its caption passes
DataComp's caption rule (DESIGN §2.4), so this mask is DataComp's image-based baseline.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from hype.select.rules import RULES, Rule
from hype.table.reader import Batch


@RULES.register
class ImageCluster(Rule):
    name: ClassVar[str] = "image_cluster"
    kind: ClassVar[str] = "mask"
    summary: ClassVar[str] = "c_in > 0 (DataComp image-based filter)"
    PARAMS: ClassVar = {}

    def columns(self) -> list[str]:
        return ["c_in"]

    def mask(self, batch: Batch) -> np.ndarray:
        return batch.numeric("c_in") > 0
