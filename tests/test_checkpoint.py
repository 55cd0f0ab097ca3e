"""Checkpoints: bit-identical round trip, no unpickling, clear errors on bad files."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from hype.checkpoint import CheckpointError, load_checkpoint, read_checkpoint_metadata, save_checkpoint
from hype.models import create_model


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = create_model("tiny-hyperbolic")
    with torch.no_grad():  # make the scalars differ from their init so the round trip proves something
        m.log_curv.fill_(-1.5)
        m.log_logit_scale.fill_(3.3)
    return m


def test_save_load_is_bit_identical(tmp_path, model):
    path = save_checkpoint(tmp_path / "ckpt" / "model.safetensors", model, extra={"step": 7})
    loaded = load_checkpoint(path)
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert loaded.config.to_dict() == model.config.to_dict()
    meta = read_checkpoint_metadata(path)
    assert meta["extra"] == {"step": 7}
    images = torch.randn(2, 3, model.config.vision.image_size, model.config.vision.image_size)
    with torch.no_grad():
        assert torch.equal(model.eval().encode_image(images), loaded.encode_image(images))
    assert not list(tmp_path.glob("ckpt/.*tmp*")), "temporary file left behind"
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # shareable, not safetensors' 0600


def test_every_geometry_round_trips(tmp_path):
    from hype.models import list_model_configs

    for name in [n for n in list_model_configs() if n.startswith("tiny-")]:
        m = create_model(name)
        loaded = load_checkpoint(save_checkpoint(tmp_path / f"{name}.safetensors", m))
        for k, v in m.state_dict().items():
            assert torch.equal(v, loaded.state_dict()[k]), (name, k)


def test_missing_truncated_and_foreign_files(tmp_path, model):
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nope.safetensors")

    good = save_checkpoint(tmp_path / "good.safetensors", model)
    data = good.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path / "cut.safetensors")
    (tmp_path / "stub.safetensors").write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(tmp_path / "stub.safetensors")
    (tmp_path / "text.safetensors").write_bytes(b"hello world, not a checkpoint at all")
    with pytest.raises(CheckpointError, match="not a safetensors"):
        load_checkpoint(tmp_path / "text.safetensors")

    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointError, match="not written by hype"):
        load_checkpoint(tmp_path / "plain.safetensors")


def test_pickles_are_refused_without_being_executed(tmp_path, model):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"model": model.state_dict(), "evil": Evil()}, tmp_path / "zip.pt")
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps(Evil()))
    for name in ("zip.pt", "legacy.pt"):
        with pytest.raises(CheckpointError, match="hype convert"):
            load_checkpoint(tmp_path / name)
    assert not marker.exists()


def test_weights_of_another_architecture_are_rejected(tmp_path, model):
    path = save_checkpoint(tmp_path / "m.safetensors", model)
    # Same file, but the stored config now describes a different model: keys no longer match.
    other = create_model("tiny-clip")
    from safetensors.torch import save_model

    meta = read_checkpoint_metadata(path)
    import json

    save_model(
        other,
        str(tmp_path / "mismatch.safetensors"),
        metadata={
            "format": meta["format"],
            "model_config": json.dumps(model.config.to_dict()),
            "extra": "{}",
        },
    )
    with pytest.raises(CheckpointError, match="do not match"):
        load_checkpoint(tmp_path / "mismatch.safetensors")
