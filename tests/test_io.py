"""hype.io: atomic writes (also under SIGKILL), tolerant JSON, digests, and the tar reader and writer."""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from webdataset.tariterators import base_plus_ext

import hype.io as hio
from hype.io.tar import (
    MISSING_SHARD,
    TRUNCATED,
    UNREADABLE_SHARD,
    group_members,
    index_samples,
    read_samples,
    split_member_name,
    write_tar,
)

REPO = Path(__file__).resolve().parents[1]


class Problems:
    """What a reader reported, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def add(self, reason: str, message: str) -> None:
        self.seen.append((reason, message))

    @property
    def reasons(self) -> list[str]:
        return [r for r, _ in self.seen]


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if hio.is_temp_name(p.name))


# --- atomic writes --------------------------------------------------------------------------------


_KILLED_WRITER = """
import sys, time
from hype.io import atomic_write
with atomic_write(sys.argv[1]) as f:
    f.write(b"new, half written")
    f.flush()
    print("writing", flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("old", [b"old content", None])
def test_a_writer_killed_mid_write_leaves_the_old_file_or_nothing(tmp_path, old):
    target = tmp_path / "out.bin"
    if old is not None:
        target.write_bytes(old)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(target)], stdout=subprocess.PIPE, env=env
    )
    assert child.stdout is not None and child.stdout.readline() == b"writing\n"
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    if old is None:
        assert not target.exists()
    else:
        assert target.read_bytes() == old
    # A killed writer cannot clean up: its temporary is recognisable, for the next run to delete.
    (left,) = _temps(tmp_path)
    assert left.startswith(".out.bin.tmp-") and (tmp_path / left).read_bytes() == b"new, half written"


def test_an_error_inside_the_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "sub" / "x.json"
    hio.write_json(target, {"v": 1})
    with pytest.raises(RuntimeError, match="boom"), hio.atomic_write(target) as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    assert json.loads(target.read_text()) == {"v": 1} and _temps(target.parent) == []
    with pytest.raises(RuntimeError), hio.atomic_path(target) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("boom")
    assert json.loads(target.read_text()) == {"v": 1} and _temps(target.parent) == []


def _record_syncs(monkeypatch, events: list[str]) -> None:
    """Wrap os.fsync and os.replace to record, in order, what was synced (`fsync file NAME`, `fsync dir
    NAME`) and renamed (`replace NAME`)."""
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        events.append(f"fsync {kind} {Path(os.readlink(f'/proc/self/fd/{fd}')).name}")
        return real_fsync(fd)

    def replace(src, dst):
        events.append(f"replace {Path(dst).name}")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)


def test_writes_are_fsynced_before_the_rename_and_their_folder_after(tmp_path, monkeypatch):
    """A power cut after a write returned keeps the file: its bytes are on disk before the rename, and the
    rename itself (the folder's entry) after it."""
    events: list[str] = []
    _record_syncs(monkeypatch, events)
    hio.write_bytes(tmp_path / "a", b"a")
    with hio.atomic_path(tmp_path / "b") as tmp:
        tmp.write_bytes(b"b")
    folder = tmp_path.name
    assert [e.split(".a.tmp-")[0].split(".b.tmp-")[0] for e in events] == [
        "fsync file ", "replace a", f"fsync dir {folder}", "fsync file ", "replace b", f"fsync dir {folder}"
    ]  # fmt: skip


def test_folders_created_for_a_write_are_synced_into_their_parents(tmp_path, monkeypatch):
    events: list[str] = []
    _record_syncs(monkeypatch, events)
    hio.write_bytes(tmp_path / "new" / "deeper" / "a", b"a")
    assert (tmp_path / "new" / "deeper" / "a").read_bytes() == b"a"
    dirs = [e for e in events if e.startswith("fsync dir")]
    # each new folder's entry, then the file's
    assert dirs == [f"fsync dir {tmp_path.name}", "fsync dir new", "fsync dir deeper"]
    events.clear()
    src = tmp_path / "tree.tmp"
    src.mkdir()
    hio.replace_tree(src, tmp_path / "tree")
    assert events == [f"fsync dir {tmp_path.name}"]


