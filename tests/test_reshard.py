"""`hype reshard`: DataComp-resharder-compatible output, repeats, resumption, bad input."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import webdataset as wds
from braceexpand import braceexpand
from click.testing import CliRunner
from ray_support import needs_ray, ray_env
from test_select_helpers import make_world, save_memmap_subset

from hype.cli import main
from hype.data.uids import save_subset
from hype.reshard import reshard
from hype.select import SelectError


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    world = make_world(root / "world", size=600)
    truth = pd.read_parquet(world / "truth.parquet")
    uids = list(truth["uid"])
    rng = np.random.default_rng(0)
    picked = list(rng.choice(uids, 150, replace=False))
    subset = picked + picked[:20] + picked[:5] + ["a" * 32, "b" * 32, "b" * 32]  # repeats and absent uids
    save_subset(root / "subset.npy", subset)
    return {
        "root": root,
        "shards": world / "pool" / "shards",
        "subset": root / "subset.npy",
        "list": subset,
        "uids": uids,
    }


def members_by_uid(shards: Path) -> dict[str, dict[str, bytes]]:
    """Independent reading of the pool with tarfile: uid -> {suffix: bytes}."""
    out = {}
    for tar_path in sorted(shards.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            samples: dict[str, dict[str, bytes]] = {}
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
        for files in samples.values():
            out[json.loads(files["json"])["uid"]] = files
    return out


def read_output(out: Path) -> list[tuple[str, dict[str, bytes]]]:
    samples = []
    for tar_path in sorted(out.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                if not samples or samples[-1][0] != key:
                    samples.append((key, {}))
                samples[-1][1][ext] = tar.extractfile(m).read()
    return samples


def test_output_matches_datacomp_resharder(pool, tmp_path):
    out = tmp_path / "out"
    meta = reshard(pool["shards"], pool["subset"], out, shard_size=64, workers=2, progress=False)
    source = members_by_uid(pool["shards"])
    expected = Counter(u for u in pool["list"] if u in source)
    got = read_output(out)
    # Each pool sample once per occurrence of its uid, keyed <uid>-<j>, members copied byte for byte.
    assert Counter(json.loads(f["json"])["uid"] for _, f in got) == expected
    for key, files in got:
        uid, j = key.rsplit("-", 1)
        assert int(j) < expected[uid]
        assert files == source[uid]
        assert list(files) == sorted(files)  # suffix order, as webdataset's TarWriter writes them
    assert sorted(k for k, _ in got) == sorted(f"{u}-{j}" for u, c in expected.items() for j in range(c))
    # Shards of --shard-size samples (the last one shorter), each with its _stats.json.
    n = sum(expected.values())
    sizes = [
        json.loads((out / f"{k:08d}_stats.json").read_text())["successes"]
        for k in range(meta["output_shards"])
    ]
    assert sizes == [64] * (n // 64) + ([n % 64] if n % 64 else [])
    assert meta["output_samples"] == n and meta["matched_samples"] == 150 and meta["missing_uids"] == 2
    assert meta["missing_rows"] == 3 and meta["subset_rows"] == len(pool["list"]) and meta["verified"]
    assert json.loads((out / "meta.json").read_text())["output_samples"] == n
    assert not (out / ".reshard").exists()
    # webdataset (what open_clip / DataComp training use) reads it.
    ds = wds.WebDataset(sorted(str(p) for p in out.glob("*.tar")), shardshuffle=False)
    assert sum(1 for _ in ds) == n


def test_a_raw_memmap_subset_gives_the_same_shards(pool, tmp_path):
    """DataComp's other subset layout (raw 'u8,u8' records, no .npy header) reshards to the same bytes."""
    raw = save_memmap_subset(tmp_path / "subset.memmap", pool["list"])
    a = reshard(pool["shards"], pool["subset"], tmp_path / "npy", shard_size=100, workers=1, progress=False)
    b = reshard(pool["shards"], raw, tmp_path / "raw", shard_size=100, workers=1, progress=False)
    assert a["output_shards"] == b["output_shards"] == 2 and b["subset_rows"] == len(pool["list"])
    names = sorted(p.name for p in (tmp_path / "npy").glob("0*"))
    assert names == sorted(p.name for p in (tmp_path / "raw").glob("0*")) and len(names) == 4
    assert all((tmp_path / "npy" / n).read_bytes() == (tmp_path / "raw" / n).read_bytes() for n in names)


