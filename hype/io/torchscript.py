"""TorchScript archives (OpenAI's released CLIP `.pt` files) read as a state dict, without executing code.

OpenAI released CLIP as traced TorchScript modules saved with `torch.jit.save`. `torch.jit.load` would
compile the archive's code and `torch.load(weights_only=True)` refuses such archives, so this module
reads the zip itself:

    <prefix>/data.pkl         the module tree: `__torch__.*` objects whose pickled state is a dict of
                              attributes (tensors, submodules, plain values) in slot order
    <prefix>/data/<key>       the raw bytes of each storage a tensor in data.pkl refers to
    <prefix>/code/**.py       the class definitions; `__parameters__` / `__buffers__` name which tensor
                              attributes are parameters and buffers (pickled state does not say)
    <prefix>/constants.pkl    tensors baked into the traced graph (what torch checks to call a zip
                              TorchScript); not part of the state dict
    <prefix>/byteorder        "little" or "big" (absent in older archives: little)

data.pkl is unpickled with an unpickler that resolves only the tensor rebuild functions, storage types
and `collections.OrderedDict`, turns every `__torch__.*` class into an inert placeholder that records
its state, and refuses any other global. The code files are read as text, never compiled. Keys, order
and membership follow `torch.jit.load(path).state_dict()`: per module its parameters holding a tensor,
then its buffers declared `Tensor` (TorchScript keeps non-persistent buffers, so they are included),
then its submodules; a tensor attribute that is neither (OpenAI's `attn_mask`) is left out.

Unlike the rest of `hype.io` this module imports torch, so `hype.io` does not import it: use
`from hype.io.torchscript import ...`.
"""

from __future__ import annotations

import ast
import collections
import io
import pickle
import re
import sys
import zipfile
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import torch

__all__ = ["TorchScriptError", "is_torchscript_archive", "read_torchscript_state_dict"]


class TorchScriptError(ValueError):
    """An archive that cannot be read as a TorchScript state dict; the message names the file and the fix."""


# The legacy `<Type>Storage` names the TorchScript pickler writes for each dtype (c10's ScalarType
# names). Quantized storages are left out: a quantized tensor needs `_rebuild_qtensor`, which is refused.
_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
    "ComplexHalfStorage": torch.complex32,
}


# The most bytes a non-tensor member (data.pkl, a code file) may declare: far above any real model's
# (OpenAI's ViT-L/14 has a few MB of code), far below what would strain memory.
_MAX_RECORD = 256 * 2**20


# --- detection ----------------------------------------------------------------------------------


