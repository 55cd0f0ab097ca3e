"""Score cards (`RUN_DIR/card.json`) and `hype verify`: a run's sampled scores recomputed from the pool
by a third party agree within the stated tolerance; a tampered card, another model or a changed pool do
not."""

from __future__ import annotations

import functools
import http.server
import json
import shutil
import threading

import numpy as np
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from click.testing import CliRunner
from test_score_support import baseline, models, world

from hype.cli import main
from hype.executor import available_memory, usable_cpus
from hype.scoring.card import seal


def _verify(*args: str):
    return CliRunner().invoke(main, ["verify", *args, "--json"], catch_exceptions=False)


def test_a_run_writes_a_card_whose_sample_is_the_scores_table(tmp_path_factory):
    run = baseline(tmp_path_factory)
    card = json.loads((run / "card.json").read_text())
    assert card["format"] == "hype-score-card/2" and card["sample"]["seed"] == 0
    assert seal(card) == card and card["scores"]["rows"] == len(card["sample"]["rows"]) > 0
    assert card["scores"]["parts"] == len(list((run / "scores").glob("part-*.parquet")))
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
    # The card's model paths as URLs on a loopback server: refused (the download's network guard) unless
    # --allow-private-network, and then fetched.
    card = json.loads((pub / "card.json").read_text())
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory="/"))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        card["model_paths"] = {"meru": base + str(meru), "clip": base + str(clip)}
        (pub / "card.json").write_text(json.dumps(seal(card)))
        res = CliRunner().invoke(
            main, ["verify", str(pub / "card.json"), "--pool", str(w / "pool" / "shards")]
        )
        assert res.exit_code == 2 and "refused private network target (loopback" in res.output, res.output
        assert "--allow-private-network" in res.output and not requests
        card["model_paths"]["meru"] = f"ftp://127.0.0.1:{server.server_address[1]}/meru"  # never fetched
        (pub / "card.json").write_text(json.dumps(seal(card)))
        args = ["verify", str(pub / "card.json"), "--pool", str(w), "--allow-private-network"]
        line = _one_line_error(args)
        assert "refused url scheme ftp:" in line and not requests
        card["model_paths"]["meru"] = base + str(meru)
        (pub / "card.json").write_text(json.dumps(seal(card)))
        res = _verify(str(pub / "card.json"), "--pool", str(w / "pool" / "shards"), "--allow-private-network")
    finally:
        server.shutdown()
    report = json.loads(res.output)
    assert res.exit_code == 0 and report["ok"], report
    assert len(requests) == 2 and not report["scores_checked"]  # a published card: no scores beside it
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
    res = CliRunner().invoke(main, ["verify", str(pub / "card.json"), "--pool", str(w)])
    assert res.exit_code == 2 and "content digest" in res.output  # ... and its content digest then
    (pub / "card.json").write_text(json.dumps(seal(card)))
    res = _verify(
        str(pub / "card.json"), "--pool", str(w / "pool" / "shards"), "--meru", str(meru), "--clip", str(clip)
    )
    assert res.exit_code == 1 and not json.loads(res.output)["ok"]

    # Another model than the card names is refused before anything runs.
    res = CliRunner().invoke(main, ["verify", str(pub / "card.json"), "--pool", str(w), "--meru", str(clip)])
    assert res.exit_code != 0 and "not the model the card names" in res.output


def _one_line_error(args: list[str]) -> str:
    """The one `Error:` line of a refused command (exit status 2, no traceback)."""
    res = CliRunner().invoke(main, args)
    errors = [line for line in res.output.splitlines() if line.startswith("Error:")]
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit) and len(errors) == 1, res.output
    assert "Traceback" not in res.output, res.output
    return errors[0]


