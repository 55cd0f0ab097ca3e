"""`hype train` end to end on a tiny synthetic world: every geometry, checkpoints, metrics, resume, NaN
stop, subsets and bad input. Models are shrunk to one 32-wide layer at 32 px so each run takes seconds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_select_helpers import save_memmap_subset
from train_helpers import MICRO, TINY_GEOMETRIES

from hype.checkpoint import load_checkpoint
from hype.cli.train import train as train_cmd
from hype.data.uids import save_subset
from hype.synth import make_world
from hype.train import (
    ResumeError,
    TrainingDiverged,
    list_checkpoints,
    load_train_config,
    read_metrics,
    train,
)

FAST = ["data.workers=0", "data.shuffle_buffer=32", "log_every_steps=1", "optim.warmup_steps=2"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("train") / "world"
    make_world(out, 64, 0, clean_size=96, eval_size=8, reference_per_class=1, shard_size=32, workers=1)
    return out


def run_cli(args: list[str]) -> tuple[int, str]:
    """(exit code, stdout + stderr) or, with --json, (exit code, stdout)."""
    result = CliRunner().invoke(train_cmd, args, catch_exceptions=False)
    return result.exit_code, result.stdout if "--json" in args else result.output


def overrides(*extra: str, steps: int = 2, batch: int = 8) -> list[str]:
    return [*MICRO, *FAST, f"samples_seen={steps * batch}", f"batch_size={batch}", *extra]


@pytest.mark.parametrize("geometry", TINY_GEOMETRIES)
def test_every_geometry_trains_from_the_cli(world, tmp_path, geometry):
    out = tmp_path / geometry
    code, output = run_cli(
        ["--config", f"tiny-{geometry}", "--data", str(world / "clean" / "shards"), "--out", str(out)]
        + ["--no-progress", *overrides("checkpoint.every_steps=0")]
    )
    assert code == 0, output
    assert "training complete" in output and str(out / "model.safetensors") in output
    model = load_checkpoint(out / "model.safetensors")
    assert model.config.geometry == geometry.replace("-multi", "") and model.config.embed_dim == 32
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["step"] == 2 and summary["samples_seen"] == 16
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["loss"] > 0 and r["lr"] > 0 and r["samples_per_s"] > 0 and r["logit_scale"] > 0
        hyperbolic = geometry.startswith("hyperbolic")
        assert (r["curv"] is not None) == hyperbolic and (r["alpha_img"] is not None) == hyperbolic
        assert (r["entailment"] is not None) == geometry.startswith(("hyperbolic", "euclidean"))
    assert [c.step for c in list_checkpoints(out)] == [2]
    assert (out / "config.yaml").is_file()


def test_trained_checkpoint_evaluates_with_hype_eval(world, tmp_path):
    from hype.cli import main

    out = tmp_path / "run"
    code, output = run_cli(
        ["--config", "tiny-hyperbolic", "--data", str(world / "clean" / "shards"), "--out", str(out)]
        + ["--no-progress", *overrides()]
    )
    assert code == 0, output
    res = CliRunner().invoke(
        main,
        ["eval", "--model", str(out / "model.safetensors"), "--data-dir", str(world), "--tasks", "synthetic"]
        + ["--out", str(tmp_path / "eval.jsonl"), "--workers", "0", "--no-progress", "--device", "cpu"],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert len(lines) == 7 and all(line["metrics"]["main_metric"] is not None for line in lines)


def config(world: Path, out: Path, *extra: str, preset: str = "tiny-clip", steps: int = 6):
    return load_train_config(
        preset, [*overrides(*extra, steps=steps), f"data.train={world / 'clean' / 'shards'}", f"out={out}"]
    )


def test_interrupted_run_resumes_with_the_same_schedule(world, tmp_path):
    # EuCLIP preset: the K schedule must continue across the interruption too.
    ref = train(config(world, tmp_path / "ref", preset="tiny-euclidean-squared"), progress=False)
    assert ref["status"] == "completed"
    cfg = config(world, tmp_path / "b", "max_steps=3", preset="tiny-euclidean-squared")
    first = train(cfg, progress=False)
    assert first["status"] == "stopped" and first["step"] == 3
    assert not (tmp_path / "b" / "model.safetensors").exists()
    second = train(config(world, tmp_path / "b", preset="tiny-euclidean-squared"), progress=False)
    assert second["status"] == "completed" and second["resumed_from_step"] == 3 and second["step"] == 6
    a, b = read_metrics(tmp_path / "ref" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 7))
    assert [r["lr"] for r in a] == [r["lr"] for r in b]
    assert [r["K"] for r in a] == [r["K"] for r in b] and a[0]["K"] == pytest.approx(0.3)
    assert a[-1]["K"] == pytest.approx(0.1)
    assert [r["samples_seen"] for r in b] == [8 * s for s in range(1, 7)]
    # Same seed, same init, same stream until the interruption: identical losses.
    assert [r["loss"] for r in a[:3]] == pytest.approx([r["loss"] for r in b[:3]], rel=1e-5)
    # Rerunning a finished run does nothing: its summary.json marks it done with the recipe's fingerprint,
    # so nothing is built, read or written (a setting outside the recipe, data.workers, may differ).
    files = {p: p.stat().st_mtime_ns for p in (tmp_path / "b").rglob("*")}
    again = train(
        config(world, tmp_path / "b", "data.workers=1", preset="tiny-euclidean-squared"), progress=False
    )
    assert again["status"] == "already_complete" and again["step"] == 6 and again["state"] == "done"
    assert len(read_metrics(tmp_path / "b" / "metrics.jsonl")) == 6
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "b").rglob("*")} == files


def test_resume_refuses_a_different_recipe(world, tmp_path):
    train(config(world, tmp_path / "r", "max_steps=1"), progress=False)
    with pytest.raises(ResumeError, match=r"different configuration \(optim.lr: 0.001 -> 0.01\)"):
        train(config(world, tmp_path / "r", "optim.lr=0.01"), progress=False)
    with pytest.raises(ResumeError, match="already holds a run"):
        train(config(world, tmp_path / "r"), resume="never", progress=False)
    # Settings that do not change the experiment may differ.
    done = train(config(world, tmp_path / "r", "data.workers=1", "checkpoint.keep=1"), progress=False)
    assert done["status"] == "completed" and done["resumed_from_step"] == 1


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(world, tmp_path):
    cfg = config(
        world, tmp_path / "nan", "debug_nan_at_step=4", "checkpoint.every_steps=2", preset="tiny-hyperbolic"
    )
    with pytest.raises(TrainingDiverged, match=r"non-finite loss at step 4: loss nan.*curv .*alpha_img") as e:
        train(cfg, progress=False)
    assert "last good checkpoint" in str(e.value)
    assert [c.step for c in list_checkpoints(tmp_path / "nan")] == [2]
    load_checkpoint(tmp_path / "nan" / "checkpoints" / "step-00000002.safetensors")
    summary = json.loads((tmp_path / "nan" / "summary.json").read_text())
    assert summary["status"] == "diverged" and "step 4" in summary["error"] and summary["step"] == 3
    code, output = run_cli(
        ["--config", "tiny-clip", "--data", str(world / "clean" / "shards"), "--out", str(tmp_path / "nan2")]
        + ["--no-progress", *overrides("debug_nan_at_step=1")]
    )
    assert code == 1 and "training diverged: non-finite loss at step 1" in output


def test_subset_training_and_skipped_samples_are_reported(world, tmp_path):
    import pyarrow.parquet as pq

    uids = pq.read_table(world / "clean" / "shards" / "00000000.parquet").column("uid").to_pylist()
    subset = save_subset(tmp_path / "subset.npy", uids[:5] + uids[:5])
    code, output = run_cli(
        ["--config", "tiny-clip", "--data", str(world / "clean" / "shards"), "--subset", str(subset)]
        + ["--out", str(tmp_path / "sub"), "--no-progress", "--json", *overrides()]
    )
    assert code == 0, output
    summary = json.loads(output)
    assert summary["subset"]["matched_samples"] == 10 and summary["subset"]["subset_uids"] == 10

    # A pool shard with a corrupt image, a sample without caption and one without image.
    import io
    import tarfile

    bad = tmp_path / "bad"
    bad.mkdir()
    src = tarfile.open(world / "clean" / "shards" / "00000000.tar")
    with tarfile.open(bad / "00000000.tar", "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()
            if m.name.startswith("000000000."):
                data = data[:50] if m.name.endswith(".jpg") else data
            if m.name == "000000001.txt" or m.name == "000000002.jpg":
                continue
            dst.addfile(m if len(data) == m.size else _info(m.name, len(data)), io.BytesIO(data))
    (bad / "00000001.tar").write_bytes(b"")
    code, output = run_cli(
        ["--config", "tiny-clip", "--data", str(bad), "--out", str(tmp_path / "badrun")]
        + ["--no-progress", "--json", *overrides(steps=6)]
    )
    assert code == 0, output
    skipped = json.loads(output)["skipped"]["counts"]
    assert skipped["corrupt_image"] >= 1 and skipped["no_caption"] >= 1 and skipped["no_image"] >= 1
    assert skipped["empty_shard"] == 1
    assert read_metrics(tmp_path / "badrun" / "metrics.jsonl")[-1]["skipped"] >= 3


def _info(name: str, size: int):
    import tarfile

    info = tarfile.TarInfo(name)
    info.size = size
    return info


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "{nowhere}/missing/*.tar"], "missing/\\*.tar: the pattern matches no .tar file"),
        (["--data", "{world}/clean/shards/{{00000000..00000009}}.tar"], "7 of the 10 shards it names"),
        (["--data", "{world}/clean/shards", "--subset", "{other}"], "matches none of the 96 samples"),
        # DataComp's raw memmap layout is read (and then matches nothing); a text file is named as such.
        (["--data", "{world}/clean/shards", "--subset", "{raw}"], "matches none of the 96 samples"),
        (["--data", "{world}/clean/shards", "--subset", "{text}"], "--subset: {text}: found a text file"),
        (["--data", "{world}/clean/shards", "optim.lr=-3"], "optim.lr: must be > 0"),
        (["--data", "{world}/clean/shards", "optim.nope=1"], "unknown key; valid keys in optim: lr"),
        (
            ["--data", "{world}/clean/shards", "accum_steps=3"],
            "is not divisible by 1 process(es) x accum_steps 3",
        ),
        ([], "no training data: pass --data"),
    ],
)
def test_bad_input_gives_clear_errors(world, tmp_path, args, message):
    other = save_subset(tmp_path / "other.npy", ["0" * 31 + "1"])
    raw = save_memmap_subset(tmp_path / "other.memmap", ["0" * 31 + "1"])
    text = tmp_path / "uids.txt"
    text.write_text("0" * 31 + "1\n")
    paths = {"world": world, "nowhere": tmp_path, "other": other, "raw": raw, "text": text}
    args = [a.format(**paths) for a in args]
    message = message.format(**paths)
    code, output = run_cli(["--config", "tiny-clip", "--out", str(tmp_path / "o"), "--no-progress", *args])
    assert code != 0 and message.replace("\\", "") in output.replace("\n", " "), output


def test_init_from_an_open_clip_model(world, tmp_path):
    """`--init` starts from an open_clip model's weights (here a Hugging Face folder); at lr 1e-30 the trained
    model is those weights (to 1e-12: AdamW's first steps move a zero bias by about lr). Another
    architecture is refused naming the fix."""
    import json as _json

    import open_clip
    import torch
    from safetensors.torch import save_file

    from hype.models.open_clip_format import open_clip_config

    cfg = load_train_config("tiny-clip", list(MICRO)).model_config()
    oc_cfg = open_clip_config(cfg)
    torch.manual_seed(7)
    oc = open_clip.model.CLIP(**oc_cfg["model_cfg"]).eval()
    with torch.no_grad():
        oc.logit_scale.fill_(2.0)
    src = tmp_path / "oc"
    src.mkdir()
    (src / "open_clip_config.json").write_text(_json.dumps(oc_cfg))
    save_file(
        {k: v.contiguous() for k, v in oc.state_dict().items()}, str(src / "open_clip_model.safetensors")
    )

    out = tmp_path / "run"
    args = [
        "--config",
        "tiny-clip",
        "--data",
        str(world / "clean" / "shards"),
        "--out",
        str(out),
        "--no-progress",
    ]
    code, output = run_cli([*args, "--init", str(src), *overrides("optim.lr=1e-30", "optim.weight_decay=0")])
    assert code == 0, output
    trained = load_checkpoint(out / "model.safetensors").state_dict()
    for key, value in oc.state_dict().items():
        ours = "text." + key if not key.startswith(("visual.", "logit_scale")) else key
        ours = "log_logit_scale" if key == "logit_scale" else ours
        torch.testing.assert_close(trained[ours], value, atol=1e-12, rtol=0, msg=key)
    summary = _json.loads((out / "summary.json").read_text())
    assert summary["init"]["path"] == str(src) and summary["init"]["scalars"] == ["log_logit_scale"]

    code, output = run_cli(
        ["--config", "tiny-clip", "--data", str(world / "clean" / "shards")]
        + ["--out", str(tmp_path / "bad"), "--init", str(src), "--no-progress"]
    )
    assert code != 0 and "not the architecture of model config 'tiny-clip'" in output


def _safetensors(data: bytes) -> tuple[dict, dict]:
    """(metadata, tensors) of a safetensors file's bytes. The bytes themselves differ between two saves of
    the same weights: safetensors writes the metadata keys in a random (hash map) order."""
    from safetensors.torch import load

    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + size])["__metadata__"], load(data)


def test_data_subset_and_run_on_object_storage_match_a_local_run(world, tmp_path, s3):
    """Shards, subset and --out on S3, stopped at a checkpoint and resumed from it: the same checkpoints,
    weights and metrics as the same run on local disk (shards streamed in a DataLoader worker)."""
    import pyarrow.parquet as pq

    from hype.io import read_bytes, storage

    root = f"s3://{s3.bucket()}"
    shards = world / "clean" / "shards"
    for path in sorted(shards.iterdir()):
        storage.upload(path, storage.location(f"{root}/shards/{path.name}"))
    uids = pq.read_table(shards / "00000000.parquet").column("uid").to_pylist()
    subset = save_subset(tmp_path / "subset.npy", uids[:20] + uids[:4])
    storage.upload(subset, storage.location(f"{root}/subset.npy"))
    common = [*overrides("data.workers=1", "checkpoint.every_steps=2", "checkpoint.keep=1", steps=4)]
    runs = {
        "local": (shards, subset, tmp_path / "run"),
        "s3": (f"{root}/shards", f"{root}/subset.npy", f"{root}/run"),
    }
    for data, sub, out in runs.values():
        for extra in (["max_steps=2"], []):
            cfg = load_train_config(
                "tiny-clip", [*common, *extra, f"data.train={data}", f"data.subset={sub}", f"out={out}"]
            )
            summary = train(cfg, progress=False)
        assert summary["status"] == "completed" and summary["resumed_from_step"] == 2
        assert summary["subset"]["matched_samples"] == 24 and summary["subset"]["complete"]
    local, remote = (tmp_path / "run"), f"{root}/run"
    assert [c.step for c in list_checkpoints(remote)] == [c.step for c in list_checkpoints(local)] == [4]
    for name in ("model.safetensors", "checkpoints/step-00000004.safetensors"):
        theirs, ours = _safetensors(read_bytes(f"{remote}/{name}")), _safetensors((local / name).read_bytes())
        assert theirs[0] == ours[0] and theirs[1].keys() == ours[1].keys()
        assert all(torch.equal(theirs[1][k], ours[1][k]) for k in ours[1])
    keys = ("step", "lr", "loss", "samples_seen", "shards_read")
    rows = [
        [
            {k: r[k] for k in keys}
            for r in read_metrics(p / "metrics.jsonl" if isinstance(p, Path) else f"{p}/metrics.jsonl")
        ]
        for p in (local, remote)
    ]
    assert rows[0] == rows[1] and [r["step"] for r in rows[0]] == [1, 2, 3, 4]
    assert json.loads(read_bytes(f"{remote}/summary.json"))["model"] == f"{remote}/model.safetensors"


def test_a_missing_bucket_is_named(world, s3):
    from hype.cli import main

    args = ["train", "--config", "tiny-clip", "--data", str(world / "clean" / "shards"), "--no-progress"]
    res = CliRunner().invoke(main, [*args, "--out", "s3://no-such-bucket-hype/run", *overrides()])
    assert res.exit_code == 1 and "s3://no-such-bucket-hype/run: the bucket does not exist" in res.output


def test_two_cpu_runs_of_the_same_inputs_give_the_same_checkpoint(world, tmp_path):
    # fixed CPU threads + deterministic algorithms + a sorted checkpoint header: byte-identical weights
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        cfg = config(world, out, "threads=2", "device=cpu", "checkpoint.every_steps=0", steps=3)
        assert train(cfg, progress=False)["status"] == "completed"
    assert (runs[0] / "model.safetensors").read_bytes() == (runs[1] / "model.safetensors").read_bytes()