def is_torchscript_archive(path: str | PathLike) -> bool:
    """True when `path` is a zip whose top folder holds `constants.pkl` (torch's own test, in
    `torch.serialization._is_torchscript_zip`); False for anything else, including unreadable files."""
    try:
        with zipfile.ZipFile(path) as zf:
            prefix = _prefix(zf.namelist())
            return prefix is not None and f"{prefix}/constants.pkl" in set(zf.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False


def _prefix(names: list[str]) -> str | None:
    # torch's reader takes the folder of the first record as the archive's name; every record lives in it.
    if not names or "/" not in names[0]:
        return None
    return names[0].split("/", 1)[0]


# --- reading ------------------------------------------------------------------------------------


def read_torchscript_state_dict(path: str | PathLike) -> dict[str, torch.Tensor]:
    """The state dict of the TorchScript module saved at `path`, as `torch.jit.load(path).state_dict()`
    returns it (CPU tensors, same names, order, dtypes and bytes), read without executing any code.

    Raises `TorchScriptError` for a missing, truncated or corrupt archive, a missing member, or a pickled
    reference to anything but tensors and TorchScript objects.
    """
    path = Path(path)
    if not path.is_file():
        raise TorchScriptError(f"{path}: file not found")
    try:
        with zipfile.ZipFile(path) as zf:
            return _Archive(path, zf).state_dict()
    except zipfile.BadZipFile as e:
        raise TorchScriptError(
            f"{path}: not a readable zip archive ({e}); the file is truncated or damaged; download it again"
        ) from None
    except (OSError, EOFError) as e:  # a member whose bytes end early (zlib, short reads)
        raise TorchScriptError(f"{path}: unreadable archive member ({e}); download the file again") from None


@dataclass
class _ClassDef:
    """What the archive's code says about one TorchScript class (read as text, never compiled)."""

    is_module: bool
    attributes: list[tuple[str, str]] = field(default_factory=list)  # (name, declared type), slot order
    parameters: set[str] = field(default_factory=set)
    buffers: set[str] = field(default_factory=set)


class _Archive:
    def __init__(self, path: Path, zf: zipfile.ZipFile):
        self.path, self.zf = path, zf
        names = zf.namelist()
        prefix = _prefix(names)
        if prefix is None or f"{prefix}/constants.pkl" not in set(names):
            raise TorchScriptError(
                f"{path}: not a TorchScript archive (no <name>/constants.pkl); for a file saved with "
                "torch.save load it as a state dict instead"
            )
        self.prefix, self.names = prefix, set(names)
        self.size = path.stat().st_size
        self.swap = self._byteorder() != sys.byteorder
        self.storages: dict[str, torch.Tensor] = {}

    def member(self, name: str) -> bytes:
        full = f"{self.prefix}/{name}"
        if full not in self.names:
            raise TorchScriptError(
                f"{self.path}: the archive has no member {full!r}; it is incomplete or not a TorchScript "
                "module saved with torch.jit.save; download it again"
            )
        return self.read(full)

    def read(self, full: str) -> bytes:
        """A non-tensor member (data.pkl, code, byteorder), its declared size bounded before reading."""
        declared = self.zf.getinfo(full).file_size
        if declared > _MAX_RECORD:
            raise TorchScriptError(
                f"{self.path}: member {full} declares {declared} bytes, more than any TorchScript record "
                f"({_MAX_RECORD} bytes); the archive is crafted or damaged and is not read"
            )
        return self.zf.read(full)

    def _byteorder(self) -> str:
        if f"{self.prefix}/byteorder" not in self.names:
            return "little"  # archives written before the record existed are little-endian
        order = self.member("byteorder").decode("ascii", "replace").strip()
        if order not in ("little", "big"):
            raise TorchScriptError(f"{self.path}: byteorder record says {order!r}, expected little or big")
        return order

    def state_dict(self) -> dict[str, torch.Tensor]:
        root = _Unpickler(self, self.member("data.pkl")).load_root()
        classes = self.classes()
        out: dict[str, torch.Tensor] = {}
        _Walk(self, classes, out).module(root, "", ())
        return out

    # --- class definitions ---

    def classes(self) -> dict[str, _ClassDef]:
        code = f"{self.prefix}/code/"
        found: dict[str, _ClassDef] = {}
        for name in sorted(self.names):
            if name.startswith(code) and name.endswith(".py"):
                qualifier = name[len(code) : -len(".py")].replace("/", ".")
                text = self.read(name).decode("utf-8", "replace")
                found.update(_parse_classes(qualifier, text))
        if not found:
            raise TorchScriptError(
                f"{self.path}: the archive has no class definitions under {code}; it is not a TorchScript "
                "module saved with torch.jit.save"
            )
        return found

    # --- storages ---

    def storage(self, record: _Storage) -> torch.Tensor:
        """The storage's elements as a 1-D tensor, read once per key (tensors that share a storage in the
        archive share memory here too, as with torch.jit.load)."""
        # One _Storage per key (the unpickler checks that every use agrees on its dtype and size).
        if record.key not in self.storages:
            self.storages[record.key] = self._read_storage(record)
        return self.storages[record.key]

    def _read_storage(self, record: _Storage) -> torch.Tensor:
        name = f"{self.prefix}/data/{record.key}"
        if name not in self.names:
            raise TorchScriptError(
                f"{self.path}: tensor data {name!r} is missing from the archive; download it again"
            )
        itemsize = torch.empty((), dtype=record.dtype).element_size()
        expected = record.numel * itemsize
        info = self.zf.getinfo(name)
        # torch.jit.save stores tensor data uncompressed, so an entry's bytes lie in the file itself: its
        # size is bounded by the file's before anything is allocated. A deflated entry could expand a
        # small file to gigabytes and is refused.
        if info.compress_type != zipfile.ZIP_STORED:
            raise TorchScriptError(
                f"{self.path}: tensor data {name} is compressed, which torch.jit.save never writes; the "
                "archive was rewritten or crafted and is not inflated. Re-save the model with torch.jit.save"
            )
        if info.file_size > self.size:
            raise TorchScriptError(
                f"{self.path}: tensor data {name} declares {info.file_size} bytes, more than the whole file "
                f"({self.size}); the archive is damaged; download it again"
            )
        size = info.file_size
        if size != expected:
            raise TorchScriptError(
                f"{self.path}: {name} holds {size} bytes, expected {expected} ({record.numel} elements of "
                f"{record.dtype}); the archive is damaged; download it again"
            )
        if expected == 0:
            return torch.empty(0, dtype=record.dtype)
        buf = bytearray(expected)
        with self.zf.open(name) as f:
            if f.readinto(buf) != expected:
                raise TorchScriptError(f"{self.path}: {name} ends early; download the file again")
        data = torch.frombuffer(buf, dtype=torch.uint8)
        if self.swap:
            data = _byteswap(data, record.dtype, itemsize)
        return data.view(record.dtype)


def _byteswap(data: torch.Tensor, dtype: torch.dtype, itemsize: int) -> torch.Tensor:
    # A complex number is two floats, each swapped on its own.
    unit = itemsize // 2 if dtype.is_complex else itemsize
    return data.view(-1, unit).flip(1).reshape(-1) if unit > 1 else data


# --- class definitions (text) -------------------------------------------------------------------

_CLASS = re.compile(r"class (\w+)(?:\((\w+)\))?\s*:")
_LIST = re.compile(r"  (__parameters__|__buffers__) = (\[.*\])\s*$")
_ATTR = re.compile(r"  (\w+) : ([^=]+?)\s*$")  # `name : Type`; `name : Final[int] = 3` is a constant
_QUOTED_ATTR = re.compile(r"  __annotations__\[(\"(?:[^\"\\]|\\.)*\")\] = ([^=]+?)\s*$")  # name "0"


def _parse_classes(qualifier: str, text: str) -> dict[str, _ClassDef]:
    """The classes one code file defines, by qualified name (`__torch__.a.b.Name` for code/__torch__/a/b.py).

    TorchScript prints a class header at column 0 and its attribute declarations two spaces in, before
    its methods; method signatures continue and bodies sit deeper, so only two-space lines are read.
    """
    found: dict[str, _ClassDef] = {}
    current: _ClassDef | None = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            m = _CLASS.match(line)
            current = _ClassDef(is_module=m.group(2) == "Module") if m else None
            if m:
                found[f"{qualifier}.{m.group(1)}"] = current
            continue
        if current is None or not line.startswith("  ") or line[2:3].isspace():
            continue
        if m := _LIST.match(line):
            names = ast.literal_eval(m.group(2))  # a list of string literals; literal_eval runs nothing
            (current.parameters if m.group(1) == "__parameters__" else current.buffers).update(names)
        elif m := _QUOTED_ATTR.match(line):
            current.attributes.append((ast.literal_eval(m.group(1)), m.group(2)))
        elif (m := _ATTR.match(line)) and m.group(1) != "__annotations__":
            current.attributes.append((m.group(1), m.group(2)))
    return found


# --- data.pkl -----------------------------------------------------------------------------------


class _Inert:
    """Base of the unpickler's own objects: pickle's BUILD may not modify them."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"unexpected state for a {type(self).__name__}")


class _StorageType(_Inert):
    """What `torch.<Type>Storage` resolves to: the dtype only (the class itself is never touched)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


class _Storage(_Inert):
    """A storage record: `<prefix>/data/<key>` holds `numel` elements of `dtype`."""

    __slots__ = ("key", "dtype", "numel")

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRecord(_Inert):
    """A tensor's place in its storage; turned into a tensor only if the state dict holds it."""

    __slots__ = ("storage", "offset", "size", "stride")

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]):
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


