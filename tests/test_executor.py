"""The executor core (`hype.executor`): skipping finished tasks, the one retry policy, failures, stats,
worker processes, and the registry through which `hype score` finds the executors of `pipelines/`."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hype.executor import EXECUTORS, PoolExecutor, Progress, Resources, Stage, StageSetupError

ROOT = Path(__file__).resolve().parents[1]


class Squares(Stage):
    """Writes `<n>.json` holding n² (its own completion marker); fails as told, to exercise retries."""

    name = "squares"

    def __init__(self, out: Path, fail: dict[int, int] | None = None, die: int | None = None):
        self.out = out
        self.fail = fail or {}  # task -> how many of its attempts raise
        self.die = die  # the task whose first attempt kills the worker process

    def resources(self) -> Resources:
        return Resources(env={"HYPE_TEST_EXECUTOR": "set"})

    def done(self, task: int) -> dict | None:
        p = self.out / f"{task}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def prepare_process(self, cpus: float | None) -> None:
        self.cpus = cpus

    def setup(self) -> None:
        self.pid = os.getpid()

    def run(self, task: int) -> dict:
        tries = self.out / f"{task}.tries"
        n = int(tries.read_text()) + 1 if tries.exists() else 1
        # By rename: a broken pool SIGTERMs its other workers, and one stopped between a truncating
        # write's open and its write left this file empty for the fresh pool's attempt (seen under load).
        (self.out / f"{task}.tries.tmp").write_text(str(n))
        os.replace(self.out / f"{task}.tries.tmp", tries)
        if task == self.die and n == 1:
            os._exit(3)  # a worker killed mid-task (out of memory, SIGKILL)
        if n <= self.fail.get(task, 0):
            raise OSError(f"disk trouble on {task}")
        stats = {"task": task, "value": task * task, "pid": self.pid, "cpus": self.cpus}
        stats["env"] = os.environ.get("HYPE_TEST_EXECUTOR")
        (self.out / f"{task}.json").write_text(json.dumps(stats))
        return stats


class BadSetup(Stage):
    name = "bad"

    def setup(self) -> None:
        raise FileNotFoundError("no checkpoint here")

    def run(self, task: int) -> int:
        return task


class Double:
    """A stage with no `Stage` base class: the executor supplies the default hooks."""

    name = "double"

    def setup(self):
        pass

    def run(self, task):
        return 2 * task


@pytest.mark.parametrize("workers", [1, 3])
def test_runs_what_is_not_done_retries_and_reports_failures(tmp_path, workers):
    (tmp_path / "1.json").write_text(json.dumps({"task": 1, "value": 1, "reused": True}))
    stage = Squares(tmp_path, fail={2: 1, 4: 5})
    seen = []
    ex = PoolExecutor(workers, retries=2, start_method="fork")
    result = ex.map(stage, list(range(6)), lambda task, stats: seen.append(task))

    assert [r and r["value"] for r in result.results] == [0, 1, 4, 9, None, 25]
    assert result.results[1]["reused"] and sorted(seen) == [0, 2, 3, 5]
    assert result.results[2]["attempts"] == 2 and result.results[0]["attempts"] == 1
    assert (result.ran, result.reused, result.retries) == (4, 1, 3)  # 2: once, 4: twice, then given up
    [failure] = result.failures
    assert failure.task == 4 and failure.attempts == 3 and failure.error == "OSError: disk trouble on 4"
    assert isinstance(failure.exception, OSError)
    with pytest.raises(OSError, match="disk trouble on 4"):
        result.raise_first_failure()
    # A rerun does only what is missing.
    again = ex.map(Squares(tmp_path), list(range(6)))
    assert (again.ran, again.reused, again.failures) == (1, 5, [])


def test_in_process_runs_a_copy_and_worker_processes_get_their_share_and_env(tmp_path):
    stage = Squares(tmp_path / "here")
    stage.out.mkdir()
    result = PoolExecutor(1).map(stage, [0, 1])
    assert {r["pid"] for r in result.results} == {os.getpid()} and result.results[0]["cpus"] is None
    assert not hasattr(stage, "pid")  # setup() ran on the executor's copy, not on the driver's stage

    stage = Squares(tmp_path / "pool")
    stage.out.mkdir()
    result = PoolExecutor(2, start_method="spawn").map(stage, [0, 1, 2, 3])
    assert os.getpid() not in {r["pid"] for r in result.results}
    assert all(r["cpus"] >= 1 and r["env"] == "set" for r in result.results)


def test_a_dead_worker_costs_an_attempt_and_a_fresh_pool_takes_over(tmp_path):
    result = PoolExecutor(2, retries=1, start_method="fork").map(Squares(tmp_path, die=2), list(range(5)))
    assert result.failures == [] and [r["value"] for r in result.results] == [0, 1, 4, 9, 16]
    assert result.retries >= 1 and (tmp_path / "2.tries").read_text() == "2"


@pytest.mark.parametrize("workers", [1, 2])
def test_setup_errors_are_raised_never_retried(workers):
    with pytest.raises(StageSetupError, match="bad setup failed: FileNotFoundError: no checkpoint here"):
        PoolExecutor(workers, retries=5, start_method="fork").map(BadSetup(), [1, 2, 3])


def test_fail_fast_stops_at_the_first_failure(tmp_path):
    result = PoolExecutor(1, retries=0, fail_fast=True).map(Squares(tmp_path, fail={1: 1}), list(range(4)))
    assert [f.task for f in result.failures] == [1] and result.results == [
        {"task": 0, "value": 0, "pid": os.getpid(), "cpus": None, "env": None, "attempts": 1},
        None,
        None,
        None,
    ]


def test_stub_stages_need_only_run_and_progress_counts_new_results(tmp_path, capsys):
    bar = Progress("double", enabled=False)
    assert PoolExecutor().map(Double(), [1, 2, 3], progress=bar).results == [2, 4, 6]
    assert bar.total == 3 and bar.bar is None
    for lazy in (False, True):
        bar = Progress(f"doubling{int(lazy)}", lazy=lazy, postfix=lambda: "fast")
        PoolExecutor(2, start_method="fork").map(Double(), [1, 2, 3], progress=bar)
        err = capsys.readouterr().err
        assert f"doubling{int(lazy)}" in err and "3/3" in err and "fast" in err


def test_score_executors_are_plug_ins_found_by_name():
    import hype.pipelines  # noqa: F401 - tests are the top layer; hype.cli imports it the same way
    from hype.executor import make_executor
    from hype.pipelines.local import LocalExecutor
    from hype.pipelines.ray_executor import RayExecutor
    from hype.scoring.config import load_score_config

    assert EXECUTORS.get("local") is LocalExecutor and EXECUTORS.get("ray") is RayExecutor
    ex = make_executor(load_score_config("default", ["executor.retries=4"]))
    assert isinstance(ex, LocalExecutor) and ex.retries == 4


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_layers_point_down():
    """The library never imports the executors; the executors know stages only through hype.executor."""
    for path in (ROOT / "hype").rglob("*.py"):
        if path.parent.name == "cli":
            continue  # hype.cli composes the layers
        assert not any(m.startswith("hype.pipelines") for m in _imports(path)), path
    for path in (ROOT / "pipelines").glob("*.py"):
        hype_imports = {m for m in _imports(path) if m.startswith("hype")} - {"hype.pipelines"}
        # core only: the executor contract, Ray's start-up and the config validators its settings use
        assert hype_imports <= {"hype.executor", "hype.ray_driver", "hype.config"}, (path, hype_imports)
    # The executor core knows the plug-in registry, the config schema of its settings and the storage
    # options it hands to workers, no stage.
    assert {m for m in _imports(ROOT / "hype" / "executor.py") if m.startswith("hype")} == {
        "hype.plugins",
        "hype.config",
        "hype.io",
    }
    code = "import sys, hype.scoring.runner, hype.reshard, hype.synth; print('hype.pipelines' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "False"