def _run_copy(tmp_path_factory, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(baseline(tmp_path_factory), run)
    return run, json.loads((run / "card.json").read_text())


def test_verify_checks_every_binding_of_the_card(tmp_path_factory, tmp_path):
    """Issue 34 item 5 and 6: the scores parts, stage digests, code version and a published subset are
    bound; a card's worker counts and batch sizes are fitted to this machine."""
    run, card = _run_copy(tmp_path_factory, tmp_path)
    w = world(tmp_path_factory)
    pool = str(w / "pool" / "shards")
    sub = tmp_path / "sub" / "subset.npy"
    res = CliRunner().invoke(main, ["select", "--scores", str(run), "--frac", "0.5", "--out", str(sub)])
    assert res.exit_code == 0, res.output
    embed = card["settings"]["embed"]
    embed |= {"decode_workers": 40, "batch_size": 10**9, "prefetch_batches": 10**6}  # a card sizing the run
    card["settings"]["specificity"]["budget_elems"] = 1 << 60  # 8 EiB of working set
    (run / "card.json").write_text(json.dumps(seal(card)))
    res = _verify(str(run / "card.json"), "--pool", pool, "--subset", str(sub))
    report = json.loads(res.output)
    assert res.exit_code == 0 and report["ok"] and report["scores_checked"] and report["stages_checked"], (
        report
    )
    assert report["subset"]["reproduced"] and report["subset"]["rows"] > 0
    assert report["embed"]["decode_workers"] == min(40, usable_cpus())
    assert report["embed"]["batch_size"] <= report["rows"] and report["embed"]["prefetch_batches"] <= 4
    assert report["budget_elems"] * 16 <= available_memory()

    def refused(*extra: str) -> str:
        return _one_line_error(["verify", str(run / "card.json"), "--pool", pool, *extra])

    # One eps_t raised by 5 in a scores part.
    part = sorted((run / "scores").glob("part-*.parquet"))[1]
    saved = part.read_bytes()
    table = pq.read_table(part)
    eps_t = table.column("eps_t").to_numpy().copy()
    eps_t[3] += 5
    pq.write_table(table.set_column(table.schema.get_field_index("eps_t"), "eps_t", [eps_t]), part)
    assert "the scores were altered" in refused()
    part.write_bytes(saved)

    # A changed uid in the published subset.
    uids = np.load(sub)
    uids[0] = (uids[0][0] ^ 1, uids[0][1])
    np.save(sub, uids)
    assert "not the subset its record's selection gives" in refused("--subset", str(sub))

    # A stage digest or the code version edited: the content digest; edited and resealed: the markers.
    for key, value in (("stages", {**card["stages"], "embed": "0" * 32}), ("code", {"hype": "0.0.1"})):
        (run / "card.json").write_text(json.dumps(card | {key: value}))
        assert "content digest does not match" in refused()
    (run / "card.json").write_text(json.dumps(seal(card | {"stages": {**card["stages"], "embed": "0" * 32}})))
    assert "the embed stage's outputs are not the ones the card names" in refused()

    # A card that certifies nothing.
    empty = card | {"scores": card["scores"] | {"rows": 0}, "sample": {**card["sample"], "rows": []}}
    (run / "card.json").write_text(json.dumps(seal(empty)))
    assert "scores.rows: must be at least 1" in refused()


def _malformed(card: dict) -> dict[str, object]:
    """Malformed variants of a valid card: missing keys, wrong types, bad values."""
    out: dict[str, object] = {
        f"no {k}": {x: v for x, v in card.items() if x != k} for k in card if k != "format"
    }
    embed = card["settings"]["embed"]
    settings = card["settings"]
    row = card["sample"]["rows"][0]
    for name, change in {
        "models a list": {"models": ["a"]},
        "stages a string": {"stages": "x"},
        "batch_size a string": {"settings": settings | {"embed": embed | {"batch_size": "8"}}},
        "batch_size 0": {"settings": settings | {"embed": embed | {"batch_size": 0}}},
        "decode_workers -1": {"settings": settings | {"embed": embed | {"decode_workers": -1}}},
        "decode_workers true": {"settings": settings | {"embed": embed | {"decode_workers": True}}},
        "precision fp8": {"settings": settings | {"precision": "fp8"}},
        "resolved fp8": {"settings": settings | {"resolved_precision": "fp8"}},
        "no embed": {"settings": {k: v for k, v in settings.items() if k != "embed"}},
        "curv nan": {
            "settings": settings | {"specificity": settings["specificity"] | {"curv": float("nan")}}
        },
        "rows not lists": {"sample": card["sample"] | {"rows": [1, 2]}},
        "row short": {"sample": card["sample"] | {"rows": [row[:3]]}},
        "row infinite": {"sample": card["sample"] | {"rows": [[row[0], float("inf"), *row[2:]]]}},
        "parts a list": {"scores": card["scores"] | {"parts": []}},
        "parts 0": {"scores": card["scores"] | {"parts": 0}},
        "rows a string": {"scores": card["scores"] | {"rows": "1"}},
        "more rows than scores": {"scores": card["scores"] | {"rows": 1}},
    }.items():
        out[name] = seal(card | change)
    return out


def test_every_malformed_card_is_a_one_line_error(tmp_path_factory, tmp_path):
    card = json.loads((baseline(tmp_path_factory) / "card.json").read_text())
    cases: dict[str, bytes] = {k: json.dumps(v).encode() for k, v in _malformed(card).items()}
    cases |= {
        "not JSON": b"{not json",
        "empty": b"",
        "a list": b"[1, 2]",
        "deep": b"[" * 100_000 + b"]" * 100_000,
        "huge": b'{"x": "' + b"a" * (17 << 20) + b'"}',
        "not utf-8": b"\xff\xfe{}",
        "earlier hype": json.dumps(card | {"format": "hype-score-card/1"}).encode(),
    }
    old = {k: v for k, v in card.items() if k not in ("scores", "digest")} | {"format": "hype-score-card/1"}
    cases["earlier card"] = json.dumps(old).encode()
    for name, data in cases.items():
        path = tmp_path / name.replace(" ", "_") / "card.json"
        path.parent.mkdir()
        path.write_bytes(data)
        line = _one_line_error(["verify", str(path), "--pool", str(tmp_path)])
        assert str(path) in line, (name, line)
        if name.startswith("earlier"):
            assert "re-create it" in line, line
