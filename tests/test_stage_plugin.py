"""Adding a stage to `hype score` is adding one file: a stage defined here, in this test file alone (its
per-shard work, driver step, `hype plan` rows and summary fields), registered with
`hype.scoring.stages.register` and run through `hype score` and `hype plan` as they are (DESIGN §7)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_score_support import baseline, models, run_cli, score_args, world

from hype.io import read_parquet
from hype.scoring import stages
from hype.scoring.context import RunContext, StageSpec, SummaryView
from hype.scoring.pricing import ShardReads
from hype.scoring.rundir import ShardTask, fingerprint
from hype.scoring.stagebase import ShardStage

NAME = "caption_length"


class CaptionLengthStage(ShardStage):
    """Per shard: the characters of each caption, row-aligned with the embed output."""

    name = NAME

    def fingerprint(self, task: ShardTask) -> str:
        return fingerprint({"stage": self.name, "embed": self.upstream_digest("embed", task)})

    def run(self, task: ShardTask) -> dict:
        started = time.perf_counter()
        texts = read_parquet(self.run_dir.shard_output("embed", task), columns=["text"]).column(0).to_pylist()
        table = pa.table({"chars": pa.array([len(t) for t in texts], pa.int32())})
        return self._finish(task, self.fingerprint(task), table, started, counts={"samples": table.num_rows})


def caption_length(ctx: RunContext, settings: None, inputs: dict) -> dict:
    """The driver step: the stage mapped over the pool's shards; the mean caption length."""
    pool = inputs["embed"]
    stats = ctx.map(CaptionLengthStage(ctx.run, **pool.kw), pool.tasks)
    ctx.check_failures(NAME, ctx.plan)
    chars = [read_parquet(ctx.run.shard_output(NAME, t)).column("chars").to_numpy() for t in pool.tasks]
    return {"shards": len(stats), "mean_chars": round(float(np.concatenate(chars).mean()), 3)}


def plan(est) -> None:
    est.map(NAME, "caption length", "samples", reads=ShardReads(markers=1, parquets=1))


def summary(view: SummaryView) -> dict:
    out = view.outputs.get(NAME)
    return {NAME: out} if out is not None else {}


STAGE = StageSpec(NAME, caption_length, reads=("embed",), plan=plan, summary=summary)


@pytest.fixture
def registered(tmp_path_factory):
    baseline(tmp_path_factory)  # built (once per session, shared) without the stage
    stages.register(STAGE, after="merge")
    yield
    stages.unregister(NAME)


def _expected(run) -> dict[str, list[int]]:
    """Caption lengths read from the embed outputs directly, per shard id (the independent reference)."""
    return {
        p.stem: [len(t) for t in pq.read_table(p, columns=["text"]).column(0).to_pylist()]
        for p in sorted((run / "embed").glob("*.parquet"))
    }


def test_a_stage_in_one_file_runs_through_hype_score(tmp_path_factory, tmp_path, registered):
    run = tmp_path / "run"
    shutil.copytree(baseline(tmp_path_factory), run)  # every built-in stage is reused
    meru, clip = models(tmp_path_factory)
    result = run_cli(score_args(world(tmp_path_factory), meru, clip, run))
    assert result.exit_code == 0, result.output

    expected = _expected(run)
    assert len(expected) == 3
    for shard_id, lengths in expected.items():
        assert pq.read_table(run / NAME / f"{shard_id}.parquet").column("chars").to_pylist() == lengths
        assert json.loads((run / NAME / f"{shard_id}_stats.json").read_text())["stage"] == NAME
    s = json.loads((run / "summary.json").read_text())
    everything = [n for lengths in expected.values() for n in lengths]
    assert s[NAME] == {"shards": 3, "mean_chars": round(float(np.mean(everything)), 3)}
    assert s["stages"][NAME]["shards_run"] == 3 and s["status"] == "complete"
    assert f'  {NAME} {{"shards": 3, "mean_chars": {s[NAME]["mean_chars"]}}}' in result.output  # printed too

    again = run_cli(score_args(world(tmp_path_factory), meru, clip, run))  # resumable like the others
    assert again.exit_code == 0, again.output
    s = json.loads((run / "summary.json").read_text())
    assert s["stages"][NAME]["shards_reused"] == 3 and s["stages"][NAME]["shards_run"] == 0


def test_a_stage_in_one_file_has_its_row_in_hype_plan(tmp_path_factory, tmp_path, monkeypatch, registered):
    from hype.cli.plan import plan as plan_command

    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the probe's folder lands here
    args = [*score_args(w, meru, clip, tmp_path / "never"), "--probe-samples", "60", "--json"]
    result = CliRunner().invoke(plan_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["stages"]
    names = [r["stage"] for r in rows]
    assert names.index("merge") < names.index("caption length") < names.index("card")
    row = rows[names.index("caption length")]
    assert row["run_stage"] == NAME and row["scales_with"] == "samples" and row["probe_s"] > 0
    assert row["bytes"] > 0 and row["per_sample_s"] >= 0
    shards = json.loads(result.stdout)["pool"]["shards"]
    # a fresh run's requests for it: per shard its marker and parquet read, output + marker written
    assert row["requests"]["put"] == 2 * shards and row["requests"]["get"] > 0


def test_a_registered_stage_is_cleaned_and_carded_like_the_built_in_ones(
    tmp_path_factory, tmp_path, registered
):
    """The run's stage folders come from the declarations: a registered stage's temporaries left by a
    killed run are removed on the rerun, and card.json names its outputs, so `hype verify` finds them
    altered (also when the stage is no longer registered: the card says which folders it covers)."""
    from hype.cli import main
    from hype.io.files import TMP_TAG

    run = tmp_path / "run"
    shutil.copytree(baseline(tmp_path_factory), run)
    meru, clip = models(tmp_path_factory)
    (run / NAME).mkdir()
    stale = run / NAME / f".x.parquet{TMP_TAG}123"
    stale.write_bytes(b"left by a killed run")
    assert run_cli(score_args(world(tmp_path_factory), meru, clip, run)).exit_code == 0
    assert not stale.exists()
    card = json.loads((run / "card.json").read_text())
    assert NAME in card["stages"]
    stages.unregister(NAME)
    try:
        marker = sorted((run / NAME).glob("*_stats.json"))[0]
        stats = json.loads(marker.read_text())
        stats["output"]["digest"] = "0" * len(stats["output"]["digest"])
        marker.write_text(json.dumps(stats))
        res = CliRunner().invoke(
            main,
            [
                "verify",
                str(run / "card.json"),
                "--pool",
                score_args(world(tmp_path_factory), meru, clip, run)[1],
            ],
        )
    finally:
        stages.register(STAGE, after="merge")
    assert res.exit_code != 0 and f"the {NAME} stage's outputs are not the ones the card names" in res.output
