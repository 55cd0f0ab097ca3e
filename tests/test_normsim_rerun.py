"""A selection with `normsim` is redone when its target's content changes under the same path (its files'
identities are part of the selection's fingerprint), one with `dbp`/`negclip` when a parameter does, and
one with `combine` when its weights file's content does."""

from __future__ import annotations

import numpy as np
from test_negclip import D, N, _run, _unit

import hype.filters  # noqa: F401
from hype.select.run import SelectRequest, select_subset


def _select(tmp_path, rank: str) -> dict:
    req = SelectRequest(scores=tmp_path / "r", out=tmp_path / "sub.npy", frac=0.3, rank=rank, progress=False)
    return select_subset(req)


def test_a_changed_target_or_parameter_is_selected_again(tmp_path):
    rng = np.random.default_rng(5)
    img = _unit(rng, N, D)
    _run(tmp_path / "r", img, img, [f"{i * 17 + 3:032x}" for i in range(N)], clip_txt=False)
    (tmp_path / "t").mkdir()
    np.save(tmp_path / "t" / "a.npy", _unit(rng, 40, D))
    rank = f"normsim:target={tmp_path / 't'}"
    assert not _select(tmp_path, rank).get("skipped")
    assert _select(tmp_path, rank)["skipped"]  # same target: done
    first = (tmp_path / "sub.npy").read_bytes()
    np.save(tmp_path / "t" / "a.npy", _unit(rng, 40, D))  # same path and size, other features
    assert not _select(tmp_path, rank).get("skipped")  # failed before: the old subset was kept as done
    assert (tmp_path / "sub.npy").read_bytes() != first
    np.save(tmp_path / "t" / "b.npy", _unit(rng, 40, D))  # a file added
    assert not _select(tmp_path, rank).get("skipped")
    assert not _select(tmp_path, "dbp:inner=clip_score,clusters=4").get("skipped")
    assert _select(tmp_path, "dbp:inner=clip_score,clusters=4")["skipped"]
    assert not _select(tmp_path, "dbp:inner=clip_score,clusters=4,tau=0.2").get("skipped")


def test_a_changed_weights_file_is_selected_again(tmp_path):
    """`--rank combine --weights FILE`: other weights under the same path are another selection."""
    rng = np.random.default_rng(6)
    img = _unit(rng, N, D)
    _run(tmp_path / "r", img, img, [f"{i * 17 + 3:032x}" for i in range(N)], clip_txt=False)
    weights = tmp_path / "w.json"

    def select() -> dict:
        req = SelectRequest(scores=tmp_path / "r", out=tmp_path / "sub.npy", frac=0.3, rank="combine",
                            weights=str(weights), progress=False)  # fmt: skip
        return select_subset(req)

    weights.write_text('{"eps_i": 1.0, "eps_t": 0.0}')
    assert not select().get("skipped")
    assert select()["skipped"]
    first = (tmp_path / "sub.npy").read_bytes()
    weights.write_text('{"eps_i": 0.0, "eps_t": 1.0}')  # same path and size, other weights
    assert not select().get("skipped")  # failed before: the old subset was kept as done
    assert (tmp_path / "sub.npy").read_bytes() != first
