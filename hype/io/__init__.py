"""hype's I/O layer: atomic writes, tolerant reads, digests and webdataset tars (see `files`, `tar`).

A core module: it imports the standard library, numpy and pyarrow only (not torch, not webdataset, which
imports torch) and nothing of the commands' packages, so every command reads and writes files one way.
`hype.io.torchscript` (TorchScript archives read as state dicts) needs torch, so it is not imported here.
"""

from hype.io.files import (
    atomic_path,
    atomic_write,
    bytes_digest,
    file_digest,
    is_temp_name,
    json_text,
    open_input,
    parquet_bytes,
    read_json,
    replace_tree,
    save_npy,
    sync,
    write_bytes,
    write_json,
    write_parquet,
    write_text,
)
from hype.io.pickled import PickledArrayError, read_pickled_array

__all__ = [
    "atomic_path",
    "atomic_write",
    "bytes_digest",
    "file_digest",
    "is_temp_name",
    "json_text",
    "open_input",
    "PickledArrayError",
    "parquet_bytes",
    "read_json",
    "read_pickled_array",
    "replace_tree",
    "save_npy",
    "sync",
    "write_bytes",
    "write_json",
    "write_parquet",
    "write_text",
]
