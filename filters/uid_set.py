"""`intersect`: only rows whose uid is in an external DataComp subset file (e.g. a DFN subset) are eligible,
a mask applied before ranking, e.g. to rank a DFN subset by HYPE and keep its top part. Its counterpart
after ranking, `--union FILE`, is part of selection itself (`hype.select.union`).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from hype.data.uids import UidMultiset, load_uid_file
from hype.select.errors import SelectError
from hype.select.rules import RULES, Rule
from hype.table.reader import Batch


@RULES.register
class Intersect(Rule):
    name: ClassVar[str] = "intersect"
    kind: ClassVar[str] = "mask"
    summary: ClassVar[str] = "keep rows whose uid is in a DataComp subset file (path=FILE.npy)"
    PARAMS: ClassVar = {"path": (str, "", "DataComp subset file (u8,u8: .npy or raw memmap)")}
    OPTIONS: ClassVar = ("intersect",)  # hype select --intersect FILE (repeatable): one filter per file

    def __init__(self, **params):
        super().__init__(**params)
        if not self.params["path"]:
            raise SelectError(
                "filter 'intersect' needs a file: --intersect FILE.npy or intersect:path=FILE.npy"
            )
        self.uids = UidMultiset(load_uid_file(self.params["path"], "--intersect"))

    def columns(self) -> list[str]:
        return ["uid"]

    def mask(self, batch: Batch) -> np.ndarray:
        hi, lo = batch.uid_pairs()
        return self.uids.find(hi, lo) >= 0

    def describe(self) -> dict:
        return {"rule": self.name, "path": self.params["path"], "uids": len(self.uids)}
