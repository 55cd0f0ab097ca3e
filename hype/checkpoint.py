"""The one model checkpoint format: a safetensors file whose header metadata holds the model config.

Loading never unpickles: safetensors is a flat tensor container, and the config is JSON. PyTorch pickle
files (released MERU / HYPE checkpoints) are refused with a pointer to `hype convert`, which opens them
with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import struct
from os import PathLike
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from hype.io import atomic_path

FORMAT = "hype-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint file that is missing, truncated, of another format or of another model."""


def save_checkpoint(path: str | PathLike, model: torch.nn.Module, *, extra: dict | None = None) -> Path:
    """Write `model`'s weights and config to `path` atomically (temp file, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": FORMAT,
        "model_config": json.dumps(model.config.to_dict(), sort_keys=True),
        "extra": json.dumps(extra or {}, sort_keys=True),
    }
    # safetensors creates files 0600; atomic_path gives the user's default mode, so a cluster can share them.
    with atomic_path(path) as tmp:
        save_model(model, str(tmp), metadata=metadata)
    return path


def read_checkpoint_metadata(path: str | PathLike) -> dict:
    """Validate the file's structure and return `{"format", "model_config", "extra"}` (parsed)."""
    path = Path(path)
    header = _read_header(path)
    meta = header.get("__metadata__") or {}
    if meta.get("format") != FORMAT or "model_config" not in meta:
        raise CheckpointError(
            f"{path}: a safetensors file without a hype model config; it was not written by hype "
            "(`hype train` or `hype convert` write loadable checkpoints)"
        )
    return {
        "format": meta["format"],
        "model_config": json.loads(meta["model_config"]),
        "extra": json.loads(meta.get("extra", "{}")),
    }


def load_checkpoint(path: str | PathLike, *, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the model from the stored config and load its weights (strict, bit-identical)."""
    from hype.models import create_model  # the model factory imports open_clip; keep this module light

    path = Path(path)
    meta = read_checkpoint_metadata(path)
    model = create_model(meta["model_config"])
    try:
        missing, unexpected = load_model(model, str(path), strict=False, device=str(device))
    except SafetensorError as e:
        raise CheckpointError(f"{path}: unreadable tensor data ({e}); the file may be corrupt") from e
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: weights do not match the stored config (missing: {sorted(missing)[:5]}, "
            f"unexpected: {sorted(unexpected)[:5]})"
        )
    return model.to(device).eval()


def _read_header(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        header = None
        if len(head) == 8:
            (n,) = struct.unpack("<Q", head)
            if n <= size - 8:
                try:
                    header = json.loads(f.read(n))
                except (UnicodeDecodeError, json.JSONDecodeError):
                    header = None
    if not isinstance(header, dict):
        # Only now sniff for pickles: a valid header length may itself start with these bytes.
        if head[:2] == b"PK" or head[:1] == b"\x80":
            raise CheckpointError(
                f"{path}: a PyTorch pickle checkpoint; hype only loads safetensors. Convert a released "
                "MERU or HYPE checkpoint with `hype convert meru|hype-release PATH --out OUT.safetensors`"
            )
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated ({size} bytes); not a safetensors checkpoint")
        raise CheckpointError(f"{path}: not a safetensors file (unreadable or truncated header)")
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        raise CheckpointError(f"{path}: truncated: {size} bytes on disk, {expected} expected; re-copy it")
    return header


def load_model_file(
    path: str | PathLike,
    *,
    arch: str | None = None,
    geometry: str | None = None,
    device: str | torch.device = "cpu",
    hype_towers: bool = False,
) -> torch.nn.Module:
    """A model from a hype checkpoint or from any open_clip file or folder the user already has (OpenAI's
    releases, Hugging Face folders, open_clip_train checkpoints, the EuCLIP fork's runs). DESIGN §6.

    An open_clip architecture hype does not translate comes back as open_clip's own model behind the same
    interface (`hype.models.open_clip_native.OpenClipModel`: a CLIP scorer and eval model); a caller that
    needs hype's own towers (`hype train --init`) passes `hype_towers=True` and gets the refusal instead."""
    from hype.models.open_clip_files import is_open_clip_source, read_open_clip

    p = Path(path)
    if is_open_clip_source(p):
        return read_open_clip(p, arch=arch, geometry=geometry, native=not hype_towers).model.to(device)
    if arch is not None or geometry is not None:
        raise CheckpointError(f"{p}: a hype checkpoint carries its own config; drop --arch/--geometry")
    return load_checkpoint(p, device=device)


def model_file_digest(path: str | PathLike, digest=None) -> str:
    """Content digest of what `load_model_file(path)` reads, each file hashed with `digest` (default:
    `hype.io.file_digest`); an open_clip source's covers its weights and the config beside them."""
    from hype.io import file_digest
    from hype.models.open_clip_files import is_open_clip_source, source_digest

    digest = digest or file_digest
    return source_digest(path, digest) if is_open_clip_source(path) else digest(path)


def model_file_config(path: str | PathLike) -> dict:
    """The model config (as a dict) of what `load_model_file(path)` returns. A hype checkpoint's is read
    from its header; an open_clip source's needs its tensors (an OpenAI release says nothing else)."""
    from hype.models.open_clip_files import is_open_clip_source, read_open_clip

    if is_open_clip_source(path):
        return read_open_clip(path, native=True).model.config.to_dict()
    return read_checkpoint_metadata(path)["model_config"]
