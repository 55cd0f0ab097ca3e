"""Bad data in the pool is skipped and counted per shard with its reason, never fatal, never silent:
corrupt/truncated images, missing members, bad json/uids/captions, odd image modes and sizes,
duplicate uids across and within shards, a truncated tar and an empty tar."""

from __future__ import annotations

import io
import json
import tarfile
from collections import OrderedDict

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from PIL import Image
from test_score_support import models, run_cli, world


def _members(path) -> OrderedDict:
    samples: OrderedDict = OrderedDict()
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return samples


def _write_tar(path, samples: OrderedDict) -> None:
    with tarfile.open(path, "w") as tar:
        for key, files in samples.items():
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _image(mode: str, size, fmt: str, color=128) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color if mode in ("L", "1") else (200, 30, 60, 128)[: len(mode)]).save(buf, fmt)
    return buf.getvalue()


def _json(files: dict, **changes) -> dict:
    meta = json.loads(files["json"])
    meta.update(changes)
    return meta


def test_bad_samples_are_skipped_and_counted_with_reasons(tmp_path_factory, tmp_path):
    w = world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    src = w / "pool" / "shards"
    pool = tmp_path / "pool"
    pool.mkdir()

    a = _members(src / "00000000.tar")
    keys = list(a)
    uid_of = {k: json.loads(a[k]["json"])["uid"] for k in keys}
    f = [a[k] for k in keys]
    f[0]["jpg"] = b"\xff\xd8\xff\xe0 definitely not a jpeg"
    f[1]["jpg"] = f[1]["jpg"][:100]  # truncated JPEG
    del f[2]["txt"]
    del f[3]["json"]
    f[4]["json"] = json.dumps({k: v for k, v in _json(f[4]).items() if k != "uid"}).encode()
    f[5]["json"] = json.dumps(_json(f[5], uid="not-a-uid")).encode()
    f[6]["json"] = b"{not json"
    f[7]["txt"] = b"caf\xe9 \xff\xfe"
    del f[8]["jpg"]
    del f[9]["jpg"]
    f[9]["png"] = _image("1", (15000, 15000), "PNG", 0)  # 225 MP: a decompression bomb for Pillow
    f[10]["txt"] = b"   "  # empty caption: scored
    f[11]["jpg"] = _image("L", (40, 30), "JPEG")
    f[12]["jpg"] = _image("CMYK", (50, 70), "JPEG")
    del f[13]["jpg"]
    f[13]["png"] = _image("RGBA", (33, 65), "PNG")
    f[14]["jpg"] = _image("RGB", (1, 1), "JPEG")
    f[15]["jpg"] = _image("RGB", (3000, 2000), "JPEG")
    f[15]["json"] = json.dumps(
        {k: v for k, v in _json(f[15]).items() if k not in ("original_width", "original_height")}
    ).encode()
    f[16]["json"] = json.dumps(_json(f[16], uid=uid_of[keys[16]].upper())).encode()
    _write_tar(pool / "00000000.tar", a)

    b = _members(src / "00000001.tar")
    bkeys = list(b)
    b[bkeys[0]]["json"] = json.dumps(_json(b[bkeys[0]], uid=uid_of[keys[20]])).encode()  # dup of shard 0
    dup_in_b = json.loads(b[bkeys[2]]["json"])["uid"]
    b[bkeys[1]]["json"] = json.dumps(_json(b[bkeys[1]], uid=dup_in_b)).encode()  # dup of a later row
    _write_tar(pool / "00000001.tar", b)

    data = (src / "00000002.tar").read_bytes()
    (pool / "00000002.tar").write_bytes(data[: len(data) // 2])  # truncated mid-way
    (pool / "00000003.tar").write_bytes(b"")  # interrupted download

    run = tmp_path / "run"
    args = [
        "--pool",
        str(pool),
        "--meru",
        str(meru),
        "--clip",
        str(clip),
        "--out",
        str(run),
        "--class-images",
        str(w / "eval" / "reference" / "train"),
        "batch_size=16",
        "progress=false",
        "reference.n_top=50",
        "reference.m=40",
        "--neardup",  # its copy check reads the images again, from the same bad shards
    ]
    result = run_cli(args)
    assert result.exit_code == 0, result.output

    stats_a = json.loads(next((run / "embed").glob("00000000-*_stats.json")).read_text())
    assert stats_a["skipped"]["counts"] == {
        "corrupt_image": 2,
        "no_caption": 1,
        "no_uid": 2,
        "bad_uid": 1,
        "bad_json": 1,
        "bad_caption": 1,
        "no_image": 1,
        "image_too_large": 1,
    }
    assert stats_a["counts"] == {"samples": 50, "embedded": 40, "skipped": 10, "empty_captions": 1}
    examples = stats_a["skipped"]["examples"]
    assert f"00000000.tar:{keys[2]}: no .txt member" in examples["no_caption"][0]
    assert "not-a-uid" in examples["bad_uid"][0]

    scores = ds.dataset(run / "scores", format="parquet").to_table().to_pandas()
    part_a = scores[scores.shard.str.endswith("00000000.tar")]
    assert list(part_a.key) == keys[10:]
    assert part_a.uid.iloc[6] == uid_of[keys[16]]  # uppercase uid normalised
    assert part_a.text.iloc[0] == ""
    big = part_a.set_index("key").loc[keys[15]]
    assert (big.width, big.height) == (3000, 2000)  # no original size in the json: the decoded one
    for col in ("eps_i", "eps_t", "neg_d_l", "cos_theta"):
        assert np.isfinite(scores[col]).all()

    part_b = scores[scores.shard.str.endswith("00000001.tar")]
    assert len(part_b) == 48 and bkeys[0] not in set(part_b.key) and bkeys[1] in set(part_b.key)
    assert scores.uid.is_unique
    dups = pq.read_table(run / "dedup" / "duplicates.parquet").to_pandas()
    assert sorted(dups.row.tolist()) == [0, 2] and set(dups.shard_index) == {1}

    stats_c = json.loads(next((run / "embed").glob("00000002-*_stats.json")).read_text())
    assert stats_c["skipped"]["counts"].get("unreadable_shard") == 1
    n_c = stats_c["counts"]["embedded"]
    assert 0 < n_c < 50 and n_c + stats_c["counts"]["skipped"] == stats_c["counts"]["samples"]
    assert (scores.shard.str.endswith("00000002.tar")).sum() == n_c

    s = json.loads((run / "summary.json").read_text())
    from hype.scoring.config import NeardupConfig

    # the summary names the copy check the stage ran with: the default's threshold
    assert (
        s["status"] == "complete"
        and s["neardup"]["copy_check"]["threshold"] == NeardupConfig().copy_threshold
    )
    assert s["samples"]["duplicates"] == 2 and s["samples"]["scored"] == len(scores) == 40 + 48 + n_c
    assert s["samples"]["skipped_by_reason"]["corrupt_image"] == 2
    assert s["shards"]["unreadable"] == 1 and s["shards"]["empty"] == [str(pool / "00000003.tar")]
    assert any("00000003.tar" in x and "empty" in x for x in s["warnings"])
    assert "skipped     " in result.output and "duplicates  2" in result.output
