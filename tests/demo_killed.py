"""The demo workflow killed in every step, then finished: tests/test_workflow.py's kill test reads what this
writes. It runs as a background run (tests/background.py) beside the rest of the suite, because it is two
or three minutes of `hype run` start-ups and small trainings on about one core, and it needs nothing from
another test until its outputs are compared with the session's `hype demo`.

Usage: python tests/demo_killed.py FOLDER. Writes FOLDER/killed (the run) and FOLDER/kills.json (the steps,
those a kill landed in, those cut with their outputs begun); prints the last run's log; exits with its code.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import DEMO_VARS

from hype.workflow import load_workflow

SMALL = [*DEMO_VARS, "steps.pool.runtime.processes=1"]  # tests/test_demo.py's sizes


def _hype_run(out: Path, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hype.cli", "run", "demo", f"out={out}", *SMALL, "--executor", "local"]
    return subprocess.Popen([*cmd, "--no-progress"], start_new_session=True, **popen)


def _marker(out: Path, step: str) -> dict:
    path = out / ".hype" / "steps" / f"{step}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _files(folder: Path) -> list[Path]:
    """The files a step has written so far (not the lock files its command takes)."""
    return [p for p in folder.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def main(folder: Path) -> int:
    out = folder / "killed"
    steps = list(load_workflow("demo", [f"out={out}", *SMALL]).steps)
    # For each step in turn: run, and kill the whole process group (hype run and the command it runs)
    # in that step: once the step has written a file, or 0.8 s after it started (the steps that write
    # their output as they go are given the time to write some). The next run finishes that step and is
    # killed in the next one.
    killed, partial = [], []
    for step in steps:
        wait = 30.0 if step in ("pool", "meru", "score", "train-hype") else 0.8
        proc = _hype_run(out, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started = None
        while proc.poll() is None:
            if started is None and _marker(out, step).get("pid") == proc.pid:
                started = time.monotonic()
            if started is not None and (_files(out / step) or time.monotonic() - started > wait):
                break
            time.sleep(0.02)
        with contextlib.suppress(ProcessLookupError):  # it may have finished the last steps first
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if _marker(out, step).get("state") == "running":
            killed.append(step)
            partial += [step] if _files(out / step) else []
    kills = {"steps": steps, "killed": killed, "partial": partial}
    (folder / "kills.json").write_text(json.dumps(kills))
    last = _hype_run(out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(last.communicate()[0])
    return last.returncode


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
