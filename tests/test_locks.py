"""One lock per output (`hype.io.lock`): every command that writes an output refuses to start while another
holds it, with the same message; two real `hype reshard` processes on one --out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from test_reshard import pool, read_output  # noqa: F401 - `pool` is a fixture
from test_select import table
from test_select_helpers import write_scores

from hype.cli import main
from hype.data.uids import save_subset
from hype.io import files
from hype.io.lock import LockError, lock_at, output_lock
from hype.scoring.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]


def _refusal(out: Path, command: str, option: str = "--out") -> str:
    return (
        f"{out}: another `hype {command}` (pid {os.getpid()}) is running on this output; "
        f"wait for it or use another {option}"
    )


def test_a_held_output_is_refused_and_released(tmp_path):
    out = tmp_path / "shards"
    with output_lock(out, "reshard"):
        lock = tmp_path / ".shards.lock"
        assert json.loads(lock.read_text())["command"] == "reshard" and not out.exists()
        # also under another spelling of the same path
        for other in (out, tmp_path / "." / "shards", Path(os.path.relpath(out))):
            with pytest.raises(LockError) as e, output_lock(other, "train"):
                pass
            assert str(e.value) == _refusal(other, "reshard")
    assert not lock.exists()  # released and removed: nothing left beside the output
    with output_lock(out, "train"):
        pass


def test_score_keeps_its_lock_and_message(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    with run.lock():
        with pytest.raises(LockError) as e, RunDir(tmp_path / "run").lock():
            pass
    assert str(e.value) == (
        f"{tmp_path / 'run'}: another `hype score` (pid {os.getpid()}) is running on this run directory; "
        "wait for it or use another --out"
    )
    with lock_at(tmp_path / "run" / ".lock", "x", "score"):  # released
        pass


@pytest.mark.parametrize("planted", ["lock symlink", "lock hard link", "temporary symlink"])
def test_a_link_planted_where_hype_creates_a_file_is_never_written_through(tmp_path, monkeypatch, planted):
    """A link at the lock's or a temporary's name (another user of a shared folder) is refused with one
    line, and neither the link nor the file it points at is touched; the output is not written."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    write_scores(table(40), tmp_path / "run", parts=1)
    out = tmp_path / "subset.npy"
    if planted == "temporary symlink":  # a temporary's name guessed: its random part made predictable
        monkeypatch.setattr(files, "uuid", SimpleNamespace(uuid4=lambda: uuid.UUID(int=0)))
        link = files.temp_name(out)
    else:
        link = tmp_path / ".subset.npy.lock"
    if planted == "lock hard link":
        os.link(victim, link)
    else:
        link.symlink_to(victim)
    args = ["select", "--scores", str(tmp_path / "run"), "--frac", "0.5", "--out", str(out), "--no-progress"]
    res = CliRunner().invoke(main, args)
    assert victim.read_text() == "precious\n" and (link.is_symlink() or link.samefile(victim))
    assert res.exit_code == 1, res.output
    what = "a hard link to another file" if planted == "lock hard link" else "a symbolic link"
    assert f"{link}: {what} where hype creates its own file; it was left untouched." in res.output
    assert "Remove it (hype did not create it) and run again" in res.output
    assert "Traceback" not in res.output and not out.exists()


def _commands(tmp: Path) -> list[tuple[str, list[str], Path, str]]:
    """(command, arguments, output, option naming it) of every command that writes an output; inputs
    need not exist: the lock is taken before they are read."""
    model = tmp / "model.safetensors"
    model.write_bytes(b"not read")
    out = tmp / "out"
    return [
        ("download", ["download", "--metadata", str(tmp / "meta"), "--out", str(out)], out, "--out"),
        ("train", ["train", "--config", "tiny-hyperbolic", "--data", str(tmp), "--out", str(out)], out,
         "--out"),
        ("eval", ["eval", "--model", str(model), "--data-dir", str(tmp), "--out", str(tmp / "r.jsonl")],
         tmp / "r.jsonl", "--out"),
        ("select", ["select", "--scores", str(tmp), "--frac", "0.5", "--out", str(tmp / "s.npy")],
         tmp / "s.npy", "--out"),
        ("reshard", ["reshard", "--pool", str(tmp), "--subset", str(tmp / "s.npy"), "--out", str(out)],
         out, "--out"),
        ("report", ["report", "--scores", str(tmp), "--out", str(tmp / "r.html")], tmp / "r.html", "--out"),
        ("submit", ["submit", "--scale", "small", "--subset", str(tmp / "s.npy"), "--eval-results",
                    str(tmp / "r.jsonl"), "--out", str(out)], out, "--out"),
        ("convert", ["convert", "meru", str(tmp / "m.pth"), "--out", str(tmp / "c.safetensors")],
         tmp / "c.safetensors", "--out"),
        ("convert", ["convert", "hype-release", str(tmp / "m.pt"), "--out", str(tmp / "c.safetensors")],
         tmp / "c.safetensors", "--out"),
        ("convert", ["convert", "open-clip", str(model), "--out", str(tmp / "c.safetensors")],
         tmp / "c.safetensors", "--out"),
        ("export", ["export", str(model), str(out)], out, "OUT"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(11))
def test_every_command_refuses_an_output_another_holds(tmp_path, case):
    command, args, out, option = _commands(tmp_path)[case]
    with output_lock(out, command):
        res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output
    assert _refusal(out, command, option) in res.output.replace("\n", " ").replace("  ", " ")


def _reshard(shards: Path, subset: Path, out: Path) -> subprocess.Popen:
    args = ["reshard", "--pool", str(shards), "--subset", str(subset), "--out", str(out)]
    args += ["--workers", "1", "--no-progress", "--json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-m", "hype.cli", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )


def _wait_for_lock(lock: Path, pid: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if json.loads(lock.read_text()).get("pid") == pid:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.005)
    raise AssertionError(f"{lock}: pid {pid} never took the lock ({proc.poll()=})")


def test_two_reshards_on_one_out(pool, tmp_path):  # noqa: F811 - the fixture
    """The second `hype reshard` on an --out the first is writing is refused (here the first is paused
    while it holds the lock, so the two always overlap); the first finishes, and the folder holds its
    samples only."""
    out = tmp_path / "out"
    other = tmp_path / "other.npy"
    save_subset(other, pool["uids"][:40])
    first = _reshard(pool["shards"], pool["subset"], out)
    try:
        _wait_for_lock(tmp_path / ".out.lock", first.pid, first)
        first.send_signal(signal.SIGSTOP)
        second = _reshard(pool["shards"], other, out)
        _, err = second.communicate(timeout=120)
        assert second.returncode == 1
        assert (
            f"{out}: another `hype reshard` (pid {first.pid}) is running on this output; "
            "wait for it or use another --out"
        ) in err.decode()
    finally:
        first.send_signal(signal.SIGCONT)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr.decode()
    meta = json.loads(stdout)
    got = [json.loads(files["json"])["uid"] for _, files in read_output(out)]
    assert len(got) == meta["output_samples"] and set(got) <= set(pool["list"])
    assert not set(got) & (set(pool["uids"][:40]) - set(pool["list"]))  # none of the second's subset
    assert not (tmp_path / ".out.lock").exists()