def datacomp_train_data(data_dir: Path) -> list[str]:
    """What DataComp's train.py (`get_input_shards`, mlfoundations/datacomp train.py) trains on for a
    subfolder of --data_dir holding a meta.json: the brace pattern built from its two keys, expanded."""
    patterns = []
    for sub in data_dir.iterdir():
        if sub.is_dir() and (sub / "meta.json").exists():
            metadata = json.loads((sub / "meta.json").read_text())
            shard_count = metadata["output_shard_count"]
            shard_format = metadata["output_shard_format"]
            first = shard_format.format(0).replace(".tar", "")
            last = shard_format.format(shard_count - 1).replace(".tar", "")
            patterns.append(str(sub / f"{{{first}..{last}}}.tar"))
    return [p for pattern in patterns for p in braceexpand(pattern)]


def test_meta_json_gives_datacomp_train_the_shards_on_disk(pool, tmp_path):
    out = tmp_path / "data" / "hype"
    meta = reshard(pool["shards"], pool["subset"], out, shard_size=64, workers=1, progress=False)
    tars = sorted(str(p) for p in out.glob("*.tar"))
    assert len(tars) == 3 and datacomp_train_data(tmp_path / "data") == tars
    # The values DataComp's resharder writes: its shard count, its default --output-shard-format.
    assert meta["output_shard_count"] == 3 and meta["output_shard_format"] == "{:08d}.tar"
    # A folder finished by an older hype gets the keys when the same job is run again.
    saved = json.loads((out / "meta.json").read_text())
    old = {k: v for k, v in saved.items() if not k.startswith("output_shard_")}
    (out / "meta.json").write_text(json.dumps(old))
    again = reshard(pool["shards"], pool["subset"], out, shard_size=64, workers=1, progress=False)
    assert again["resumed"] == "already complete"
    assert (
        json.loads((out / "meta.json").read_text()) == saved
        and datacomp_train_data(tmp_path / "data") == tars
    )


def test_resume_after_an_interruption_is_byte_identical(pool, tmp_path, monkeypatch):
    import hype.reshard.run as run

    reference = tmp_path / "reference"
    full = reshard(pool["shards"], pool["subset"], reference, shard_size=50, workers=1, progress=False)
    assert full["output_shards"] == 4
    real = run._write_job

    def dies_at_shard_2(out, k, *job):
        if k == 2:
            raise KeyboardInterrupt
        return real(out, k, *job)

    out = tmp_path / "out"
    monkeypatch.setattr(run, "_write_job", dies_at_shard_2)
    with pytest.raises(KeyboardInterrupt):
        reshard(pool["shards"], pool["subset"], out, shard_size=50, workers=1, progress=False)
    assert not (out / "meta.json").exists() and (out / "00000001_stats.json").exists()
    monkeypatch.setattr(run, "_write_job", real)
    resumed = reshard(pool["shards"], pool["subset"], out, shard_size=50, workers=2, progress=False)
    assert resumed["shards_written"] == 2 and resumed["shards_resumed"] == 2
    names = sorted(p.name for p in reference.glob("0*"))
    assert names == sorted(p.name for p in out.glob("0*"))
    assert all((out / n).read_bytes() == (reference / n).read_bytes() for n in names)
    again = reshard(pool["shards"], pool["subset"], out, shard_size=50, workers=1, progress=False)
    assert again["resumed"] == "already complete"


def test_a_rerun_redoes_exactly_the_shards_a_changed_input_feeds(pool, tmp_path):
    out = tmp_path / "out"
    first = reshard(pool["shards"], pool["subset"], out, shard_size=50, workers=1, progress=False)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("0*")}
    again = reshard(pool["shards"], pool["subset"], out, shard_size=50, workers=1, progress=False)
    assert again["resumed"] == "already complete" and again["fingerprint"] == first["fingerprint"]
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("0*")} == before
    # The last input tar rewritten (same bytes, new mtime: its identity changed): the shards it feeds are
    # written again, the others are kept, and the output is the same.
    last = sorted(Path(pool["shards"]).glob("*.tar"))[-1]
    copy = tmp_path / "pool"
    shutil.copytree(pool["shards"], copy)
    first = reshard(copy, pool["subset"], out, shard_size=50, workers=1, progress=False, overwrite=True)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("0*")}
    stat = (copy / last.name).stat()
    os.utime(copy / last.name, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    redone = reshard(copy, pool["subset"], out, shard_size=50, workers=1, progress=False)
    assert redone["fingerprint"] != first["fingerprint"] and "resumed" not in redone
    assert redone["shards_written"] >= 1 and redone["shards_resumed"] >= 1
    after = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.glob("0*")}
    assert {n: b for n, (_, b) in after.items() if n.endswith(".tar")} == {
        n: b for n, (_, b) in before.items() if n.endswith(".tar")
    }
    changed = sorted(n for n in after if after[n][0] != before[n][0] and n.endswith(".tar"))
    assert len(changed) == redone["shards_written"] and changed[-1] == f"{first['output_shards'] - 1:08d}.tar"


