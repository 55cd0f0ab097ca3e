"""`dedup`: near-duplicates out, one keeper per group, a mask applied before ranking.

Reads the groups `hype score` found with `neardup.enabled=true` (`RUN_DIR/neardup/`, see
`hype.scoring.stage_neardup`) and regroups them at this filter's threshold and keeper rule: every member of
a group but its keeper is masked. The threshold may be the stored one or stricter (the stored forest holds
every pair down to it); a lower one is an error naming the rerun that gives it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from hype.data.uids import UidMultiset, to_structured
from hype.scoring.neardup import KEEPERS, NeardupError
from hype.select.errors import SelectError
from hype.select.rules import RULES, Rule
from hype.table.reader import Batch


@RULES.register
class Dedup(Rule):
    name: ClassVar[str] = "dedup"
    kind: ClassVar[str] = "mask"
    summary: ClassVar[str] = "near-duplicate images out but one keeper per group (hype score neardup stage)"
    PARAMS: ClassVar = {
        "threshold": (
            float,
            0.0,
            "cosine >= this makes two images duplicates, of the pairs the run's copy check confirmed "
            "(0: the run's neardup.threshold)",
        ),
        "keeper": (str, "", f"who stays: {' | '.join(KEEPERS)} (empty: the run's neardup.keeper)"),
        "seed": (int, 0, "seed of the random keeper"),
    }

    def __init__(self, **params: Any):
        super().__init__(**params)
        keeper = self.params["keeper"]
        if keeper and keeper not in KEEPERS:
            raise SelectError(f"filter 'dedup': keeper={keeper!r} is not one of {', '.join(KEEPERS)}")
        self.drop: UidMultiset | None = None
        self.found: dict = {}

    def columns(self) -> list[str]:
        return ["uid"]

    def attach(self, table) -> None:
        """Read every run's groups and regroup them at this filter's settings: the uids to drop."""
        from hype.scoring.stage_neardup import read_groups, regroup

        his, los = [], []
        groups = members = 0
        for folder in table.folders:
            try:
                stored = read_groups(folder.parent)
                threshold = self.params["threshold"] or float(stored.info["threshold"])
                keeper = self.params["keeper"] or stored.info["keeper"]
                group, keep = regroup(stored, threshold, keeper, self.params["seed"])
            except NeardupError as e:
                raise SelectError(f"filter 'dedup': {e}") from None
            his.append(stored.hi[~keep])
            los.append(stored.lo[~keep])
            groups += len(np.unique(group[group >= 0]))
            members += int((group >= 0).sum())
        drop = np.sort(to_structured(np.concatenate(his), np.concatenate(los)))
        self.drop = UidMultiset(drop)
        self.found = {"threshold": threshold, "keeper": keeper, "groups": groups, "members": members}
        # None: the run joined every pair >= its threshold (neardup.copy_check=false, or scored before it)
        self.found["copy_check"] = stored.info.get("copy_check")

    def mask(self, batch: Batch) -> np.ndarray:
        if self.drop is None:
            raise SelectError("filter 'dedup' reads the run's near-duplicate groups first (Rule.bind)")
        hi, lo = batch.uid_pairs()
        return self.drop.find(hi, lo) < 0

    def describe(self) -> dict:
        return {"rule": self.name, **self.params, **self.found}
