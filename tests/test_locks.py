"""One lock per output (`hype.io.lock`): every command that writes an output refuses to start while another
holds it, with the same message; two real processes of `hype reshard`, `download`, `eval`, `convert` and
`submit` on one output: exactly one writes it."""

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

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_convert import _save, meru_yaml, tiny_meru_state_dict  # noqa: F401 - `meru_yaml` is a fixture
from test_download import FAST, _metadata, server, world  # noqa: F401 - `server`, `world` are fixtures
from test_reshard import pool, read_output  # noqa: F401 - `pool` is a fixture
from test_select import table
from test_select_helpers import write_scores
from test_submit import prepared  # noqa: F401 - a fixture

from hype.checkpoint import load_checkpoint, save_checkpoint
from hype.cli import main
from hype.data.uids import save_subset
from hype.io import files
from hype.io.lock import LockError, lock_at, output_lock
from hype.models import create_model
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


@pytest.mark.parametrize("planted", [".world.synth-tmp", ".world.old"])
def test_a_link_planted_where_hype_synth_keeps_a_folder_is_never_followed(tmp_path, planted):
    """`hype synth` builds in `.<out>.synth-tmp` and keeps the world it replaces as `.<out>.old` until the
    new one is in place: a link at either name is refused with one line, its target neither filled nor
    deleted."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("precious\n")
    out = tmp_path / "world"
    if planted == ".world.old":
        out.mkdir()  # a world to replace
    (tmp_path / planted).symlink_to(victim)
    args = ["synth", "--out", str(out), "--size", "8", "--eval-size", "2", "--no-progress", "--overwrite"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output
    assert f"{tmp_path / planted}: a symbolic link where hype creates its own folder;" in res.output
    assert "Traceback" not in res.output and (tmp_path / planted).is_symlink()
    assert [p.name for p in victim.iterdir()] == ["precious.txt"]


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
        ("fit", ["fit", "--scores", str(tmp), "--labels", str(tmp / "l.parquet"), "--out",
                 str(tmp / "w.json")], tmp / "w.json", "--out"),
    ]  # fmt: skip


@pytest.mark.parametrize("case", range(12))
def test_every_command_refuses_an_output_another_holds(tmp_path, case):
    command, args, out, option = _commands(tmp_path)[case]
    with output_lock(out, command):
        res = CliRunner().invoke(main, args)
    assert res.exit_code == 1, res.output
    assert _refusal(out, command, option) in res.output.replace("\n", " ").replace("  ", " ")


def test_a_refused_convert_or_export_answers_before_importing_the_models(tmp_path):
    """The refusal comes before the converters' imports (torch and open_clip, ~6 s on 2 loaded cores): the
    second `hype convert` of a race no longer loads what it will not use."""
    code = (
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "from hype.cli import main\n"
        "from hype.io.lock import output_lock\n"
        "for command, out, args in json.loads(sys.argv[1]):\n"
        "    with output_lock(out, command):\n"
        "        res = CliRunner().invoke(main, args)\n"
        "    assert res.exit_code == 1 and 'is running on this output' in res.output, res.output\n"
        "print(sorted(m for m in ('torch', 'open_clip') if m in sys.modules))\n"
    )
    cases = [(c, str(out), args) for c, args, out, _ in _commands(tmp_path) if c in ("convert", "export")]
    assert len(cases) == 4
    done = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-3000:]


def _hype(*args: str) -> subprocess.Popen:
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


def _race(command: str, out: Path, first: list[str], second: list[str]) -> bytes:
    """`hype COMMAND FIRST` and, while it holds the lock of `out` (paused there, so that the two always
    overlap), `hype COMMAND SECOND` on the same output: the second is refused naming the first, which
    then finishes and releases the lock. Returns the first one's stdout."""
    lock = out.parent / f".{out.name}.lock"
    winner = _hype(command, *first)
    try:
        _wait_for_lock(lock, winner.pid, winner)
        winner.send_signal(signal.SIGSTOP)
        loser = _hype(command, *second)
        _, err = loser.communicate(timeout=120)
        assert loser.returncode == 1, err.decode()
        assert (
            f"{out}: another `hype {command}` (pid {winner.pid}) is running on this output; "
            "wait for it or use another --out"
        ) in " ".join(err.decode().split())
    finally:
        winner.send_signal(signal.SIGCONT)
    stdout, stderr = winner.communicate(timeout=300)
    assert winner.returncode == 0, stderr.decode()[-3000:]
    assert not lock.exists()
    return stdout


