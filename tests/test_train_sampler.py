"""Soft-cap sampling (`hype train --sampler softcap:...`, hype.train.sampler): the draw against an exact
reference computed from FLYT's definition, its caps and determinism, and tiny training runs on it."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from test_select_helpers import write_scores
from train_helpers import MICRO, clean_scores

from hype.cli import main
from hype.config import ConfigError
from hype.data.subset_index import SubsetError, SubsetIndex
from hype.data.uids import array_to_uids, uids_to_array
from hype.synth import make_world
from hype.train import load_train_config, read_metrics, train
from hype.train.config import SamplerConfig
from hype.train.sampler import draw_subset, softcap_counts
from hype.train.state import ResumeError


def exact_expected_counts(scores, total, *, temperature, penalty, cap, round_size) -> np.ndarray:
    """E[draws of each sample], by enumerating every sequence of draws FLYT's definition allows: rounds of
    `round_size` draws, each draw among the samples not yet drawn this round (and under the cap) with
    probability exp(logit) / sum of theirs, then each drawn sample's logit lowered by `penalty`."""
    n = len(scores)

    def rounds(logits: tuple, counts: tuple, left: int) -> np.ndarray:
        if left == 0:
            return np.array(counts, float)
        open_ = [i for i in range(n) if cap is None or counts[i] < cap]
        k = min(round_size, left, len(open_))
        out = np.zeros(n)
        for seq, p in draws(logits, open_, k):
            lg = tuple(v - penalty if i in seq else v for i, v in enumerate(logits))
            ct = tuple(c + (i in seq) for i, c in enumerate(counts))
            out += p * rounds(lg, ct, left - k)
        return out

    def draws(logits, open_, k):
        if k == 0:
            yield (), 1.0
            return
        mass = sum(math.exp(logits[i]) for i in open_)
        for i in open_:
            rest = [j for j in open_ if j != i]
            for seq, p in draws(logits, rest, k - 1):
                yield (i, *seq), math.exp(logits[i]) / mass * p

    return rounds(tuple(s / temperature for s in scores), (0,) * n, total)


@pytest.mark.parametrize(
    "penalty, round_size, cap, temperature",
    [(0.0, 1, None, 1.0), (0.8, 1, None, 0.5), (0.5, 2, None, 1.0), (0.3, 2, 3, 1.0)],
)
def test_softcap_counts_match_the_exact_expectation(penalty, round_size, cap, temperature):
    scores, total = [1.2, 0.0, -0.7], 6
    kw = dict(temperature=temperature, penalty=penalty, cap=cap, round_size=round_size)
    expected = exact_expected_counts(scores, total, **kw)
    runs = np.array([softcap_counts(np.array(scores), total, seed=s, **kw) for s in range(3000)])
    assert (runs.sum(axis=1) == total).all()
    if cap is not None:
        assert runs.max() <= cap
    se = runs.std(axis=0) / math.sqrt(len(runs))
    assert np.all(np.abs(runs.mean(axis=0) - expected) <= 5 * se + 1e-9), (runs.mean(axis=0), expected)


