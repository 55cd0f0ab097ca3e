"""Executors own their settings (#35 §2): a plug-in declares its keys of the `executor` section (a `Settings`
dataclass it validates), and `hype plan` asks the plug-in, not its name, what its workers cost."""

from __future__ import annotations

import ast
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from test_score_support import baseline

from hype.config import ConfigError, at_least
from hype.executor import EXECUTORS, ExecutorConfig, PoolExecutor
from hype.scoring.config import load_score_config
from hype.scoring.plan import estimate, pool_size, probe_from_run

ROOT = Path(__file__).resolve().parents[1]


class Sliced(PoolExecutor):
    """A third-party executor, defined here alone: its own setting, its own answers to `hype plan`."""

    name = "sliced-test"

    @dataclass(frozen=True)
    class Settings:
        slice_gpus: float = 0.25  # GPUs one worker holds

        def __post_init__(self) -> None:
            at_least(self, 0.125, "slice_gpus")

    @classmethod
    def gpus_per_worker(cls, config: ExecutorConfig) -> float:
        return config.settings().slice_gpus

    @classmethod
    def from_config(cls, cfg) -> Sliced:
        return cls(workers=1, retries=cfg.executor.retries)


@pytest.fixture
def sliced():
    EXECUTORS.register(Sliced)
    try:
        yield Sliced
    finally:
        EXECUTORS._items.pop(Sliced.name)


def test_a_plug_ins_own_setting_is_a_key_of_the_executor_section_and_hype_plan_asks_it(
    sliced, tmp_path_factory
):
    run = baseline(tmp_path_factory)
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    cfg = load_score_config(recorded, ["executor.kind=sliced-test", "executor.slice_gpus=0.5"])
    assert cfg.executor.settings() == Sliced.Settings(slice_gpus=0.5)
    # validated by the plug-in's dataclass, named by its key; Ray's keys (a preset's) stay valid beside it
    with pytest.raises(ConfigError, match=r"executor\.slice_gpus: must be >= 0.125"):
        load_score_config(recorded, ["executor.kind=sliced-test", "executor.slice_gpus=0.1"])
    with pytest.raises(ConfigError, match=r"executor\.slice: unknown key; valid keys in executor: kind, "):
        load_score_config(recorded, ["executor.slice=1"])
    # the section is recorded flat, with the plug-in's key, and read back the same
    assert cfg.to_dict()["executor"]["slice_gpus"] == 0.5 and "ray_address" in cfg.to_dict()["executor"]
    assert load_score_config(cfg.to_dict()) == cfg
    # hype plan: the GPUs the run holds are the plug-in's answer (was: 1 per worker unless named "ray")
    size = pool_size(cfg.pool)
    summary = json.loads((run / "summary.json").read_text())
    probe = probe_from_run(run, summary, samples=size.total, shards=len(size.shards), workers=1)
    probe = dataclasses.replace(probe, device="cuda")
    local = estimate(load_score_config(recorded), size, probe)["total"]["gpus"]
    assert local > 0 and estimate(cfg, size, probe)["total"]["gpus"] == pytest.approx(local * 0.5)


def test_a_recorded_executor_section_is_written_back_byte_for_byte(tmp_path_factory):
    """Runs already scored resume unchanged: their config.yaml's executor section (Ray's keys beside
    `kind: local`, in the order written) reads and writes back as it was."""
    run = baseline(tmp_path_factory)
    text = (run / "config.yaml").read_text()
    cfg = load_score_config(yaml.safe_load(text))
    assert list(cfg.to_dict()["executor"]) == list(yaml.safe_load(text)["executor"])
    assert cfg.to_yaml() == text


def _compares_an_executor_name(node: ast.Compare, names: set[str]) -> bool:
    operands = [node.left, *node.comparators]
    named = any(isinstance(o, ast.Constant) and o.value in names for o in operands)
    return named and any("executor" in ast.unparse(o) or "kind" in ast.unparse(o) for o in operands)


def test_nothing_outside_pipelines_branches_on_an_executor_name():
    """Questions about an executor are its plug-in's to answer (`in_process`, `copies_models`,
    `gpus_per_worker`, `Settings`): no module outside pipelines/ compares `executor.kind` or a `kind`
    with a registered executor's name."""
    names = set(EXECUTORS.names())
    found = []
    for folder in ("hype", "filters"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Compare) and (
                    _compares_an_executor_name(node, names) or "executor.kind" in ast.unparse(node)
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)
