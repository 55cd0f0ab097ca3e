"""`hype demo` (the workflow configs/workflows/demo.yaml) end to end on a small world: every step runs for
real (HTTP download, Ray scoring, training, evaluation, report), then a rerun resumes without redoing
anything, and `hype run` of the workflow file reproduces the demo's table."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import DEMO_OPTIONS, DEMO_VARS

from hype.config import preset_path
from hype.data.uids import load_subset

pytestmark = pytest.mark.slow


def _demo(out, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hype.cli", "demo", "--out", str(out), *DEMO_OPTIONS, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_demo_runs_every_step_and_resumes(demo_run):
    out, first = demo_run
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # Each step is shown as the command a user would type.
    for cmd in ("$ hype synth", "$ hype download", "$ hype train", "$ hype score", "$ hype select"):
        assert cmd in first.stdout
    assert "--executor ray" in first.stdout

    result = json.loads((out / "results.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert list(rows) == ["hype", "clip-score", "random"]
    truth = json.loads((out / "world" / "world.json").read_text())
    downloaded = json.loads((out / "pool" / "_hype" / "summary.json").read_text())
    assert downloaded["samples"]["successes"] == truth["counts"]["pool"]
    scored = json.loads((out / "score" / "summary.json").read_text())
    assert scored["samples"]["scored"] == truth["counts"]["pool"] and scored["executor"].startswith("ray")
    for name, row in rows.items():
        subset = load_subset(out / f"select-{name}" / "subset.npy")
        assert len(subset) == row["samples"] == 60  # round(0.2 * 300)
        assert len(np.unique(subset)) == len(subset)
        assert len(row["metrics"]) == len(truth["eval_tasks"])
        assert 0.0 <= row["average"] <= 1.0
        assert abs(sum(row["composition"].values()) - 1.0) < 1e-9
        assert (out / f"train-{name}" / "model.safetensors").is_file()
    # The selections differ and HYPE keeps more clean samples than a random draw (the scorers were
    # trained on the clean set, so even tiny ones separate the noise this well).
    assert not np.array_equal(
        load_subset(out / "select-hype" / "subset.npy"), load_subset(out / "select-random" / "subset.npy")
    )
    assert rows["hype"]["clean"] > rows["random"]["clean"]
    report = (out / "report" / "report.html").read_text()
    assert "<html" in report.lower()
    # The table is printed with the report's location.
    assert "hype demo: results" in first.stdout and str(out / "report" / "report.html") in first.stdout
    table = (out / "results.md").read_text()
    assert table.count("\n| ") >= 4

    # A rerun skips every finished step and prints the same table.
    second = _demo(out)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "$ hype train" not in second.stdout and "$ hype download" not in second.stdout
    assert "skipped" in second.stdout
    assert json.loads((out / "results.json").read_text())["rows"] == result["rows"]

    # `hype run` of the workflow file with the same variables is the same run: every step is done.
    cmd = [
        sys.executable,
        "-m",
        "hype.cli",
        "run",
        str(preset_path("workflows", "demo")),
        f"out={out}",
        *DEMO_VARS,
    ]
    third = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "hype run demo: 0 of 16 steps ran" in third.stdout
    assert (out / "results.md").read_text() == table


def test_demo_rejects_bad_arguments(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "hype.cli", "demo", "--out", str(tmp_path / "d"), "--frac", "1.5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert "--frac must be in (0, 1]" in bad.stderr
    assert not (tmp_path / "d").exists()