class _ScriptObject:
    """Stand-in for an object of a TorchScript class: its class name and the state pickled for it.

    Pickle creates it with `cls.__new__(cls)` and hands it its state through `__setstate__` (BUILD),
    which only records it; nothing of the class is ever looked up or called.
    """

    __slots__ = ("state",)
    qualname = "?"

    def __setstate__(self, state: Any) -> None:
        self.state = state


def _rebuild_tensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _TensorRecord:
    """Stands in for `torch._utils._rebuild_tensor_v2`: records where the tensor lies in its storage."""
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError(f"a tensor whose storage is a {type(storage).__name__}")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if not isinstance(storage_offset, int) or storage_offset < 0 or len(size) != len(stride):
        raise pickle.UnpicklingError(f"a tensor with offset {storage_offset!r}, size {size}, stride {stride}")
    return _TensorRecord(storage, storage_offset, size, stride)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> Any:
    """Stands in for `torch._utils._rebuild_parameter`: a parameter is its data in a state dict."""
    if not isinstance(data, _TensorRecord):
        raise pickle.UnpicklingError(f"a parameter holding a {type(data).__name__}")
    return data


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(isinstance(v, int) and v >= 0 for v in value):
        raise pickle.UnpicklingError(f"a tensor {what} that is not a tuple of non-negative ints: {value!r}")
    return tuple(value)


