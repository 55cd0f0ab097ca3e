"""A `hype train` process killed with SIGKILL (or stopped with SIGTERM) resumes at the exact step with
the same learning-rate trajectory as an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from train_helpers import MICRO

from hype.synth import make_world
from hype.train import list_checkpoints, load_train_config, read_metrics, train

STEPS = 25
RUN = [
    *MICRO,
    "data.workers=0",
    "data.shuffle_buffer=32",
    "log_every_steps=1",
    "optim.warmup_steps=5",
    "batch_size=8",
    f"samples_seen={8 * STEPS}",
    "checkpoint.every_steps=5",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "world"
    make_world(out, 32, 0, clean_size=64, eval_size=8, reference_per_class=1, shard_size=32, workers=1)
    return out


def command(world: Path, out: Path) -> list[str]:
    data = str(world / "clean" / "shards")
    cli = [sys.executable, "-m", "hype.train", "--config", "tiny-clip", "--no-progress"]
    return [*cli, "--data", data, "--out", str(out), *RUN]


def start_and_wait_for_checkpoint(world: Path, out: Path) -> subprocess.Popen:
    proc = subprocess.Popen(command(world, out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    marker = out / "checkpoints" / "step-00000005.state.pt"
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None:
            pytest.fail(f"training exited early ({proc.returncode}):\n{proc.stdout.read().decode()}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("no checkpoint within 120 s")
        time.sleep(0.02)
    return proc


def reference(world: Path, out: Path) -> list[dict]:
    cfg = load_train_config("tiny-clip", [*RUN, f"data.train={world / 'clean' / 'shards'}", f"out={out}"])
    assert train(cfg, progress=False)["status"] == "completed"
    return read_metrics(out / "metrics.jsonl")


def test_sigkill_then_resume_matches_an_uninterrupted_run(world, tmp_path):
    out = tmp_path / "killed"
    proc = start_and_wait_for_checkpoint(world, out)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    killed_at = max(r["step"] for r in read_metrics(out / "metrics.jsonl"))
    assert killed_at < STEPS, "the run finished before it could be killed"
    assert not (out / "model.safetensors").exists()

    done = subprocess.run(command(world, out), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resuming" in done.stderr and "training complete" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == STEPS
    assert summary["resumed_from_step"] >= 5 and summary["resumed_from_step"] % 5 == 0

    ref = reference(world, tmp_path / "ref")
    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    assert [r["lr"] for r in got] == [r["lr"] for r in ref]
    assert [r["samples_seen"] for r in got] == [r["samples_seen"] for r in ref]
    assert got[-1]["lr"] == ref[-1]["lr"] > 0 and got[4]["lr"] == ref[4]["lr"] == pytest.approx(1e-3)
    assert [c.step for c in list_checkpoints(out)][-1] == STEPS  # periodic ones pruned to `keep`
    assert len(list_checkpoints(out)) == 2


def test_sigterm_saves_a_checkpoint_and_exits_interrupted(world, tmp_path):
    out = tmp_path / "term"
    proc = start_and_wait_for_checkpoint(world, out)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 3, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and "resume with the same command" in output
    last = list_checkpoints(out)[-1]
    assert last.step == summary["step"] >= 5
    assert max(r["step"] for r in read_metrics(out / "metrics.jsonl")) == last.step