def test_two_reshards_on_one_out(pool, tmp_path):  # noqa: F811 - the fixture
    """The second `hype reshard` on an --out the first is writing is refused; the first finishes, and the
    folder holds its samples only."""
    out = tmp_path / "out"
    other = tmp_path / "other.npy"
    save_subset(other, pool["uids"][:40])
    args = ["--pool", str(pool["shards"]), "--out", str(out), "--workers", "1", "--no-progress", "--json"]
    stdout = _race("reshard", out, [*args, "--subset", str(pool["subset"])], [*args, "--subset", str(other)])
    meta = json.loads(stdout)
    got = [json.loads(files["json"])["uid"] for _, files in read_output(out)]
    assert len(got) == meta["output_samples"] and set(got) <= set(pool["list"])
    assert not set(got) & (set(pool["uids"][:40]) - set(pool["list"]))  # none of the second's subset


def test_two_downloads_on_one_out(world, server, tmp_path):  # noqa: F811 - the fixtures
    _, base_url, _ = server
    a, _ = _metadata(world, tmp_path / "all", base_url)
    (tmp_path / "meta").mkdir()
    pq.write_table(a.slice(0, 4), tmp_path / "meta" / "a.parquet")  # four good urls: the smallest download
    out = tmp_path / "out"
    args = ["--metadata", str(tmp_path / "meta"), "--out", str(out), "--allow-private-network", *FAST]
    summary = json.loads(_race("download", out, [*args, "--json"], args))
    assert summary["status"] == "complete" and summary["samples"]["successes"] == 4


def test_two_evals_on_one_out(pool, tmp_path):  # noqa: F811 - the fixture
    torch_model = create_model("tiny-clip")
    ckpt = save_checkpoint(tmp_path / "m.safetensors", torch_model)
    other = save_checkpoint(tmp_path / "other.safetensors", create_model("tiny-euclidean-squared"))
    out = tmp_path / "eval_results.jsonl"
    args = ["--data-dir", str(pool["root"] / "world"), "--out", str(out), "--tasks", "synth/position"]
    args += ["--workers", "0", "--no-progress"]
    _race("eval", out, ["--model", str(ckpt), *args], ["--model", str(other), *args])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["key"] for r in rows] == ["synth/position"]
    assert "tiny-clip" in (tmp_path / "eval_results.jsonl.model.json").read_text()  # the first one's model


def test_two_converts_on_one_out(meru_yaml, tmp_path):  # noqa: F811 - the fixture
    ckpt = _save(tmp_path / "meru.pth", {"model": tiny_meru_state_dict()})
    other = _save(tmp_path / "other.pth", {"model": tiny_meru_state_dict(seed=1)})
    out = tmp_path / "c.safetensors"
    args = ["--out", str(out), "--model-config", str(meru_yaml)]
    _race("convert", out, ["meru", str(ckpt), *args], ["meru", str(other), *args])
    assert load_checkpoint(out).config.name == "tiny-meru"


def test_two_submits_on_one_out(prepared, tmp_path):  # noqa: F811 - the fixture
    p = prepared
    out = tmp_path / "sub"
    args = ["--scale", "small", "--eval-results", str(p["results"]), "--out", str(out), "--no-progress"]
    _race("submit", out, [*args, "--subset", str(p["subset"])], [*args, "--subset", str(tmp_path / "x.npy")])
    assert (out / "small_scale").is_dir()