def _identity(value: Any, *_: Any) -> Any:
    return value


# Every global data.pkl may name besides `__torch__.*` classes and `torch.<Type>Storage`: the functions
# torch's TorchScript pickler writes, each replaced by an inert stand-in.
_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): collections.OrderedDict,  # the (empty) backward hooks of a tensor
    # Typed containers of attributes (List[int], ...): the value itself is what matters here.
    ("torch.jit._pickle", "build_intlist"): _identity,
    ("torch.jit._pickle", "build_doublelist"): _identity,
    ("torch.jit._pickle", "build_boollist"): _identity,
    ("torch.jit._pickle", "build_tensorlist"): _identity,
    ("torch.jit._pickle", "restore_type_tag"): _identity,
}


class _Unpickler(pickle.Unpickler):
    def __init__(self, archive: _Archive, data: bytes):
        super().__init__(io.BytesIO(data))
        self.archive = archive
        self.placeholders: dict[str, type[_ScriptObject]] = {}
        self.storages: dict[str, _Storage] = {}

    def load_root(self) -> _ScriptObject:
        path = self.archive.path
        try:
            root = self.load()
        except TorchScriptError:
            raise
        except Exception as e:  # any malformed stream: unknown opcode, bad arguments, early end
            raise TorchScriptError(
                f"{path}: {self.archive.prefix}/data.pkl is not a readable TorchScript module ({e}); the "
                "archive is damaged; download it again"
            ) from None
        if not isinstance(root, _ScriptObject):
            raise TorchScriptError(
                f"{path}: data.pkl holds a {type(root).__name__}, not a TorchScript module; save the model "
                "with torch.jit.save"
            )
        return root

    def find_class(self, module: str, name: str) -> Any:
        if module == "__torch__" or module.startswith("__torch__."):
            return self._placeholder(f"{module}.{name}")
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise TorchScriptError(
            f"{self.archive.path}: data.pkl refers to `{module}.{name}`, which is neither a tensor nor a "
            "TorchScript module; hype reads TorchScript archives without executing pickled code and will "
            "not load it. If you trust the file, load it with torch.jit.load, save "
            "torch.save(model.state_dict(), 'clean.pt') and use that file."
        )

    def _placeholder(self, qualname: str) -> type[_ScriptObject]:
        if qualname not in self.placeholders:
            self.placeholders[qualname] = type(
                qualname, (_ScriptObject,), {"__slots__": (), "qualname": qualname}
            )
        return self.placeholders[qualname]

    def persistent_load(self, pid: Any) -> _Storage:
        # ('storage', <Type>Storage, key, location, numel); the location (cpu, cuda:0) is ignored: CPU.
        if not (
            isinstance(pid, tuple)
            and len(pid) == 5
            and pid[0] == "storage"
            and isinstance(pid[1], _StorageType)
            and isinstance(pid[2], str)
            and isinstance(pid[4], int)
            and pid[4] >= 0
        ):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        key, dtype, numel = pid[2], pid[1].dtype, pid[4]
        known = self.storages.setdefault(key, _Storage(key, dtype, numel))
        if (known.dtype, known.numel) != (dtype, numel):
            raise pickle.UnpicklingError(f"storage {key!r} described twice differently")
        return known