def test_refuses_to_mix_jobs(pool, tmp_path):
    out = tmp_path / "out"
    reshard(pool["shards"], pool["subset"], out, shard_size=100, workers=1, progress=False)
    other = tmp_path / "other.npy"
    save_subset(other, pool["uids"][:10])
    with pytest.raises(SelectError, match="--overwrite"):
        reshard(pool["shards"], other, out, shard_size=100, workers=1, progress=False)
    meta = reshard(pool["shards"], other, out, shard_size=100, workers=1, overwrite=True, progress=False)
    assert meta["output_samples"] == 10 and len(list(out.glob("*.tar"))) == 1


def test_bad_samples_are_skipped_and_counted(pool, tmp_path):
    shards = tmp_path / "shards"
    shutil.copytree(pool["shards"], shards)
    # Shard 0: one sample's json replaced by garbage, one sample without json; shard 2: cut in half.
    src = shards / "00000000.tar"
    with tarfile.open(src) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(src, "w") as tar:
        for m, data in members:
            if m.name == "000000000.json":
                data = b"{not json"
            if m.name == "000000001.json":
                continue
            info = tarfile.TarInfo(m.name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    # Cut inside the .json of a sample near the middle (not at a fixed byte fraction: where the half falls
    # depends on the members' sizes).
    last = shards / "00000002.tar"
    with tarfile.open(last) as tar:
        jsons = [m for m in tar.getmembers() if m.name.endswith(".json")]
    cut = jsons[len(jsons) // 2]
    last.write_bytes(last.read_bytes()[: cut.offset_data + cut.size // 2])
    save_subset(tmp_path / "all.npy", pool["uids"])
    meta = reshard(shards, tmp_path / "all.npy", tmp_path / "out", shard_size=1000, workers=1, progress=False)
    counts = meta["skipped"]["counts"]
    # Two damaged samples in shard 0, plus the sample whose .json was cut off in shard 2.
    assert (
        counts["bad_json"] == 3 and counts.get("truncated_member", 0) + counts.get("unreadable_shard", 0) >= 1
    )
    examples = " ".join(meta["skipped"]["examples"]["bad_json"])
    assert "000000000" in examples and "000000001: no .json member" in examples
    assert 256 + 256 - 2 <= meta["output_samples"] < 600 - 2
    assert meta["missing_uids"] == 600 - meta["output_samples"]


def test_cli_and_errors(pool, tmp_path):
    res = CliRunner().invoke(
        main,
        [
            "reshard",
            "--pool",
            str(pool["shards"]),
            "--subset",
            str(pool["subset"]),
            "--out",
            str(tmp_path / "o"),
            "--shard-size",
            "1000",
            "--workers",
            "1",
            "--no-progress",
        ],
    )
    assert res.exit_code == 0, res.output
    assert "resharded 175 samples" in res.output and "2 not in the pool" in res.output
    save_subset(tmp_path / "stranger.npy", ["c" * 32])
    for args, message in [
        (["--subset", str(tmp_path / "stranger.npy")], "none of the 1 uids"),
        (["--subset", str(tmp_path / "missing.npy")], "subset file not found"),
        (["--pool", str(tmp_path / "nowhere")], "no such file or folder"),
        (["--shard-size", "0"], "--shard-size must be >= 1"),
        (["--ray-address", "127.0.0.1:1"], "it is for --executor ray"),
    ]:
        base = {"--pool": str(pool["shards"]), "--subset": str(pool["subset"]), "--out": str(tmp_path / "e")}
        base.update(dict(zip(args[::2], args[1::2], strict=True)))
        res = CliRunner().invoke(main, ["reshard", *[x for kv in base.items() for x in kv], "--no-progress"])
        assert res.exit_code == 2 and message in res.output, res.output


@needs_ray
def test_the_ray_executor_writes_the_local_runs_bytes(pool, tmp_path, ray_cluster):
    """Both passes on a two-node Ray cluster, from another folder than the workers' (a relative --out):
    the same tars and markers as the in-process run."""
    local = reshard(
        pool["shards"], pool["subset"], tmp_path / "local", shard_size=50, workers=1, progress=False
    )
    args = ["reshard", "--pool", str(pool["shards"]), "--subset", str(pool["subset"]), "--out", "ray"]
    args += [
        "--shard-size",
        "50",
        "--executor",
        "ray",
        "--ray-address",
        ray_cluster,
        "--no-progress",
        "--json",
    ]
    done = subprocess.run(
        [sys.executable, "-c", "from hype.cli import main; main()", *args],
        cwd=tmp_path, env=ray_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    meta = json.loads(done.stdout)
    assert meta["executor"] == "ray" and local["executor"] == "local"
    assert meta["shards_written"] == local["output_shards"] == 4
    names = sorted(p.name for p in (tmp_path / "local").glob("0*"))
    assert names == sorted(p.name for p in (tmp_path / "ray").glob("0*"))
    assert all((tmp_path / "ray" / n).read_bytes() == (tmp_path / "local" / n).read_bytes() for n in names)
    same = ("seconds", "executor")
    assert {k: v for k, v in meta.items() if k not in same} == {
        k: v for k, v in local.items() if k not in same
    }


def _tiny_pool(folder: Path, uids_per_tar: list[list]) -> Path:
    """Pool tars whose samples carry the given json uids (any value), in order."""
    from test_train_data import _jpeg, write_shard

    for t, uids in enumerate(uids_per_tar):
        samples = [
            {"jpg": _jpeg((40 * t, 9 * i, 0)), "txt": f"{t} {i}", "json": {"uid": u}}
            for i, u in enumerate(uids)
        ]
        write_shard(folder / f"{t:08d}.tar", samples, parquet=False)
    return folder


def _webdataset_keys(out: Path) -> list[str]:
    """Keys of the output as webdataset reads it (it raises on a key repeated within a tar)."""
    ds = wds.WebDataset(sorted(str(p) for p in out.glob("*.tar")), shardshuffle=False)
    return [s["__key__"] for s in ds]


def test_a_uid_found_twice_in_the_pool_gets_distinct_keys(tmp_path):
    a, b, c, d = (f"{i:032x}" for i in (10, 11, 12, 13))
    shards = _tiny_pool(tmp_path / "pool", [[a, b, b, c], [b, d]])  # b twice in a tar, and in another tar
    for rows, copies in (([b], 3), ([b, b], 6)):
        save_subset(tmp_path / "s.npy", rows)
        out = tmp_path / f"out{copies}"
        meta = reshard(shards, tmp_path / "s.npy", out, shard_size=100, workers=1, progress=False)
        assert meta["output_samples"] == copies and meta["duplicate_pool_uids"] == 2
        assert _webdataset_keys(out) == [f"{b}-{j}" for j in range(copies)]
        # Copies in pool order, the same sample's copies together: (tar 0, 2nd), (tar 0, 3rd), (tar 1, 1st).
        captions = [f["txt"].decode() for _, f in read_output(out)]
        per = copies // 3
        assert captions == ["0 1"] * per + ["0 2"] * per + ["1 0"] * per


def test_odd_uids_are_written_canonical_or_skipped_with_a_reason(tmp_path):
    u = [f"{i:032x}" for i in range(1, 8)]
    full_width = "12345678901234567890123456789012".translate(
        str.maketrans("0123456789", "０１２３４５６７８９")
    )
    values = [u[0], "0" * 80 + u[1], full_width, f" {u[3].upper()}\n", "0x" + u[4], "B" * 32, u[6]]
    shards = _tiny_pool(tmp_path / "pool", [values])
    save_subset(tmp_path / "s.npy", [*u, "12345678901234567890123456789012", "b" * 32])
    out = tmp_path / "out"
    meta = reshard(shards, tmp_path / "s.npy", out, shard_size=100, workers=1, progress=False)
    assert _webdataset_keys(out) == [f"{x}-0" for x in (u[0], u[3], "b" * 32, u[6])]
    assert meta["skipped"]["counts"] == {"bad_uid": 3}
    assert any("0x" in m for m in meta["skipped"]["examples"]["bad_uid"])
    with tarfile.open(next(out.glob("*.tar"))) as tar:
        names = tar.getnames()
    assert all(len(n.split(".")[0]) == 34 and n.isascii() and n.isprintable() for n in names)