def test_files_get_the_default_mode_even_when_a_library_creates_them_0600(tmp_path):
    want = 0o666 & ~_umask()
    hio.write_text(tmp_path / "t.txt", "x")
    with hio.atomic_path(tmp_path / "s.bin") as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors does
        os.write(fd, b"s")
        os.close(fd)
    for name in ("t.txt", "s.bin"):
        assert (tmp_path / name).stat().st_mode & 0o777 == want


def test_format_helpers_write_what_their_libraries_write(tmp_path):
    obj = {"b": [1, 2.5], "a": "é", "n": None}
    hio.write_json(tmp_path / "s.json", obj)
    assert (tmp_path / "s.json").read_text() == json.dumps(obj, indent=2, sort_keys=True) + "\n"
    hio.write_json(tmp_path / "u.json", obj, sort_keys=False, ensure_ascii=False)
    assert (tmp_path / "u.json").read_bytes() == (
        json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    ).encode()
    table = pa.table({"x": [1, 2, 3], "s": ["a", "b", None]})
    hio.write_parquet(tmp_path / "t.parquet", table, compression="zstd")
    pq.write_table(table, tmp_path / "ref.parquet", compression="zstd")
    assert (tmp_path / "t.parquet").read_bytes() == (tmp_path / "ref.parquet").read_bytes()
    assert (tmp_path / "t.parquet").read_bytes() == hio.parquet_bytes(table, compression="zstd")
    arr = np.arange(6, dtype="u8").reshape(2, 3)
    hio.save_npy(tmp_path / "a.npy", arr)
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    assert (tmp_path / "a.npy").read_bytes() == buf.getvalue()
    assert _temps(tmp_path) == []


def test_replace_tree_swaps_a_finished_folder_in(tmp_path):
    out, new = tmp_path / "world", tmp_path / ".world.tmp"
    for folder, text in ((out, "old"), (new, "new")):
        folder.mkdir()
        (folder / "f").write_text(text)
    hio.replace_tree(new, out)
    assert (out / "f").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["world"]


# --- reads and digests ----------------------------------------------------------------------------


def test_read_json_is_tolerant(tmp_path):
    p = tmp_path / "m.json"
    assert hio.read_json(p) is None  # missing
    p.write_text('{"a": 1, "b"')
    assert hio.read_json(p) is None  # cut short
    p.write_bytes(b'{"a": "\xff"}')
    assert hio.read_json(p) is None  # not UTF-8
    p.write_text("[1, 2]")
    assert hio.read_json(p) is None  # not an object
    p.write_text('{"a": 1}')
    assert hio.read_json(p) == {"a": 1}
    assert hio.read_json(tmp_path) is None  # a folder


def test_digests(tmp_path):
    data = os.urandom(3 << 20) + b"tail"
    p = tmp_path / "blob"
    p.write_bytes(data)
    chunks = [data[:7], data[7:]]
    sha = hashlib.sha256(data).hexdigest()
    assert hio.sha256_file(p) == sha == hio.sha256_bytes(data) == hio.sha256_chunks(chunks)
    b2 = hashlib.blake2b(data, digest_size=16).hexdigest()
    assert hio.blake2b128_file(p) == b2 == hio.blake2b128_bytes(data) == hio.blake2b128_chunks(chunks)
    # The values records hold today (markers, shard ids, reshard's state names): pinned, so that no
    # rename changes which algorithm a record uses.
    assert hio.sha256_bytes(b"hype") == "6b29a986309021ea56691b14f10e989f0686cc0b042b4136d058b3ffee1caaeb"
    assert hio.blake2b128_bytes(b"hype") == "96e27286709d5b12d70aea1f5e757781"
    assert hio.blake2b32_bytes(b"hype") == "0aad5a28"
    assert hio.sha1_bytes(b"hype") == "8acd66d716c8e70c78484722a739787651780611"


