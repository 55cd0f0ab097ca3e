"""The one model checkpoint format: a safetensors file whose header metadata holds the model config.

Loading never unpickles: safetensors is a flat tensor container, and the config is JSON. PyTorch pickle
files (released MERU / HYPE checkpoints) are refused with a pointer to `hype convert`, which opens them
with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import json
import math
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
        _sort_header(Path(tmp))
    return path


def _sort_header(path: Path) -> None:
    """Rewrite the file's JSON header with sorted keys, in place: safetensors writes its metadata in hash
    map order, which changes from one save to the next, so equal weights gave unequal files. Same
    content, same length (padded with spaces, as safetensors pads), so the tensor offsets hold."""
    header, _, n = _raw_header(path)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    if header is None or len(text) > n:
        return  # not expected from safetensors; the file stays as written
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(text.ljust(n))


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
        "model_config": _json_object(path, meta, "model_config"),
        "extra": _json_object(path, {"extra": "{}", **meta}, "extra"),
    }


def load_checkpoint(path: str | PathLike, *, device: str | torch.device = "cpu") -> torch.nn.Module:
    """Build the model from the stored config and load its weights (strict, bit-identical).

    The model is first built on the meta device and its tensors' shapes checked against the file's
    header, so memory is only allocated for a model whose every tensor the file holds."""
    from hype.models import create_model  # the model factory imports open_clip; keep this module light

    path = Path(path)
    meta = read_checkpoint_metadata(path)
    try:
        shapes = {
            k: tuple(v.shape)
            for k, v in create_model(meta["model_config"], device="meta").state_dict().items()
        }
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # ConfigError and malformed values
        raise CheckpointError(
            f"{path}: the stored model config is not valid ({e}); the file is damaged"
        ) from None
    stored = {k: tuple(v["shape"]) for k, v in _read_header(path).items() if k != "__metadata__"}
    _check_tensors(path, shapes, stored)
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


def _check_tensors(path: Path, want: dict[str, tuple], stored: dict[str, tuple]) -> None:
    missing = sorted(set(want) - set(stored))
    unexpected = sorted(set(stored) - set(want))
    shapes = sorted(k for k in set(want) & set(stored) if want[k] != stored[k])
    if missing or unexpected or shapes:
        wrong = [f"{k} {stored[k]} (config: {want[k]})" for k in shapes[:5]]
        raise CheckpointError(
            f"{path}: weights do not match the stored config (missing: {missing[:5]}, unexpected: "
            f"{unexpected[:5]}, wrong shapes: {wrong}); the file is damaged or not a hype checkpoint"
        )


def _json_object(path: Path, meta: dict, key: str) -> dict:
    try:
        value = json.loads(meta[key])
    except ValueError as e:
        raise CheckpointError(
            f"{path}: header entry {key!r} is not valid JSON ({e}); the file is damaged"
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{path}: header entry {key!r} holds a {type(value).__name__}, not a JSON object; the file is "
            "damaged"
        )
    return value


def _read_header(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    size = path.stat().st_size
    header, head, n = _raw_header(path)
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
    ends = [_entry_end(path, k, v) for k, v in header.items()]
    expected = 8 + n + max(ends, default=0)
    if size < expected:
        raise CheckpointError(f"{path}: truncated: {size} bytes on disk, {expected} expected; re-copy it")
    return header


def _raw_header(path: Path) -> tuple[object, bytes, int]:
    """(the parsed JSON header or None, the first 8 bytes, the header length), nothing validated."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return None, head, 0
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return None, head, n
        try:
            return json.loads(f.read(n)), head, n
        except (UnicodeDecodeError, ValueError, RecursionError):
            return None, head, n


def is_hype_checkpoint(path: str | PathLike) -> bool:
    """True for a file whose header says it is hype's format, damaged or not (loading it then names
    the damage), False for any other file."""
    p = Path(path)
    try:
        header = _raw_header(p)[0] if p.is_file() else None
    except OSError:
        return False
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return isinstance(meta, dict) and meta.get("format") == FORMAT


# safetensors' dtype names and their sizes in bytes.
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip


def _entry_end(path: Path, key: str, entry: object) -> int:
    """Where the header entry `key`'s data ends; any malformed entry is a `CheckpointError`."""
    if key == "__metadata__":
        if not isinstance(entry, dict) or not all(isinstance(v, str) for v in entry.values()):
            raise CheckpointError(f"{path}: damaged header: __metadata__ is not a map of strings")
        return 0
    problem = None
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        problem = "is not a {dtype, shape, data_offsets} entry"
    elif entry["dtype"] not in _DTYPE_BYTES:
        problem = f"has an unknown dtype {entry['dtype']!r}"
    elif not _ints(entry["shape"]) or not _ints(entry["data_offsets"]) or len(entry["data_offsets"]) != 2:
        problem = "has a shape or data_offsets that are not non-negative integers"
    else:
        start, end = entry["data_offsets"]
        numel = math.prod(entry["shape"])
        if end - start != numel * _DTYPE_BYTES[entry["dtype"]]:
            problem = f"spans bytes {start}..{end}, which does not hold {numel} elements of {entry['dtype']}"
    if problem:
        raise CheckpointError(f"{path}: damaged header: tensor {key!r} {problem}; the file is corrupt")
    return entry["data_offsets"][1]


def _ints(value: object) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def is_open_clip_source(path: str | PathLike) -> bool:
    """True for a folder (open_clip's files) and for any model file that is not hype's own: what
    `load_model_file` hands to `hype.models.open_clip_files` rather than reading as a hype checkpoint."""
    p = Path(path)
    return p.is_dir() or (p.is_file() and not is_hype_checkpoint(p))


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
    from hype.models.open_clip_files import read_open_clip

    p = Path(path)
    if is_open_clip_source(p):
        return read_open_clip(p, arch=arch, geometry=geometry, native=not hype_towers).model.to(device)
    if arch is not None or geometry is not None:
        raise CheckpointError(f"{p}: a hype checkpoint carries its own config; drop --arch/--geometry")
    return load_checkpoint(p, device=device)


def model_file_digest(path: str | PathLike, digest=None) -> str:
    """Content digest of what `load_model_file(path)` reads, each file hashed with `digest` (default:
    `hype.io.sha256_file`); an open_clip source's covers its weights and the config beside them."""
    from hype.io import sha256_file

    digest = digest or sha256_file
    if is_open_clip_source(path):
        from hype.models.open_clip_files import source_digest  # imports open_clip: only for its sources

        return source_digest(path, digest)
    return digest(path)


def model_file_config(path: str | PathLike) -> dict:
    """The model config (as a dict) of what `load_model_file(path)` returns. A hype checkpoint's is read
    from its header; an open_clip source's needs its tensors (an OpenAI release says nothing else)."""
    if is_open_clip_source(path):
        from hype.models.open_clip_files import read_open_clip  # imports open_clip: only for its sources

        return read_open_clip(path, native=True).model.config.to_dict()
    return read_checkpoint_metadata(path)["model_config"]