def test_softcap_counts_are_capped_seeded_and_refuse_an_impossible_cap():
    scores = np.random.default_rng(1).normal(0, 3, 500)
    a = softcap_counts(scores, 2000, cap=6, round_size=64, seed=3)
    assert a.sum() == 2000 and a.max() == 6  # high scores reach the cap; none passes it
    assert np.array_equal(a, softcap_counts(scores, 2000, cap=6, round_size=64, seed=3))
    assert not np.array_equal(a, softcap_counts(scores, 2000, cap=6, round_size=64, seed=4))
    with pytest.raises(SubsetError, match=r"500 candidates x cap 3 < 2000 samples seen; raise sampler.cap"):
        softcap_counts(scores, 2000, cap=3)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A tiny world and a scores table of its clean shards (cos_theta ranks the samples)."""
    out = tmp_path_factory.mktemp("sampler") / "world"
    make_world(out, 32, 0, clean_size=64, eval_size=8, reference_per_class=1, shard_size=32, workers=1)
    write_table(out, out / "scores_run", np.linspace(-1, 1, 64))
    return out


def write_table(world: Path, run: Path, cos: np.ndarray, parts: int = 3) -> Path:
    return write_scores(clean_scores(world, cos), run, parts=parts, row_group_size=10)


def test_draw_is_the_uid_order_draw_and_stays_inside_the_subset(world, tmp_path):
    cfg = SamplerConfig(kind="softcap", scores=str(world / "scores_run"), column="cos_theta", temperature=0.2)
    multiset, record = draw_subset(cfg, 200, 0, None)
    assert record == {
        "kind": "softcap",
        "scores": str(world / "scores_run" / "scores"),
        "within": None,
        "column": "cos_theta",
        "candidates": 64,
        "drawn": 200,
        "unique": record["unique"],
        "max_repeats": record["max_repeats"],
    }
    # The same scores in another part layout: the same multiset (candidates are taken in uid order).
    one = write_table(world, tmp_path / "one", np.linspace(-1, 1, 64), parts=1)
    assert np.array_equal(draw_subset(replace(cfg, scores=str(one)), 200, 0, None)[0], multiset)
    # hype (the Eq. 1 sum) equals cos_theta here: the other terms are 0.
    assert np.array_equal(draw_subset(replace(cfg, column="hype"), 200, 0, None)[0], multiset)
    table = pd.read_parquet(world / "scores_run" / "scores")
    order = np.argsort(table["uid"].to_numpy())
    expect = softcap_counts(table["cos_theta"].to_numpy(np.float64)[order], 200, temperature=0.2, seed=0)
    got = pd.Series(array_to_uids(multiset)).value_counts()
    assert [got.get(u, 0) for u in table["uid"].to_numpy()[order]] == expect.tolist()

    some = sorted(table["uid"])[::4]
    inside, rec = draw_subset(cfg, 100, 0, SubsetIndex(uids_to_array(some), "part.npy"))
    assert rec["candidates"] == 16 and rec["within"] == "part.npy" and set(array_to_uids(inside)) <= set(some)
    with pytest.raises(SubsetError, match=r"none of the uids of --subset other.npy are in the scores table"):
        draw_subset(cfg, 100, 0, SubsetIndex(uids_to_array(["f" * 32]), "other.npy"))


RUN = [
    *MICRO,
    "data.workers=0",
    "data.shuffle_buffer=16",
    "batch_size=8",
    "samples_seen=64",
    "optim.warmup_steps=2",
]
SETTINGS = {"column": "cos_theta", "temperature": 0.3, "cap": 4, "round": 16}


def test_train_on_a_softcap_draw_resumes_on_the_same_draw(world, tmp_path):
    out, data, run = tmp_path / "run", world / "clean" / "shards", tmp_path / "scores_run"
    write_table(world, run, np.linspace(-1, 1, 64))
    spec = f"softcap:scores={run}," + ",".join(f"{k}={v}" for k, v in SETTINGS.items())
    cli = [
        "train",
        "--config",
        "tiny-clip",
        "--data",
        str(data),
        "--out",
        str(out),
        "--no-progress",
    ]
    res = CliRunner().invoke(main, [*cli, "--sampler", spec, *RUN, "max_steps=3"])
    assert res.exit_code == 0, res.output
    assert f"sampler          softcap by cos_theta of {run / 'scores'}: 64 draws" in res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["step"] == 3
    sampler = summary["subset"]["sampler"]
    assert sampler["drawn"] == 64 and sampler["max_repeats"] <= 4 and sampler["candidates"] == 64
    assert summary["subset"]["path"] == str(out / "sampled.npy") == sampler["file"]
    assert summary["subset"]["matched_samples"] == 64  # every draw is a sample of --data, repeats counted
    drawn = (out / "sampled.npy").read_bytes()

    same = [*RUN, f"data.train={data}", f"out={out}", "sampler.kind=softcap", f"sampler.scores={run}"]
    cfg = load_train_config("tiny-clip", same + [f"sampler.{k}={v}" for k, v in SETTINGS.items()])
    write_table(world, run, np.linspace(1, -1, 64))  # other scores under the same path
    with pytest.raises(ResumeError, match=r"sampled.npy: the run was started on another draw"):
        train(cfg, progress=False)
    write_table(world, run, np.linspace(-1, 1, 64))
    done = train(cfg, progress=False)
    assert done["status"] == "completed" and done["resumed_from_step"] == 3 and done["step"] == 8
    assert (out / "sampled.npy").read_bytes() == drawn
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == 8


def test_sampler_spec_errors_are_one_line(tmp_path):
    cli = ["train", "--config", "tiny-clip", "--data", str(tmp_path), "--no-progress"]
    res = CliRunner().invoke(main, [*cli, "--sampler", "softcap:cap"])
    assert res.exit_code == 2 and "'cap' is not KEY=VALUE; e.g. softcap:scores=RUN,cap=8" in res.output
    res = CliRunner().invoke(main, [*cli, "--sampler", "softcap:cap=3"])
    assert res.exit_code == 2 and "sampler.scores: the softcap sampler needs the scores" in res.output


def test_a_draw_that_would_not_fit_in_memory_is_refused_before_reading(world, monkeypatch):
    import hype.train.sampler as sampler

    monkeypatch.setattr(sampler, "available_memory", lambda: 1000)
    cfg = SamplerConfig(kind="softcap", scores=str(world / "scores_run"), column="cos_theta")
    with pytest.raises(SubsetError, match=r"drawing 200 samples from up to 64 scored samples needs ~0.0 GiB"):
        draw_subset(cfg, 200, 0, None)


def test_a_stream_config_reads_as_before_the_sampler_existed():
    stream = load_train_config("tiny-clip")
    assert "sampler" not in stream.to_dict()  # config.yaml, the state and the recipe fingerprint unchanged
    softcap = load_train_config("tiny-clip", ["sampler.kind=softcap", "sampler.scores=run", "sampler.cap=2"])
    expected = {**SamplerConfig().__dict__, "kind": "softcap", "scores": "run", "cap": 2}
    assert softcap.to_dict()["sampler"] == expected
    for cfg in (stream, softcap):
        assert type(cfg).from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match=r"sampler.kind: must be one of stream, softcap"):
        load_train_config("tiny-clip", ["sampler.kind=flyt"])
