"""`hype score`'s stages as data (`hype.scoring.stages.STAGES`): the order DESIGN §7 documents, dependencies
that run first, `hype plan`'s rows declared by each stage, the conditions that switch stages on, and a new
stage added as one entry (a whole stage in one file: tests/test_stage_plugin.py)."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

from test_score_support import baseline, models, run_cli, score_args, world

from hype.scoring import stages
from hype.scoring.config import load_score_config
from hype.scoring.context import StageSpec
from hype.scoring.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]


def _documented_order() -> list[str]:
    """The stage names of DESIGN §7's "The stages, in order: a → b → [c, with ...] → ..." sentence."""
    section = (ROOT / "docs" / "DESIGN.md").read_text().split("\n## 7.")[1].split("\n## ")[0]
    listed = section.split("The stages, in order:")[1].split("\n\n")[0]
    return [re.match(r"\W*(\w+)", part).group(1) for part in listed.split("→")]


def test_the_declared_order_is_the_documented_one_and_reads_come_first():
    names = [s.name for s in STAGES]
    assert names == _documented_order()
    for i, spec in enumerate(STAGES):
        assert set(spec.reads) <= set(names[:i]), f"{spec.name} reads {spec.reads}, not all before it"
        assert spec.per_shard or spec.driver, spec.name


def test_each_stage_declares_its_plan_rows():
    assert [s.name for s in STAGES if s.plan is None] == []


def test_each_stage_takes_typed_settings_and_runs_when_its_config_asks():
    def active(*overrides: str) -> list[str]:
        cfg = load_score_config("default", list(overrides))
        for spec in STAGES:
            settings = spec.settings(cfg)
            assert settings is None or dataclasses.is_dataclass(settings), spec.name
        return [s.name for s in STAGES if s.when(cfg)]

    core = ["embed", "dedup", "reference", "specificity", "captions", "clusters", "merge", "card"]
    assert active() == core
    assert active("clusters.class_images=x", "decontam.eval_dir=e", "neardup.enabled=true") == [
        *core[:4], "classes", *core[4:6], "decontam", "merge", "neardup", "card"
    ]  # fmt: skip
    assert "captions" not in active("clusters.caption_filter=false")


def test_a_new_stage_is_one_entry_and_sees_the_outputs_it_reads(tmp_path_factory, tmp_path, monkeypatch):
    seen = {}

    def count_parts(state, settings, inputs: dict) -> int:
        seen.update(inputs=sorted(inputs), settings=settings, parts=len(inputs["merge"]))
        return len(inputs["merge"])

    extra = StageSpec(
        "count", count_parts, lambda c: c.reference, reads=("merge",), per_shard=False, driver=True
    )
    monkeypatch.setattr(stages, "STAGES", (*STAGES, extra))
    run = tmp_path / "run"
    shutil.copytree(baseline(tmp_path_factory), run)
    meru, clip = models(tmp_path_factory)
    result = run_cli(score_args(world(tmp_path_factory), meru, clip, run))
    assert result.exit_code == 0, result.output
    assert seen["inputs"] == ["merge"] and seen["parts"] == 3 and seen["settings"].n_top == 100
