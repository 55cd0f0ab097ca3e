"""hype's I/O layer: atomic writes, tolerant reads, digests, webdataset tars and the one lock on an output
(see `files`, `digests`, `tar`, `lock`).

A core module: it imports the standard library, numpy, pyarrow and (for URLs, on first use) fsspec and
universal_pathlib, not torch, not webdataset (which imports torch), and nothing of the commands'
packages, so every command reads and writes files one way, on a local disk or an object store
(`storage`).
`hype.io.torchscript` (TorchScript archives read as state dicts) needs torch, so it is not imported here.
"""

from hype.io.digests import (
    blake2b32_bytes,
    blake2b128_bytes,
    blake2b128_chunks,
    blake2b128_file,
    sha1_bytes,
    sha256_bytes,
    sha256_chunks,
    sha256_file,
)
from hype.io.files import (
    NPY_ERRORS,
    UnsafePathError,
    atomic_path,
    atomic_sink,
    atomic_write,
    cached_copy,
    check_own_folder,
    create_own_file,
    is_temp_name,
    json_text,
    load_npy,
    local_file,
    make_folder,
    open_input,
    overlap,
    parquet_bytes,
    read_bytes,
    read_json,
    read_parquet,
    read_parquet_schema,
    replace_tree,
    save_npy,
    sync,
    sync_path,
    write_bytes,
    write_json,
    write_parquet,
    write_text,
)
from hype.io.pickled import PickledArrayError, read_pickled_array
from hype.io.storage import AnyPath, StorageError, is_url, location

__all__ = [
    "blake2b32_bytes",
    "blake2b128_bytes",
    "blake2b128_chunks",
    "blake2b128_file",
    "sha1_bytes",
    "sha256_bytes",
    "sha256_chunks",
    "sha256_file",
    "NPY_ERRORS",
    "AnyPath",
    "StorageError",
    "UnsafePathError",
    "is_url",
    "location",
    "atomic_path",
    "atomic_sink",
    "atomic_write",
    "cached_copy",
    "check_own_folder",
    "create_own_file",
    "is_temp_name",
    "json_text",
    "load_npy",
    "local_file",
    "make_folder",
    "open_input",
    "overlap",
    "read_bytes",
    "read_parquet",
    "read_parquet_schema",
    "PickledArrayError",
    "parquet_bytes",
    "read_json",
    "read_pickled_array",
    "replace_tree",
    "save_npy",
    "sync",
    "sync_path",
    "write_bytes",
    "write_json",
    "write_parquet",
    "write_text",
]
