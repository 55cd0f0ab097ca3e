"""Score cards (`RUN_DIR/card.json`) and `hype verify`: a run's sampled scores recomputed from the pool
by a third party agree within the stated tolerance; a tampered card, another model or a changed pool do
not."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.dataset as ds
from click.testing import CliRunner
from test_score_support import baseline, models, world

from hype.cli import main


def _verify(*args: str):
    return CliRunner().invoke(main, ["verify", *args, "--json"], catch_exceptions=False)


def test_a_run_writes_a_card_whose_sample_is_the_scores_table(tmp_path_factory):
    run = baseline(tmp_path_factory)
    card = json.loads((run / "card.json").read_text())
    assert card["format"] == "hype-score-card/1" and card["sample"]["seed"] == 0
    assert set(card["models"]) == {"meru", "clip"} and all(card["models"].values())
    assert card["reference"] and card["centroids"] and card["targets"] and card["config"]
    assert set(card["stages"]) >= {"embed", "specificity", "clusters", "merge"}
    table = ds.dataset(run / "scores", format="parquet").to_table().to_pandas().set_index("uid")
    rows = card["sample"]["rows"]
    assert len(rows) == len(table) == len({r[0] for r in rows})  # a small pool: every row sampled
    for uid, *values in rows:
        np.testing.assert_allclose(values, table.loc[uid, card["sample"]["columns"][1:]].to_numpy(float))


def test_verify_recomputes_the_sample_from_the_pool(tmp_path_factory, tmp_path):
    run, w = baseline(tmp_path_factory), world(tmp_path_factory)
    meru, clip = models(tmp_path_factory)
    # What a third party gets: the card with the reference sets and centroids beside it, and the models.
    pub = tmp_path / "published"
    (pub / "clusters").mkdir(parents=True)
    shutil.copy(run / "card.json", pub)
    shutil.copy(run / "reference.safetensors", pub)
    for name in ("centroids.npy", "targets.npy"):
        shutil.copy(run / "clusters" / name, pub / "clusters")
    res = _verify(
        str(pub / "card.json"), "--pool", str(w / "pool" / "shards"), "--meru", str(meru), "--clip", str(clip)
    )
    report = json.loads(res.output)
    assert res.exit_code == 0 and report["ok"], report
    assert report["found_in_pool"] == report["rows"] > 0 and report["c_in_flips"] == 0
    assert max(report["max_abs_diff"].values()) <= 1e-4  # fp32 on the same machine: rounding at most

    # bf16 towers: agreement within the bf16 tolerance, stated in the report.
    res = _verify(str(pub / "card.json"), "--pool", str(w / "pool" / "shards"), "--precision", "bf16",
                  "--meru", str(meru), "--clip", str(clip))  # fmt: skip
    report = json.loads(res.output)
    assert report["tolerance"] == 0.05 and report["precision"] == "bf16"
    assert 0 < max(report["max_abs_diff"].values()) <= 0.05 and report["ok"]

    # A card whose scores were edited no longer matches its checksum.
    card = json.loads((pub / "card.json").read_text())
    card["sample"]["rows"][0][3] += 0.5
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "card.json").write_text(json.dumps(card))
    res = CliRunner().invoke(main, ["verify", str(tmp_path / "t" / "card.json"), "--pool", str(w)])
    assert res.exit_code != 0 and "checksum" in res.output

    # ... and one whose checksum was recomputed too disagrees with the pool.
    from hype.scoring.card import _checksum

    card["sample"]["checksum"] = _checksum(card["sample"]["rows"])
    (pub / "card.json").write_text(json.dumps(card))
    res = _verify(
        str(pub / "card.json"), "--pool", str(w / "pool" / "shards"), "--meru", str(meru), "--clip", str(clip)
    )
    assert res.exit_code == 1 and not json.loads(res.output)["ok"]

    # Another model than the card names is refused before anything runs.
    res = CliRunner().invoke(main, ["verify", str(pub / "card.json"), "--pool", str(w), "--meru", str(clip)])
    assert res.exit_code != 0 and "not the model the card names" in res.output
