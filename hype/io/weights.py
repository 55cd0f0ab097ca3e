"""Reading model weight files without running pickled code: safetensors, PyTorch zip/pickle files opened
with `torch.load(weights_only=True)`, and the state dict inside the usual wrappers. DESIGN §6, §9.

Every model file hype did not write itself (released MERU / HYPE checkpoints, open_clip state dicts,
`open_clip_train` checkpoints, OpenAI's archives) comes in through `load_source`, so there is one place
where "never unpickle untrusted code" is enforced. This module imports torch (unlike the rest of
`hype.io`); it is imported only by code that loads weights.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor

# torch.load(weights_only=True) could be made to run code before torch 2.6 (CVE-2025-32434).
SAFE_TORCH_LOAD = (2, 6)

# How many keys an error lists before summarizing the rest: enough to see the pattern, short enough to read.
_MAX_LISTED = 12


class ModelFileError(ValueError):
    """A model file that cannot be read or used; the message names the file and the fix."""


# --- loading ------------------------------------------------------------------------------------


def load_source(path: str | Path) -> Any:
    """The object stored in a released `.pt/.pth` (or `.safetensors`) file, without unpickling code.

    PyTorch files are opened only with `weights_only=True`, which restores tensors and plain
    containers and refuses any other pickled object instead of executing it. A TorchScript archive
    (OpenAI's CLIP releases), which `weights_only=True` refuses, gives its state dict, read by
    `hype.io.torchscript` without running its code.
    """
    from hype.io.torchscript import TorchScriptError, is_torchscript_archive, read_torchscript_state_dict

    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path}: checkpoint not found")
    if is_torchscript_archive(path):
        try:
            return read_torchscript_state_dict(path)
        except TorchScriptError as e:
            raise ModelFileError(str(e)) from None
    if _is_safetensors(path):
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise ModelFileError(f"{path}: unreadable safetensors file ({e})") from e
    require_safe_torch_load(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # The weights-only unpickler refuses a global (a class or function to call) by name; any other
        # failure (an unknown opcode, a truncated stream) means the bytes are not a checkpoint at all.
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        if found or re.search(r"unsupported (global|class)", str(e), re.IGNORECASE):
            what = f" (it references `{found.group(1)}`)" if found else ""
            raise ModelFileError(
                f"{path}: the file contains pickled Python objects besides tensors{what}. hype opens "
                "checkpoints with torch.load(weights_only=True) and will not execute pickled code. Load "
                "it once in an environment you trust, keep only the tensors "
                "(torch.save({'model': state_dict}, 'clean.pt')) and convert that file."
            ) from None
        detail = re.search(r"WeightsUnpickler error: \s*(.+)", str(e))
        raise ModelFileError(
            f"{path}: not a readable PyTorch checkpoint ({detail.group(1).strip() if detail else e}); the "
            "file may be truncated or of another format; download it again"
        ) from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - torch.load raises many types (IndexError, ...) on malformed bytes
        detail = str(e).strip() or type(e).__name__
        raise ModelFileError(
            f"{path}: not a readable PyTorch checkpoint ({detail}); the file may be truncated or of "
            "another format; download it again"
        ) from None


def require_safe_torch_load(path: str | Path) -> None:
    """Refuse to open `path` with torch.load on a torch whose weights-only unpickler can be bypassed."""
    from torch.torch_version import TorchVersion

    if TorchVersion(torch.__version__) < SAFE_TORCH_LOAD:
        need = ".".join(map(str, SAFE_TORCH_LOAD))
        raise ModelFileError(
            f"{path}: not opened: torch {torch.__version__} has a torch.load(weights_only=True) that a "
            f"crafted file can make run code (CVE-2025-32434); upgrade with pip install 'torch>={need}' "
            "(safetensors files load on any torch)"
        )


def _is_safetensors(path: Path) -> bool:
    # A safetensors file starts with an 8-byte little-endian header length followed by '{'.
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"


def unwrap_state_dict(
    obj: Any, path: str | Path, wrappers: tuple[str, ...] = ("model", "state_dict")
) -> tuple[dict[str, Tensor], list[str]]:
    """The flat state dict inside a loaded checkpoint and the top-level keys left aside.

    Accepts `{"model": sd, ...}` (MERU's `CheckpointManager`), `{"state_dict": sd, ...}` (OpenCLIP
    training) or a bare state dict, and strips a DistributedDataParallel `module.` prefix.
    """
    if not isinstance(obj, Mapping):
        raise ModelFileError(
            f"{path}: expected a dict of tensors (a state dict) or {{'model': state_dict}}, "
            f"found a {type(obj).__name__}"
        )
    ignored: list[str] = []
    for name in wrappers:
        inner = obj.get(name)
        if isinstance(inner, Mapping):
            ignored = sorted(str(k) for k in obj if k != name)
            obj = inner
            break
    sd = dict(obj)
    bad = sorted(str(k) for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, Tensor))
    if bad:
        raise ModelFileError(
            f"{path}: not a state dict: entries that are not tensors: {listing(bad)}; expected a file "
            f"saved as torch.save({{'model': model.state_dict()}}, ...)"
        )
    if sd and all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    return sd, ignored


def listing(items: list[str]) -> str:
    """`a, b, c, ... and N more`: enough of a key list to see the pattern, short enough to read."""
    shown = ", ".join(items[:_MAX_LISTED])
    more = len(items) - _MAX_LISTED
    return shown + (f", ... and {more} more" if more > 0 else "")
