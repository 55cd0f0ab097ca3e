"""The suite's long end-to-end runs, started in the background when the session begins.

A few tests only read the outputs of one long run (`hype demo` at the small sizes, the GPU suite's smoke
run, the demo workflow killed in every step): a minute or two of process start-ups, imports and small
trainings that use about one core. Run in the foreground they add their whole time to the suite; started
beside the other tests, they overlap them.
So: a collected test that asks for one of `RUNS`' fixtures starts that run when the session begins (in its
own process group, output to files), the tests that read a run are moved to the end of the session, and the
fixture waits for its run there. A run no collected test needs is never started (`pytest -m "not slow"`,
one file). Every run is stopped by its process group when the session ends, finished or not.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


class BackgroundRun:
    """One command running in its own process group, stdout and stderr to files in `folder`."""

    def __init__(self, cmd: list[str], folder: Path, timeout: float):
        self.folder, self.timeout = folder, timeout
        self.out, self.err = folder / "stdout.log", folder / "stderr.log"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=REPO, start_new_session=True)

    def result(self) -> subprocess.CompletedProcess:
        """Wait for the run (at most `timeout` seconds from now) and return it as `subprocess.run` would."""
        try:
            self.proc.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        text = (p.read_text(errors="replace") for p in (self.out, self.err))
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, *text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


# fixture name -> (the command, given its output folder; seconds allowed once a test waits for it)
RUNS: dict[str, tuple[Callable[[Path], list[str]], float]] = {}


def background_run(name: str, timeout: float):
    """Register `cmd(folder)` as the background run behind fixture `name` (a function's decorator)."""

    def register(cmd: Callable[[Path], list[str]]):
        RUNS[name] = (cmd, timeout)
        return cmd

    return register


def readers_last(items: list[pytest.Item]) -> None:
    """Move the tests that read a background run to the end (a stable sort: each group keeps its order)."""
    items.sort(key=lambda item: bool(RUNS.keys() & set(getattr(item, "fixturenames", ()))))


def _start(name: str, tmp_path_factory: pytest.TempPathFactory) -> BackgroundRun:
    cmd, timeout = RUNS[name]
    folder = tmp_path_factory.mktemp(name)
    return BackgroundRun(cmd(folder), folder, timeout)


@pytest.fixture(scope="session", autouse=True)
def _background_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    wanted = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    runs = {name: _start(name, tmp_path_factory) for name in sorted(wanted & RUNS.keys())}
    try:
        yield runs
    finally:
        for run in runs.values():
            run.stop()


def waited(request: pytest.FixtureRequest, name: str) -> tuple[Path, subprocess.CompletedProcess]:
    """For fixture `name`: its run's output folder and its completed process (waiting for it)."""
    runs = request.getfixturevalue("_background_runs")
    if name not in runs:  # asked for by a test the session did not see at its start: start it now
        runs[name] = _start(name, request.getfixturevalue("tmp_path_factory"))
    return runs[name].folder, runs[name].result()
