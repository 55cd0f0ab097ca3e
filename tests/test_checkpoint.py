"""Checkpoints: bit-identical round trip, no unpickling, clear errors on bad files."""

from __future__ import annotations

import json
import os
import pickle
import struct

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


# --- malformed files: every one is the command's clear error naming the file --------------------------


def _safetensors(header: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


_HYPE = {"format": "hype-checkpoint/1", "model_config": json.dumps({"name": "x"}), "extra": "{}"}
_F32 = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
MALFORMED = {
    "metadata a string": _safetensors({"__metadata__": "x"}),
    "metadata values not strings": _safetensors({"__metadata__": {"format": 5}}),
    "tensor entry 5": _safetensors({"__metadata__": _HYPE, "t": 5}, b"\0" * 4),
    "tensor entry {}": _safetensors({"__metadata__": _HYPE, "t": {}}, b"\0" * 4),
    "string offsets": _safetensors(
        {"__metadata__": _HYPE, "t": {**_F32, "data_offsets": ["0", "4"]}}, b"\0" * 4
    ),
    "negative shape": _safetensors({"__metadata__": _HYPE, "t": {**_F32, "shape": [-1]}}, b"\0" * 4),
    "offsets too short": _safetensors({"__metadata__": _HYPE, "t": {**_F32, "shape": [1000]}}, b"\0" * 4),
    "unknown dtype": _safetensors({"__metadata__": _HYPE, "t": {**_F32, "dtype": "X9"}}, b"\0" * 4),
    "model_config a list": _safetensors({"__metadata__": {**_HYPE, "model_config": "[1,2]"}}),
    "model_config not JSON": _safetensors({"__metadata__": {**_HYPE, "model_config": "{"}}),
    "model_config invalid": _safetensors({"__metadata__": {**_HYPE, "model_config": '{"geometry": "x"}'}}),
    "model_config bad types": _safetensors({"__metadata__": {**_HYPE, "model_config": '{"vision": 5}'}}),
    "extra not JSON": _safetensors({"__metadata__": {**_HYPE, "extra": "x"}}),
    "header a list": _safetensors([1, 2]),  # type: ignore[arg-type]
    "deeply nested header": struct.pack("<Q", 20000) + b"[" * 20000,
    "5 bytes": b"\x01\x02\x03\x04\x05",
    "empty": b"",
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_checkpoint_is_a_clear_error_naming_the_file(tmp_path, name):
    from click.testing import CliRunner

    from hype.checkpoint import load_model_file
    from hype.cli import main
    from hype.io.weights import ModelFileError

    path = tmp_path / "bad.safetensors"
    path.write_bytes(MALFORMED[name])
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: "):
        load_checkpoint(path)
    # load_model_file also reads any open_clip file: either reader's error names the file.
    with pytest.raises((CheckpointError, ModelFileError), match=r"bad\.safetensors: "):
        load_model_file(path)
    result = CliRunner().invoke(main, ["export", str(path), str(tmp_path / "out")])
    assert result.exit_code == 1 and "Error: " in result.output and str(path) in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def test_a_small_header_cannot_make_the_loader_allocate_a_huge_model(tmp_path, model):
    """A 1 KB header whose config asks for a width-8192, 24-layer ViT (tens of GB) is refused after a
    meta-device build, before any of that memory is allocated (`hype export` loads through here)."""
    from memory_support import run_bounded

    path = save_checkpoint(tmp_path / "m.safetensors", model)
    meta = read_checkpoint_metadata(path)
    cfg = meta["model_config"]
    cfg["vision"].update(width=8192, layers=24, head_width=64)
    header = {"__metadata__": {"format": meta["format"], "model_config": json.dumps(cfg), "extra": "{}"}}
    small = tmp_path / "small.safetensors"
    small.write_bytes(
        _safetensors({**header, "t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    )
    assert small.stat().st_size < 2048
    setup = "import hype.models, open_clip\nfrom hype.convert.open_clip import export_open_clip"
    result = run_bounded(setup, f"export_open_clip({str(small)!r}, {str(tmp_path / 'out')!r})")
    assert result["error"].startswith("CheckpointError: ") and str(small) in result["error"], result
    assert result["growth_mb"] < 200, result


def test_saving_the_same_model_twice_gives_the_same_bytes(tmp_path, model):
    # safetensors writes its metadata in hash-map order (new each save): the header is rewritten sorted
    files = [save_checkpoint(tmp_path / f"{i}.safetensors", model, extra={"step": 1}) for i in range(6)]
    assert len({f.read_bytes() for f in files}) == 1
    assert read_checkpoint_metadata(files[0])["extra"] == {"step": 1}
    loaded = load_checkpoint(files[0]).state_dict()
    assert all(torch.equal(t, loaded[k]) for k, t in model.state_dict().items())


def test_a_hype_checkpoints_config_and_digest_are_read_without_open_clip(tmp_path, model):
    """`hype score` checks its --meru / --clip files in the driver (`model_ref`): with Ray the workers load
    the models, so the driver never builds one. Reading a hype checkpoint's config and digest imported
    open_clip (~4 s) for the open_clip sources' readers, which a hype checkpoint never reaches."""
    import subprocess
    import sys

    from hype.checkpoint import model_file_config, model_file_digest

    path = save_checkpoint(tmp_path / "m.safetensors", model)
    code = (
        "import sys\n"
        "from hype.checkpoint import model_file_config, model_file_digest\n"
        "print(model_file_config(sys.argv[1])['name'], model_file_digest(sys.argv[1]))\n"
        "print(sorted(m for m in ('open_clip', 'timm', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [f"tiny-hyperbolic {model_file_digest(path)}", "[]"]
    assert model_file_config(path) == model.config.to_dict()
