"""`hype fit --proxy` (hype.fit_proxy) and the synthetic world's proxy task set (`hype synth --proxy-size`):
weights chosen by training on each candidate's subset and scoring on a proxy disjoint from eval/."""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_select_helpers import truth_scores, write_scores

from hype.cli import main
from hype.eval.runner import resolve_data_dir
from hype.synth import SynthError, make_world
from hype.synth.eval_tasks import TASK_NAMES, task_folder

WORLD = dict(size=96, seed=0, clean_size=8, eval_size=8, reference_per_class=1, shard_size=64, workers=1)
# A tiny CLIP of one layer per tower, one step of 16: the search's cost, not its quality, is under test.
TRAIN = ["batch_size=16", "data.workers=0", "model.vision.layers=1", "model.text.layers=1"]
TASKS = "synth/color,synth/shape"
SEARCH = [
    "--frac", "0.5", "--samples-seen", "16", "--proxy-tasks", TASKS, "--candidates", "2", "--seed", "3",
    *(a for t in TRAIN for a in ("--train-set", t)),
]  # fmt: skip


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """A world with its proxy set (8 images per task) and a scores table over its pool."""
    root = tmp_path_factory.mktemp("fit_proxy")
    summary = make_world(root / "world", **WORLD, proxy_size=8)
    run = write_scores(truth_scores(root / "world"), root / "run")
    return {"root": root, "world": root / "world", "run": run, "summary": summary}


