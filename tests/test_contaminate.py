"""hype.synth.contaminate: the copies of evaluation images that test_decontam and the benches inject."""

import io
import tarfile
from pathlib import Path

import pytest

from hype.synth.contaminate import KINDS, eval_images, write_copies
from hype.synth.render import ellipses_png


def _eval_world(base: Path) -> list[str]:
    """Two tasks of three images each, as a world's eval/ holds them."""
    tars = []
    for t, task in enumerate(("wds_a", "wds_b")):
        path = base / "eval" / task / "test" / "0.tar"
        path.parent.mkdir(parents=True)
        with tarfile.open(path, "w") as tar:
            for i in range(3):
                data = ellipses_png(10 * t + i)
                info = tarfile.TarInfo(f"s{i:07d}.png")  # the same keys in both tasks, as the world writes
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        tars.append(str(path))
    return tars


def test_copies_get_the_same_uids_wherever_the_world_is_written(tmp_path):
    """Uids hashed the source shard's absolute path: the same world written in another folder got other
    uids, and with them another k-means sample in bench/neardup_injected.py (414 vs 416 samples grouped)."""
    runs = {}
    for where in ("here", "elsewhere/deeper"):
        tars = _eval_world(tmp_path / where)
        rows = write_copies(eval_images(tars), tmp_path / where / "copies.tar", seed=3)
        with tarfile.open(tmp_path / where / "copies.tar") as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        runs[where] = ([r["uid"] for r in rows], members)
        again = tmp_path / where / "again.tar"
        explicit = write_copies(eval_images(tars), again, seed=3, root=tmp_path / where)
        assert [r["uid"] for r in explicit] != runs[where][0]  # named from another folder: other names
        assert len({r["uid"] for r in explicit}) == len(explicit)
    assert runs["here"] == runs["elsewhere/deeper"]
    uids = runs["here"][0]
    assert len(uids) == 2 * 3 * len(KINDS) == len(set(uids))  # same keys in both tasks, distinct uids


def test_a_source_outside_the_named_root_is_refused(tmp_path):
    tars = _eval_world(tmp_path / "w")
    with pytest.raises(ValueError, match="not under root"):
        write_copies(eval_images(tars), tmp_path / "c.tar", root=tmp_path / "w" / "eval" / "wds_a")
