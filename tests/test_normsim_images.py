"""`normsim` over a target of images (loose files or webdataset tars): embedded with the CLIP the run
recorded, it equals NormSim over the same images' features computed here with the model in float64; a
target inside the run's evaluation images is refused."""

from __future__ import annotations

import shutil
import tarfile

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from test_negclip import _scores, norm_sim_reference
from test_score_support import baseline, models, world

import hype.filters  # noqa: F401
from hype.data.imageprep import Preprocess
from hype.scoring.embed_format import read_embeddings
from hype.select import SelectError
from hype.select.rules import make_rule
from hype.table.reader import ScoresTable


def _features64(files, clip) -> np.ndarray:
    """CLIP image features of `files` with the model in float64 (PIL decode, the model's eval transform)."""
    from hype.checkpoint import load_model_file

    model = load_model_file(clip, device="cpu").double().eval()
    prep = Preprocess.of(model)
    x = np.stack([prep.pixels(Image.open(f).convert("RGB")) for f in files]).astype(np.float64) / 255
    x = (x - np.array(prep.mean)) / np.array(prep.std)
    with torch.no_grad():
        return model.encode_image(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()).numpy()


def _pool(run) -> tuple[list[str], np.ndarray]:
    """The run's uids and CLIP image embeddings (its one generation of embed outputs)."""
    import pyarrow.parquet as pq

    files = sorted((run / "embed").glob("*.parquet"))
    uids = [u for f in files for u in pq.read_table(f, columns=["uid"]).column("uid").to_pylist()]
    return uids, np.concatenate([read_embeddings(f, "clip_img") for f in files])


@pytest.mark.parametrize("p", ["2", "inf"])
def test_normsim_over_images_is_normsim_over_their_float64_features(tmp_path_factory, tmp_path, p):
    base = tmp_path / "run"  # a copy: the selection caches the target's features in its run folder, and
    shutil.copytree(baseline(tmp_path_factory), base)  # the shared baseline must stay as the run wrote it
    shards = world(tmp_path_factory) / "eval" / "reference" / "train"  # the ImageNet-train analogue
    loose = tmp_path / "images"
    loose.mkdir()
    for tar in sorted(shards.glob("*.tar")):
        with tarfile.open(tar) as t:
            t.extractall(loose, filter="data")
    for f in loose.glob("*.cls"):
        f.unlink()  # a plain folder of images
    files = sorted(loose.iterdir())
    uids, img = _pool(base)
    feats = _features64(files, models(tmp_path_factory)[1])
    want = dict(zip(uids, norm_sim_reference(img, feats, p), strict=True))
    for target in (loose, shards):
        got = _scores(ScoresTable(base), "normsim", target=str(target), p=p)
        np.testing.assert_allclose([got[u] for u in uids], [want[u] for u in uids], rtol=0, atol=5e-6)
    rule = make_rule("normsim", target=str(loose), p=p)
    rule.attach(ScoresTable(base))
    assert rule.describe()["target_rows"] == len(files) and rule.describe()["target_images_skipped"] == 0


def test_normsim_refuses_images_inside_the_evaluation_set(tmp_path_factory, tmp_path):
    w = world(tmp_path_factory)
    run = tmp_path / "run"
    shutil.copytree(baseline(tmp_path_factory), run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["decontam"]["eval_dir"] = str(w / "eval")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SelectError, match="overlaps the run's evaluation images"):
        make_rule("normsim", target=str(w / "eval" / "reference" / "train")).attach(ScoresTable(run))


def test_an_image_target_is_embedded_once_per_content(tmp_path_factory, tmp_path):
    """The second selection with the same target images reads their features from the run's cache (its
    summary counts no image embedded) and writes the same subset; a changed image is embedded again."""
    from hype.select.run import SelectRequest, select_subset

    run = tmp_path / "run"
    shutil.copytree(baseline(tmp_path_factory), run)
    target = tmp_path / "images"
    target.mkdir()
    shards = world(tmp_path_factory) / "eval" / "reference" / "train"
    with tarfile.open(sorted(shards.glob("*.tar"))[0]) as t:
        images = [m for m in t.getmembers() if m.name.endswith((".jpg", ".png", ".webp"))][:12]
        for m in images:
            (target / m.name).write_bytes(t.extractfile(m).read())

    def select(name: str) -> dict:
        out = tmp_path / f"{name}.npy"
        summary = select_subset(
            SelectRequest(scores=run, out=out, frac=0.3, rank=f"normsim:target={target}", progress=False)
        )
        return {**summary["rank"], "bytes": out.read_bytes()}

    first, second = select("a"), select("b")
    assert first["target_images_embedded"] == 12 and second["target_images_embedded"] == 0
    assert second["bytes"] == first["bytes"] and second["target_rows"] == 12
    a, b = sorted(target.iterdir())[:2]
    a.write_bytes(b.read_bytes())  # one image changed (its name kept)
    assert select("c")["target_images_embedded"] == 12
    shutil.rmtree(run / "select_cache")
    (run / "select_cache").write_text("")  # the cache cannot be written (as in a read-only run folder)
    d = select("d")  # failed before: the selection stopped on the cache's write error
    assert d["target_images_embedded"] == 12 and d["bytes"] == select("e")["bytes"]
