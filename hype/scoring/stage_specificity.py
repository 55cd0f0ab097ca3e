"""Specificity stage (per shard): ε_i and ε_t of every sample against the reference sets. DESIGN §2.3.

ε_t(x) = mean over S_i of E(x -> y) with the pool text as the cone apex; ε_i(y) = mean over S_t of
E(x -> y) with the pool image as the point. Raw energy E by default (HYPE's released code), the hinged
L_e with `hinge` (--hinge). Streams in bounded blocks at matmul speed (`hype.scoring.specificity`).
Output: `RUN_DIR/specificity/<shard id>.parquet` (eps_i, eps_t), row-aligned with the embed table.
"""

from __future__ import annotations

import time
from typing import Any

import pyarrow as pa
import torch

from hype.scoring import embed_format
from hype.scoring.config import SpecificityConfig
from hype.scoring.context import RunContext, StageSpec, SummaryView
from hype.scoring.pricing import ShardReads
from hype.scoring.reference import load_reference
from hype.scoring.rundir import RunDir, ShardTask, fingerprint
from hype.scoring.specificity import DEFAULT_BUDGET_ELEMS, image_specificity, text_specificity
from hype.scoring.stagebase import ShardStage, resolve_device


class MeanEnergyStage(ShardStage):
    """Per shard: the mean entailment energy of every pool image against a set of texts and of every pool
    text (as the apex) against a set of images, as two float32 columns row-aligned with the embed table.

    The reference selection's step 2 (`stage_reference.CandidateStage`, against the N top pairs) and
    the specificity stage (against S_i / S_t) are this computation with different sets and columns.
    """

    columns: tuple[str, str]  # (image column, text column)
    sets_key: str  # the fingerprint's name for the sets' digest

    def __init__(
        self,
        run: RunDir,
        *,
        curv: float,
        K: float,
        hinge: bool,
        sets_digest: str,
        budget_elems: int = DEFAULT_BUDGET_ELEMS,
        **kw,
    ):
        super().__init__(run, **kw)
        self.curv, self.K, self.hinge = curv, K, hinge
        self.sets_digest = sets_digest
        self.budget_elems = budget_elems

    def fingerprint(self, task: ShardTask) -> str:
        return fingerprint(
            {
                "stage": self.name,
                "embed": self.upstream_digest("embed", task),
                self.sets_key: self.sets_digest,
                "hinge": self.hinge,
                "K": self.K,
                "curv": self.curv,
            }
        )

    def load_sets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(images, texts) on the hyperboloid: the pool's texts are scored against the images and the
        pool's images against the texts."""
        raise NotImplementedError

    def setup(self) -> None:
        super().setup()
        self.device = resolve_device(self.device)
        images, texts = self.load_sets()
        self._images, self._texts = images.to(self.device), texts.to(self.device)

    def run(self, task: ShardTask) -> dict:
        started = time.perf_counter()
        fp = self.fingerprint(task)
        self._debug_hook(task)
        path = self.run_dir.shard_output("embed", task)
        images = torch.from_numpy(embed_format.read_embeddings(path, "meru_img")).to(self.device)
        texts = torch.from_numpy(embed_format.read_embeddings(path, "meru_txt")).to(self.device)
        kw = {"K": self.K, "hinge": self.hinge, "budget_elems": self.budget_elems}
        img = image_specificity(images, self._texts, self.curv, **kw).float().cpu().numpy()
        txt = text_specificity(texts, self._images, self.curv, **kw).float().cpu().numpy()
        img_col, txt_col = self.columns
        table = pa.table({img_col: pa.array(img, pa.float32()), txt_col: pa.array(txt, pa.float32())})
        return self._finish(task, fp, table, started, rate=table.num_rows, counts={"samples": table.num_rows})


class SpecificityStage(MeanEnergyStage):
    name = "specificity"
    columns = ("eps_i", "eps_t")
    sets_key = "reference"

    def __init__(self, run: RunDir, *, reference_digest: str, **kw):
        super().__init__(run, sets_digest=reference_digest, **kw)

    def load_sets(self) -> tuple[torch.Tensor, torch.Tensor]:
        return load_reference(self.run_dir.reference).lifted(self.curv)  # (S_i, S_t)


# --- the stage in a `hype score` run -----------------------------------------------------------------

READS = ShardReads(markers=1, parquets=2, sets=1)  # the reference's marker, the embed output twice


def specificity(ctx: RunContext, sc: SpecificityConfig, inputs: dict) -> dict:
    """ε_i and ε_t of every shard against the reference sets."""
    pool = inputs["embed"]
    stage = SpecificityStage(
        ctx.run,
        curv=pool.curv,
        K=pool.K,
        hinge=sc.hinge,
        reference_digest=inputs["reference"]["digest"],
        budget_elems=sc.budget_elems,
        **pool.kw,
    )
    ctx.map(stage, pool.tasks)
    ctx.check_failures("specificity", ctx.plan)
    return {"hinge": sc.hinge, "K": pool.K, "curv": pool.curv}


def plan(est: Any) -> None:
    # the L_e kernel's extra seconds per row at the run's M (`stage_reference.plan`)
    est.map("specificity", "specificity", "samples x M", reads=READS, extra_per_sample=est.m_more)


def _summary(view: SummaryView) -> dict:
    sc = view.cfg.specificity
    return {"specificity": view.outputs.get("specificity") or {"hinge": sc.hinge, "K": sc.K}}


STAGE = StageSpec(
    "specificity",
    specificity,
    lambda c: c.specificity,
    reads=("embed", "reference"),
    plan=plan,
    summary=_summary,
)