def test_digests_live_in_one_module():
    # One digest module, one name per algorithm (DESIGN §9): nothing else in hype imports hashlib.
    root = Path(hio.__file__).parents[1]
    users = [p.relative_to(root) for p in root.rglob("*.py") if "import hashlib" in p.read_text()]
    assert [str(p) for p in users] == ["io/digests.py"]


def test_open_input_refuses_to_write(tmp_path):
    with pytest.raises(ValueError, match="reading only"):
        hio.open_input(tmp_path / "x", "wb")


# --- tars -----------------------------------------------------------------------------------------


def _tar_bytes(members: list[tuple[str, bytes]], dirs: tuple[str, ...] = ()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _both(path: Path) -> tuple[list, list, Problems, Problems]:
    """Samples by the streaming reader and by the header index (with the indexed bytes read back)."""
    sp, ip = Problems(), Problems()
    streamed = [(k, files) for k, files in read_samples(path, sp)]
    indexed = []
    with open(path, "rb") as f:
        for key, where in index_samples(path, ip):
            files = {}
            for ext, (off, size) in where.items():
                f.seek(off)
                files[ext] = f.read(size)
            indexed.append((key, files))
    return streamed, indexed, sp, ip


def test_member_names_split_as_webdataset_splits_them():
    names = ["0001.jpg", "dir/0001.seg.JSON", "a.b/c.d/e.jpg", "x.", "p/q/r.TXT", "000000001.json"]
    for name in names:
        key, ext = base_plus_ext(name)
        assert split_member_name(name) == (key, ext.lower())
    for name in ["README", ".hidden.txt", "dir/.hidden.txt", "dir/", "__index__", "__meta__/x.json"]:
        assert split_member_name(name) is None


def test_one_grouping_rule_for_both_readers(tmp_path):
    members = [
        ("a.jpg", b"A1"),
        ("a.txt", b"a"),
        ("a.jpg", b"A2"),  # a suffix the sample already has: the next sample (DataComp, open_clip)
        ("b.JPG", b"B"),
        ("b.seg.json", b"{}"),
        (".hidden.txt", b"h"),
        ("README", b"r"),
        ("c.txt", b"c"),
        ("b.txt", b"b again"),  # not consecutive: another sample with the same key
    ]
    path = tmp_path / "t.tar"
    path.write_bytes(_tar_bytes(members, dirs=("d",)))
    want = [
        ("a", {"jpg": b"A1", "txt": b"a"}),
        ("a", {"jpg": b"A2"}),
        ("b", {"jpg": b"B", "seg.json": b"{}"}),
        ("c", {"txt": b"c"}),
        ("b", {"txt": b"b again"}),
    ]
    streamed, indexed, sp, ip = _both(path)
    assert streamed == indexed == want and sp.seen == ip.seen == []
    assert list(group_members([])) == []


def _pool_tar(tmp_path: Path, n: int = 6) -> tuple[Path, bytes, list]:
    members = []
    for k in range(n):
        key = f"{k:09d}"
        members += [
            (f"{key}.jpg", os.urandom(700 + k)),
            (f"{key}.txt", b"cap %d" % k),
            (f"{key}.json", b"{}"),
        ]
    path = tmp_path / "pool.tar"
    write_tar(path, members)
    return path, path.read_bytes(), members


def test_a_complete_tar_reads_without_problems(tmp_path):
    path, _, members = _pool_tar(tmp_path)
    streamed, indexed, sp, ip = _both(path)
    assert len(streamed) == 6 and streamed == indexed and sp.seen == ip.seen == []
    assert [m for _, files in streamed for m in files.values()] == [d for _, d in members]


@pytest.mark.parametrize("where", ["member boundary", "inside a header", "inside data", "end marker"])
def test_truncated_tars_are_reported_and_keep_the_samples_before(tmp_path, where):
    path, data, _ = _pool_tar(tmp_path)
    with tarfile.open(path) as tar:
        infos = tar.getmembers()
    fourth = infos[9]  # first member of sample 3
    cut = {
        "member boundary": fourth.offset,
        "inside a header": fourth.offset + 100,
        "inside data": fourth.offset_data + 10,
        "end marker": infos[-1].offset_data + 512 + 300,  # cut into the two zero blocks
    }[where]
    path.write_bytes(data[:cut])
    streamed, indexed, sp, ip = _both(path)
    n = 6 if where == "end marker" else 3
    assert [k for k, _ in streamed] == [k for k, _ in indexed] == [f"{k:09d}" for k in range(n)]
    # The streaming reader names the shard unreadable, the index the cut (as before the move to hype.io).
    assert sp.reasons == [UNREADABLE_SHARD] and ip.reasons == [TRUNCATED]
    assert str(path) in sp.seen[0][1] and str(path) in ip.seen[0][1]


def test_unreadable_and_missing_tars_are_reported(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar at all" * 100)
    for p, reason in ((bad, UNREADABLE_SHARD), (tmp_path / "missing.tar", MISSING_SHARD)):
        sp, ip = Problems(), Problems()
        assert list(read_samples(p, sp)) == [] and list(index_samples(p, ip)) == []
        assert sp.reasons == ip.reasons == [reason]


def test_tars_of_webdataset_tarwriter_read_back_the_same_samples(tmp_path):
    path = tmp_path / "wds.tar"
    samples = [{"__key__": f"s{k:03d}", "jpg": os.urandom(300 + k), "txt": f"caption {k}"} for k in range(5)]
    with wds.TarWriter(str(path)) as w:
        for s in samples:
            w.write(s)
    streamed, indexed, sp, ip = _both(path)
    assert streamed == indexed and sp.seen == ip.seen == []
    by_wds = [
        (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
        for s in wds.WebDataset(str(path), shardshuffle=False)
    ]
    assert streamed == by_wds
    assert [k for k, _ in streamed] == [s["__key__"] for s in samples]


def test_our_tars_read_in_webdataset_and_tarfile(tmp_path):
    path, _, members = _pool_tar(tmp_path)
    got = [
        (s["__key__"], s["jpg"], s["txt"], s["json"]) for s in wds.WebDataset(str(path), shardshuffle=False)
    ]
    assert got == [
        (members[i][0][:9], members[i][1], members[i + 1][1], members[i + 2][1]) for i in range(0, 18, 3)
    ]
    with tarfile.open(path) as tar:
        assert [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()] == members


def test_writer_bytes_are_those_of_the_synth_writer_tarfile_and_webdataset(tmp_path):
    # The members and digest below were written by hype/synth/shards.py's write_tar before it moved here.
    members = [
        (f"{k:09d}.{ext}", (f"{k}-{ext}-" * (k * 37 + len(ext))).encode())
        for k in range(5)
        for ext in ("jpg", "txt", "json")
    ]
    members.append(("dir/ünï.cls", b""))
    path = tmp_path / "a.tar"
    assert write_tar(path, members) == 16
    data = path.read_bytes()
    assert (
        hashlib.sha256(data).hexdigest() == "44c06c00ba8ce48c780d86b761a5b18aede386e253f5b4d1a772575b61919b9e"
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(payload), 0o644
            tar.addfile(info, io.BytesIO(payload))
    assert buf.getvalue() == data
    # webdataset's TarWriter writes the same bytes for the same members (suffixes in sorted order).
    sorted_members = [(n, d) for n, d in members[:15]]
    sorted_members.sort(key=lambda m: (m[0].split(".")[0], m[0].split(".", 1)[1]))
    write_tar(path, sorted_members)
    buf = io.BytesIO()
    with wds.TarWriter(buf, user="", group="", mode=0o644, mtime=0) as w:
        for k in range(5):
            w.write({"__key__": f"{k:09d}", **{n.split(".", 1)[1]: d for n, d in members[3 * k : 3 * k + 3]}})
    assert buf.getvalue() == path.read_bytes()


def test_writer_refuses_names_ustar_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="too long"):
        write_tar(tmp_path / "x.tar", [("a" * 101, b"")])
    assert list(tmp_path.iterdir()) == []  # no target, no temporary


def test_the_io_layer_imports_no_torch_and_no_command_package():
    code = (
        "import sys, hype.io, hype.io.tar; "
        "bad = sorted(m for m in sys.modules if m in ('torch', 'webdataset') or "
        "(m.startswith('hype.') and not m.startswith('hype.io') and m != 'hype.__init__')); print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_compressed_tar_streams_without_a_false_truncation(tmp_path):
    path, data, _ = _pool_tar(tmp_path)
    gz = tmp_path / "pool.tar.gz"
    with tarfile.open(path) as src, tarfile.open(gz, "w:gz") as dst:
        for m in src.getmembers():
            dst.addfile(m, src.extractfile(m))
    problems = Problems()
    assert [k for k, _ in read_samples(gz, problems)] == [k for k, _ in read_samples(path, Problems())]
    assert problems.seen == []


def test_pickled_numpy_arrays_are_read_without_running_pickled_code(tmp_path):
    """DataComp's released centroids are `torch.save(numpy_array, path, pickle_protocol=4)`; torch's own
    weights-only loader refuses them, a plain torch.load would run any code the pickle names."""
    import pickle

    import torch

    a = np.random.default_rng(0).normal(size=(6, 4)).astype(np.float32)
    for protocol in (2, 4):
        torch.save(a, tmp_path / f"p{protocol}.pt", pickle_protocol=protocol)
        got = hio.read_pickled_array(tmp_path / f"p{protocol}.pt")
        assert got.dtype == a.dtype and np.array_equal(got, a)
    with pytest.raises(pickle.UnpicklingError), pytest.warns(UserWarning, match="pickle protocol 4"):
        torch.load(tmp_path / "p4.pt", weights_only=True)

    sentinel = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    torch.save(Payload(), tmp_path / "evil.pt")
    with pytest.raises(hio.PickledArrayError, match=r"evil\.pt: .*refers to posix\.system"):
        hio.read_pickled_array(tmp_path / "evil.pt")
    assert not sentinel.exists()
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(hio.PickledArrayError, match=r"tensor\.pt: .*torch\._utils"):
        hio.read_pickled_array(tmp_path / "tensor.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(hio.PickledArrayError, match="holds a list, not a numpy array"):
        hio.read_pickled_array(tmp_path / "list.pt")
    np.save(tmp_path / "plain.npy", a)
    with pytest.raises(hio.PickledArrayError, match="not a PyTorch"):
        hio.read_pickled_array(tmp_path / "plain.npy")


def _npy_with_header(path, header: bytes):
    """An `.npy` whose header dict is `header` (padded as numpy pads it), followed by 12 zero bytes."""
    import struct

    h = header + b" " * (63 - len(header) % 64) + b"\n"
    path.write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + b"\0" * 12)
    return path


BAD_NPY_HEADERS = {
    "unterminated": b"{'descr': '<f4', 'fortran_order': False, 'shape': (3,",
    "unterminated-string": b"{'descr': '<f4",
    "not-a-dict": b"[1,2]",
    "bad-descr": b"{'descr': 5, 'fortran_order': False, 'shape': (3,), }",
    "bad-shape": b"{'descr': '<f4', 'fortran_order': False, 'shape': 'x', }",
}


@pytest.mark.parametrize("case", sorted(BAD_NPY_HEADERS))
def test_every_npy_reader_names_the_file_of_a_malformed_header(tmp_path, case):
    """numpy parses the header with Python's tokenizer: an unterminated header raised tokenize.TokenError
    through every reader. Each gives its command's error naming the file instead."""
    from hype.data.uids import UidError, load_subset
    from hype.io import load_npy
    from hype.scoring.stage_clusters import (
        ClassFeatureError,
        ClustersError,
        read_centroids_file,
        read_class_features_file,
    )

    bad = _npy_with_header(tmp_path / f"{case}.npy", BAD_NPY_HEADERS[case])
    for read, error in (
        (load_npy, ValueError),
        (load_subset, UidError),
        (lambda p: read_centroids_file(p, None), ClustersError),
        (lambda p: read_class_features_file(p, 8), ClassFeatureError),
    ):
        with pytest.raises(error, match=case):
            read(bad)
