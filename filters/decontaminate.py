"""`decontaminate`: drop pool samples whose image is (nearly) an evaluation image, a mask applied before
ranking. It reads the matches `hype score --decontaminate EVAL_DIR` wrote beside the scores
(RUN_DIR/decontam/matches.parquet: `hype.scoring.decontam`) and flags a sample whose nearest image of
some task has cosine >= `threshold` (default: the threshold the run recorded at; only a higher one can be
asked for without rescoring).

subset.json's record of the filter gives, per task, the flagged samples (`matches`) and how many of them
would have been in the subset without this filter (`would_have_leaked`: they pass the other filters and
score at or above the subset's lowest kept score).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from hype.data.uids import UidMultiset, uids_to_array, uids_to_pairs
from hype.scoring.decontam import DecontamError, Matches, matches_path, read_matches
from hype.select.errors import SelectError
from hype.select.rules import RULES, Rule
from hype.table.reader import Batch


@RULES.register
class Decontaminate(Rule):
    name: ClassVar[str] = "decontaminate"
    kind: ClassVar[str] = "mask"
    summary: ClassVar[str] = "drop samples near an evaluation image (hype score --decontaminate)"
    PARAMS: ClassVar = {
        "threshold": (float, 0.0, "cosine at or above which a sample is dropped (0: the run's threshold)"),
    }

    def __init__(self, **params):
        super().__init__(**params)
        self.matches: list[Matches] = []
        self.flagged = UidMultiset(np.zeros(0, dtype="u8,u8"))
        self.task_of: dict[int, list[str]] = {}  # index into `flagged` -> its tasks

    def attach(self, table) -> None:
        threshold = self.params["threshold"] or None
        for folder in table.folders:
            try:
                found = read_matches(folder.parent, threshold)
            except DecontamError as e:
                raise SelectError(f"filter 'decontaminate': {e}") from None
            if found is None:
                raise SelectError(
                    f"filter 'decontaminate': {matches_path(folder.parent)} not found; run `hype score ... "
                    f"--out {folder.parent} --decontaminate EVAL_DIR` first (a rerun computes only that)"
                )
            self.matches.append(found)
        uids = [u for m in self.matches for u in m.table.column("uid").to_pylist()]
        tasks = [t for m in self.matches for t in m.table.column("task").to_pylist()]
        if uids:
            self.flagged = UidMultiset(uids_to_array(uids))
            hi, lo = uids_to_pairs(uids)
            for i, task in zip(self.flagged.find(hi, lo).tolist(), tasks, strict=True):
                self.task_of.setdefault(i, []).append(task)

    def columns(self) -> list[str]:
        return ["uid"]

    def mask(self, batch: Batch) -> np.ndarray:
        hi, lo = batch.uid_pairs()
        return self.flagged.find(hi, lo) < 0

    def describe(self) -> dict:
        per_task: dict[str, int] = {}
        for m in self.matches:
            for task, n in m.per_task().items():
                per_task[task] = per_task.get(task, 0) + n
        return {
            "rule": self.name,
            "threshold": max((m.threshold for m in self.matches), default=self.params["threshold"]),
            "flagged_samples": len(self.flagged),
            "matches": per_task,
        }

    def after_selection(self, table, ranker: Rule, masks: list[Rule], cut: float | None) -> dict:
        """Per task, the flagged samples that would have been kept without this filter: one more read of the
        table's uids and rule columns (only the flagged rows are scored)."""
        leaked = {task: 0 for task in self.describe()["matches"]}
        if not len(self.flagged) or cut is None:
            return {"would_have_leaked": leaked}
        others = [m for m in masks if m is not self]
        cols = ["uid", *ranker.columns(), *(c for m in others for c in m.columns())]
        for batch in table.iter_batches(cols, progress=None):
            hi, lo = batch.uid_pairs()
            idx = self.flagged.find(hi, lo)
            rows = idx >= 0
            if not rows.any():
                continue
            sub = batch.filter(rows)
            keep = np.asarray(ranker.score(sub), dtype=np.float64) >= cut
            for m in others:
                keep &= np.asarray(m.mask(sub), dtype=bool)
            for i in idx[rows][keep].tolist():
                for task in self.task_of[i]:
                    leaked[task] += 1
        return {"would_have_leaked": leaked}
