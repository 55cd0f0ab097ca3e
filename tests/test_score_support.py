"""Shared inputs of the `hype score` tests: a small synthetic world, tiny random-init scorers and one
uninterrupted local run that the crash, Ray and rerun tests compare against byte for byte.

Built once per test session (cached here), so every score test module reuses them.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

POOL_SIZE = 150
SHARD_SIZE = 50
_CACHE: dict = {}

# The settings every comparison run uses: tiny batches, one torch thread (so that runs in different
# processes and executors do the same arithmetic), N and M larger than the pool (reduced with warnings).
BASE_OVERRIDES = ["batch_size=32", "threads=1", "progress=false", "reference.n_top=100", "reference.m=80"]


def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if "world" not in _CACHE:
        from click.testing import CliRunner

        from hype.cli.synth import synth

        out = tmp_path_factory.mktemp("score-world") / "w"
        args = [
            "--out",
            str(out),
            "--size",
            str(POOL_SIZE),
            "--shard-size",
            str(SHARD_SIZE),
            "--clean-size",
            "50",
            "--eval-size",
            "10",
            "--reference-per-class",
            "1",
            "--workers",
            "1",
            "--no-progress",
        ]
        result = CliRunner().invoke(synth, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        _CACHE["world"] = out
    return _CACHE["world"]


def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if "models" not in _CACHE:
        import torch

        from hype.checkpoint import save_checkpoint
        from hype.models import create_model

        d = tmp_path_factory.mktemp("score-models")
        torch.manual_seed(0)
        save_checkpoint(d / "meru.safetensors", create_model("tiny-hyperbolic"))
        save_checkpoint(d / "clip.safetensors", create_model("tiny-clip"))
        _CACHE["models"] = (d / "meru.safetensors", d / "clip.safetensors")
    return _CACHE["models"]


def score_args(world_dir: Path, meru: Path, clip: Path, out: Path, *extra: str) -> list[str]:
    return [
        "--pool",
        str(world_dir / "pool" / "shards"),
        "--meru",
        str(meru),
        "--clip",
        str(clip),
        "--class-images",
        str(world_dir / "eval" / "reference" / "train"),
        "--out",
        str(out),
        *BASE_OVERRIDES,
        *extra,
    ]


def baseline(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory of one uninterrupted local run with the base settings."""
    if "baseline" not in _CACHE:
        w = world(tmp_path_factory)
        meru, clip = models(tmp_path_factory)
        out = tmp_path_factory.mktemp("score-baseline") / "run"
        result = run_cli(score_args(w, meru, clip, out))
        assert result.exit_code == 0, result.output
        _CACHE["baseline"] = out
    return _CACHE["baseline"]


# Near-duplicate stage on the tiny random-init CLIP, whose image features are all close: a cosine of 0.999
# keeps ~1% of the pairs, in groups of a few.
# the cosine groups alone (no copy check): tests/test_neardup.py checks them against a brute-force reference
NEARDUP_OVERRIDES = ["neardup.enabled=true", "neardup.threshold=0.999", "neardup.copy_check=false"]


def neardup_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the baseline run with the near-duplicate stage added (every other stage is reused)."""
    if "neardup" not in _CACHE:
        import shutil

        w = world(tmp_path_factory)
        meru, clip = models(tmp_path_factory)
        out = tmp_path_factory.mktemp("score-neardup") / "run"
        shutil.copytree(baseline(tmp_path_factory), out)
        result = run_cli(score_args(w, meru, clip, out, *NEARDUP_OVERRIDES))
        assert result.exit_code == 0, result.output
        _CACHE["neardup"] = out
    return _CACHE["neardup"]


def run_cli(args: list[str]):
    from click.testing import CliRunner

    from hype.cli.score import score

    return CliRunner().invoke(score, args, catch_exceptions=False)


def cli_command(args: list[str]) -> list[str]:
    """`hype score ARGS` as a subprocess command line (for kill -9 tests)."""
    return [sys.executable, "-c", "from hype.cli import main; main()", "score", *args]


def digests(folder: Path, pattern: str = "*.parquet") -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob(pattern))}


def wait_for(predicate, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise AssertionError(f"process ended (rc {proc.returncode}) before {what}:\n{out}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def descendants(pid: int) -> set[int]:
    """All live descendants of a process (from /proc)."""
    found: set[int] = set()
    stack = [pid]
    while stack:
        p = stack.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = {int(c) for c in (task / "children").read_text().split()}
            except OSError:
                continue
            stack += list(kids - found)
            found |= kids
    return found


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
                out.add(pid)
        except OSError:
            pass
    return out
