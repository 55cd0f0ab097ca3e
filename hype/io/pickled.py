"""Numpy arrays pickled inside PyTorch files, read without running pickled code.

`torch.save(array, path)` of a numpy array (DataComp releases its k-means centroids this way) writes a
zip holding `<archive>/data.pkl`, the array's pickle. `torch.load(weights_only=True)` refuses it (numpy
globals, and protocol 4's FRAME opcode), and a plain `torch.load` would run whatever the pickle names.
This unpickler resolves exactly the names numpy's array pickle needs (`_reconstruct`, `ndarray`, `dtype`,
and protocol 2's latin-1 bytes) and refuses every other global and every torch storage, so a file that
holds anything but plain arrays is an error, never executed code.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from os import PathLike
from pathlib import Path

import numpy as np

try:
    from numpy._core.multiarray import _reconstruct
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct


def _latin1_bytes(text: str, encoding: str) -> bytes:
    # Pickle protocol 2 (torch.save's default) stores bytes as `_codecs.encode(text, "latin1")`.
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r} is not how pickle stores bytes")
    return text.encode("latin1")


# (module, name) as numpy 1 and numpy 2 write them -> the object it names
_ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_bytes,
}


class PickledArrayError(ValueError):
    """A file that is not a numpy array pickled by torch.save; the message names the file."""


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"it refers to {module}.{name}, not only to numpy arrays") from None

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds torch tensors, not a numpy array")


def read_pickled_array(path: str | PathLike) -> np.ndarray:
    """The numpy array that `torch.save(array, path)` wrote (zip format, any pickle protocol)."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(names) != 1:
                raise PickledArrayError(f"{path}: not a PyTorch file (no single data.pkl inside the zip)")
            data = z.read(names[0])
    except (zipfile.BadZipFile, OSError) as e:
        raise PickledArrayError(f"{path}: not a PyTorch (zip) file ({e})") from None
    try:
        # Only the allow-listed numpy names can be resolved: nothing else is called.
        obj = _ArrayUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as e:
        raise PickledArrayError(f"{path}: not a plain numpy array pickled by torch.save: {e}") from None
    if not isinstance(obj, np.ndarray):
        raise PickledArrayError(f"{path}: holds a {type(obj).__name__}, not a numpy array")
    return obj
