"""The run contract (hype.io.runs): one fingerprint, input identity, the path rule, markers, the lock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hype.io import location, runs
from hype.io.runs import (
    Marker,
    absolute,
    fingerprint,
    identity_kind,
    input_identity,
    is_done,
    legacy_fingerprint,
    legacy_identity,
    write_marker,
)
from hype.scoring import rundir

ROOT = Path(__file__).resolve().parents[1]


def test_pre_contract_markers_are_read_in_one_place():
    # What hype's readers of markers written before the run contract (reshard, run, eval) compare with:
    # sha256 of the JSON, keys sorted or in order as each command wrote it; an identity without fingerprint.
    job = {"b": [1, 2], "a": "x"}
    assert (
        legacy_fingerprint(job, sort_keys=True)
        == "5125d018f84d57c49a8d3c2cfa6063d23cc3f4cd7ff13f4fdedfa2c1d3162f30"
    )
    assert (
        legacy_fingerprint(job, sort_keys=False)
        == "cd6bcdba65ff2de806c2823235dae75287d6d3277ba01ef70ff05c67a7be6758"
    )
    assert legacy_identity(job) == {"model": job, "fingerprint": fingerprint(job)}
    assert legacy_identity({"fingerprint": "f"}) == {"fingerprint": "f"} and legacy_identity(None) is None


def test_fingerprint_matches_markers_written_before_the_contract():
    # The values hype 0.x's scoring wrote in run folders that exist today (hype.scoring.rundir before the
    # contract moved to core): a different algorithm or serialisation would redo every finished output.
    described = {
        "input": {"path": "/data/pool/00000000.tar", "size": 123456, "mtime_ns": 1700000000123456789},
        "model": {"digest": "ab" * 16},
        "batch": 256,
    }
    assert runs.RUN_DIGEST == "blake2b-128"
    assert fingerprint(described) == "faddf646bb792e7c8fe8ee2fbcad5fc7"
    assert rundir.fingerprint is fingerprint and rundir.file_identity is input_identity
    assert rundir.shard_id("/data/pool/00000000.tar") == "00000000-726e8808"
    assert rundir.shard_id("s3://b/pool/00000001.tar") == "00000001-5d5ff24f"


def test_fingerprint_is_the_same_in_another_process():
    obj = {"b": [1, 2.5, "x"], "a": {"z": None, "y": True}, "path": Path("/p")}
    code = (
        "import json, sys; from pathlib import Path; from hype.io.runs import fingerprint; "
        "o = json.loads(sys.argv[1]); o['path'] = Path(o['path']); print(fingerprint(o))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "PYTHONHASHSEED": "12345",
    }
    arg = json.dumps({**obj, "path": "/p"})
    other = subprocess.run([sys.executable, "-c", code, arg], env=env, capture_output=True, text=True)
    assert other.returncode == 0, other.stderr
    assert other.stdout.strip() == fingerprint(obj)
    assert fingerprint({**obj, "b": [1, 2.5, "y"]}) != fingerprint(obj)  # one setting changed


def test_input_identity_changes_with_the_file_and_names_its_kind(tmp_path):
    f = tmp_path / "a.tar"
    f.write_bytes(b"abc")
    first = input_identity(f)
    assert first == {"path": str(f.resolve()), "size": 3, "mtime_ns": f.stat().st_mtime_ns}
    assert identity_kind(first) == "size+mtime"
    assert input_identity(tmp_path / "." / "a.tar") == first  # one file, one identity
    f.write_bytes(b"xyz")  # same size, rewritten
    os.utime(f, ns=(first["mtime_ns"] + 10**9, first["mtime_ns"] + 10**9))
    assert input_identity(f) != first
    f.unlink()
    gone = input_identity(f)
    assert gone == {"path": str(f.resolve()), "missing": True} and identity_kind(gone) == "missing"
    assert identity_kind({"path": "s3://b/k", "size": 3, "etag": '"e"'}) == "etag"


def test_absolute_is_the_one_path_rule(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert absolute("link/x.tar") == str(tmp_path.resolve() / "real" / "x.tar")
    assert absolute("s3://bucket/a/../b.tar") == "s3://bucket/a/../b.tar"  # a URL as given
    assert absolute(location("s3://bucket/a/b.tar")) == "s3://bucket/a/b.tar"  # also a bucket's path object
    assert rundir.ShardTask(0, "link/x.tar", "x").source == absolute("link/x.tar")


def test_a_shard_pattern_is_made_absolute_by_the_same_rule(tmp_path, monkeypatch):
    """What a run's config.yaml records for --pool: each local part absolute up to its pattern, which
    names the same shards from any folder; URLs as given."""
    from hype.data.shards import absolute_spec, expand_shards

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for i in range(3):
        (tmp_path / "real" / f"{i:02d}.tar").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    spec = "link/{00..01}.tar::./link/*.tar::s3://b/p/{0..1}.tar"
    recorded = absolute_spec(spec)
    real = str(tmp_path.resolve() / "real")
    assert recorded == f"{real}/{{00..01}}.tar::{real}/*.tar::s3://b/p/{{0..1}}.tar"
    local = "::".join(recorded.split("::")[:2])
    monkeypatch.chdir(tmp_path / "real")
    assert expand_shards(local).paths == [f"{real}/{n}.tar" for n in ("00", "01", "00", "01", "02")]


def test_marker_is_done_only_with_its_fingerprint_and_state(tmp_path):
    path = tmp_path / "out" / "done.json"
    m = Marker(path)
    assert m.done("fp") is None  # no marker: to do
    m.begin("fp", pid=1)
    assert m.done("fp") is None  # under way (or killed): redone
    record = write_marker(path, "fp", rows=3)
    assert record == {"rows": 3, "state": "done", "fingerprint": "fp"}
    assert is_done(path, "fp") == record and is_done(path, "other") is None
    assert [p.name for p in path.parent.iterdir()] == ["done.json"]  # written atomically: no temporary
    path.write_text(json.dumps(record)[:-5])  # a marker cut short counts as absent
    assert is_done(path, "fp") is None
    path.write_text(json.dumps({"fingerprint": "fp", "count": 1}))  # scoring's markers carry no state
    assert is_done(path, "fp") == {"fingerprint": "fp", "count": 1}
    m.clear()
    assert not path.exists()


def test_the_lock_is_taken_from_the_contract(tmp_path):
    out = tmp_path / "o"
    with runs.output_lock(out, "reshard"):
        with pytest.raises(runs.LockError, match="another `hype reshard`"):
            with runs.output_lock(tmp_path / "." / "o", "train"):
                pass
    with runs.output_lock(out, "train"):  # released
        pass