def _files(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _images_and_keys(root: Path) -> tuple[set[str], set[str]]:
    images, keys = set(), set()
    for path in root.rglob("*.tar"):
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                stem, ext = m.name.split(".", 1)
                keys.add(stem)
                if ext not in ("cls", "txt"):
                    images.add(hashlib.sha256(tar.extractfile(m).read()).hexdigest())
    return images, keys


def test_proxy_set_is_disjoint_from_eval_and_leaves_the_world_as_it_was(world, tmp_path):
    plain = tmp_path / "plain"
    make_world(plain, **WORLD)
    with_proxy = _files(world["world"])
    assert {k: v for k, v in with_proxy.items() if not k.startswith("proxy/")} == _files(plain)
    proxy = world["world"] / "proxy"
    assert sorted(p.name for p in proxy.iterdir() if p.is_dir()) == sorted(map(task_folder, TASK_NAMES))
    for task in TASK_NAMES:
        for name in ("classnames.txt", "zeroshot_classification_templates.txt", "dataset_type.txt"):
            ev = world["world"] / "eval" / task_folder(task) / name
            assert ev.is_file() == (proxy / task_folder(task) / name).is_file()
            if ev.is_file():
                assert ev.read_bytes() == (proxy / task_folder(task) / name).read_bytes()
    (eval_images, eval_keys), (images, keys) = map(_images_and_keys, (world["world"] / "eval", proxy))
    assert len(images) == 8 * len(TASK_NAMES) and not images & eval_images and not keys & eval_keys
    marker = json.loads((proxy / "proxy.json").read_text())
    assert marker["disjoint_from_eval"] == {
        "eval_images": len(eval_images), "proxy_images": len(images), "common_images": 0, "common_keys": 0,
    }  # fmt: skip
    assert world["summary"]["proxy"]["per_task"] == 8
    # `hype eval --data-dir WORLD/proxy` reads the proxy, never the world's eval/.
    assert resolve_data_dir(proxy) == proxy
    # Added to a world made without one, by the same command: the world is reused as it is.
    again = make_world(plain, **WORLD, proxy_size=8)
    assert again["skipped"] and _files(plain / "proxy") == _files(proxy)


def test_a_proxy_folder_hype_did_not_make_is_left_alone(tmp_path):
    world = tmp_path / "w"
    make_world(world, **WORLD)
    (world / "proxy").mkdir()
    (world / "proxy" / "mine.txt").write_text("a user's file")
    with pytest.raises(SynthError, match=r"proxy exists and holds no proxy.json, so hype did not make it"):
        make_world(world, **WORLD, proxy_size=8)
    assert [p.name for p in (world / "proxy").iterdir()] == ["mine.txt"]
    res = CliRunner().invoke(main, ["synth", "--out", str(world), "--size", "96", "--proxy-size", "-1"])
    assert res.exit_code == 2 and "--proxy-size must be 0 (no proxy set) or images per task" in res.output


@pytest.fixture(scope="module")
def searched(world) -> dict:
    """`hype fit --proxy` over two candidates on the world's proxy set."""
    out = world["root"] / "weights.json"
    args = ["fit", "--scores", str(world["run"]), "--proxy", str(world["world"] / "proxy")]
    res = CliRunner().invoke(
        main, [*args, "--data", str(world["world"] / "pool" / "shards"), *SEARCH, "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    return {**world, "out": out, "record": json.loads(out.read_text()), "output": res.output}


def test_search_keeps_the_best_proxy_score_as_recomputed_by_the_commands(searched, tmp_path):
    record, world = searched["record"], searched["world"]
    cands = record["data"]["candidates"]
    scores = [c["proxy_score"] for c in cands]
    assert len(cands) == 2 and cands[0]["weights"] == dict.fromkeys(record["data"]["columns"], 1.0)
    assert (
        record["fit"]["chosen"] == int(np.argmax(scores))
        and record["weights"] == cands[record["fit"]["chosen"]]["weights"]
    )
    assert record["format"] == "hype-fit-weights/1" and record["normalize"] == "zscore"
    data = record["data"]
    assert data["proxy"] == str(world / "proxy") and data["proxy_tasks"] == TASKS.split(",")
    assert (data["samples_seen"], data["frac"], data["train_seeds"]) == (16, 0.5, [0])
    digest = hashlib.sha256()
    for rel, sha in _files(world / "proxy").items():
        digest.update(f"{rel}\0{sha}\n".encode())
    assert data["proxy_sha256"] == digest.hexdigest()
    assert re.search(r"candidate 2/2: proxy [0-9.]+ .*candidates/min, ETA", searched["output"])
    # Candidate 1 again, by hand: hype select, hype train, hype eval on the proxy.
    w = cands[1]["weights"]
    subset, model, results = tmp_path / "s.npy", tmp_path / "m", tmp_path / "r.jsonl"
    cli = CliRunner()
    spec = ",".join(f"{c}={v!r}" for c, v in w.items())
    res = cli.invoke(main, ["select", "--scores", str(searched["run"]), "--out", str(subset), "--frac", "0.5",
                            "--rank", "combine", "--weights", spec, "--no-progress"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert hashlib.sha256(subset.read_bytes()).hexdigest() == cands[1]["subset_sha256"]
    res = cli.invoke(main, ["train", "--config", "tiny-clip", "--data", str(world / "pool" / "shards"),
                            "--subset", str(subset), "--out", str(model), "--no-progress",
                            "samples_seen=16", "seed=0", *TRAIN])  # fmt: skip
    assert res.exit_code == 0, res.output
    trained = str(model / "model.safetensors")
    res = cli.invoke(main, ["eval", "--model", trained, "--tasks", TASKS, "--data-dir", str(world / "proxy"),
                            "--out", str(results), "--no-progress"])  # fmt: skip
    assert res.exit_code == 0, res.output
    main_metrics = [json.loads(line)["metrics"]["main_metric"] for line in results.read_text().splitlines()]
    assert cands[1]["proxy_score"] == pytest.approx(np.mean(main_metrics), abs=1e-12)


def test_the_weights_file_drives_select(searched, tmp_path):
    out = tmp_path / "s.npy"
    args = ["select", "--scores", str(searched["run"]), "--out", str(out), "--frac", "0.5", "--no-progress"]
    res = CliRunner().invoke(main, [*args, "--rank", "combine", "--weights", str(searched["out"])])
    assert res.exit_code == 0, res.output
    chosen = searched["record"]["data"]["candidates"][searched["record"]["fit"]["chosen"]]
    assert hashlib.sha256(out.read_bytes()).hexdigest() == chosen["subset_sha256"]
    filed = json.loads(out.with_suffix(".json").read_text())["rank"]["weights_file"]
    assert filed["fit"]["proxy_sha256"] == searched["record"]["data"]["proxy_sha256"]


@pytest.mark.parametrize(
    "proxy, extra, how",
    [
        ("world/eval", [], "is"),
        ("world/eval/wds_synth-color_test", [], "lies in"),
        ("world", [], "holds"),
        ("elsewhere/tasks", ["--eval-dir", "{root}/elsewhere"], "lies in"),
        ("decontam", [], "is"),  # the scoring run's decontam.eval_dir (its config.yaml)
    ],
)
def test_a_proxy_in_the_evaluation_tasks_is_refused(world, tmp_path, proxy, extra, how):
    run = tmp_path / "run"
    run.mkdir()
    (run / "scores").symlink_to(world["run"] / "scores")
    (run / "config.yaml").write_text(f"decontam:\n  eval_dir: {world['root'] / 'decontam'}\n")
    for folder in ("elsewhere/tasks", "decontam"):
        (world["root"] / folder).mkdir(parents=True, exist_ok=True)
    out = tmp_path / "w.json"
    args = [
        "fit",
        "--scores",
        str(run),
        "--proxy",
        str(world["root"] / proxy),
        "--data",
        str(tmp_path),
        *extra,
    ]
    res = CliRunner().invoke(main, [*(a.format(root=world["root"]) for a in args), "--out", str(out)])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1 and f" {how} the evaluation tasks' folder" in res.output
    assert not out.exists() and not (tmp_path / "w.json.proxy").exists()