# --- the module tree ----------------------------------------------------------------------------


class _Walk:
    """Collects the state dict the way `nn.Module.state_dict` does on a loaded ScriptModule: per module,
    its parameters, then its buffers, then its submodules, each in slot order."""

    def __init__(self, archive: _Archive, classes: dict[str, _ClassDef], out: dict[str, torch.Tensor]):
        self.archive, self.classes, self.out = archive, classes, out

    def module(self, obj: _ScriptObject, prefix: str, ancestors: tuple[int, ...]) -> None:
        path = self.archive.path
        cls = self.class_def(obj)
        if cls is None or not cls.is_module:
            raise TorchScriptError(f"{path}: {prefix or 'the root'} is a {obj.qualname}, not a module")
        if id(obj) in ancestors:
            raise TorchScriptError(
                f"{path}: module {prefix.rstrip('.')} contains itself; the archive is damaged"
            )
        state = getattr(obj, "state", None)
        if not isinstance(state, dict):
            raise TorchScriptError(
                f"{path}: module {obj.qualname} stores its state through its own __setstate__ (e.g. a "
                "quantized module), which hype does not run; convert such a model with torch.jit.load in an "
                "environment you trust"
            )
        attrs = [(name, kind, state[name]) for name, kind in cls.attributes if name in state]
        for name, _, value in attrs:
            if name in cls.parameters and isinstance(value, _TensorRecord):
                self.out[prefix + name] = self.tensor(value)
        for name, kind, value in attrs:
            # torch lists a buffer only when it is declared `Tensor` (an Optional[Tensor] one is left out).
            if name in cls.buffers and kind == "Tensor" and isinstance(value, _TensorRecord):
                self.out[prefix + name] = self.tensor(value)
        for name, _, value in attrs:
            if isinstance(value, _ScriptObject) and self.is_module(value):
                self.module(value, f"{prefix}{name}.", (*ancestors, id(obj)))

    def class_def(self, obj: _ScriptObject) -> _ClassDef | None:
        cls = self.classes.get(obj.qualname)
        # TorchBind classes (`__torch__.torch.classes.*`) live in the binary, not in the archive's code.
        if cls is None and not obj.qualname.startswith("__torch__.torch.classes."):
            raise TorchScriptError(
                f"{self.archive.path}: class {obj.qualname} has no definition under "
                f"{self.archive.prefix}/code/; the archive is incomplete; download it again"
            )
        return cls

    def is_module(self, obj: _ScriptObject) -> bool:
        cls = self.class_def(obj)
        return cls is not None and cls.is_module

    def tensor(self, record: _TensorRecord) -> torch.Tensor:
        base = self.archive.storage(record.storage)
        if 0 not in record.size:
            last = record.offset + sum((n - 1) * s for n, s in zip(record.size, record.stride, strict=True))
            if last >= base.numel():
                raise TorchScriptError(
                    f"{self.archive.path}: a tensor of size {list(record.size)} reaches element {last} of "
                    f"storage data/{record.storage.key}, which has {base.numel()}; the archive is damaged"
                )
        return base.as_strided(record.size, record.stride, record.offset)
