"""The per-shard embedding table written by the embed stage (`RUN_DIR/embed/<shard id>.parquet`).

One row per embedded sample, in the order of the input tar:

| column      | type                          | meaning                                                 |
|-------------|-------------------------------|---------------------------------------------------------|
| uid         | string                        | 32 lowercase hex chars, from the sample's .json         |
| key         | string                        | sample key inside the tar                               |
| text        | string                        | caption (stripped; may be empty)                        |
| width       | int32                         | json original_width, else the decoded image's width     |
| height      | int32                         | json original_height, else the decoded height           |
| neg_d_l     | float32                       | -d_L between the MERU image and text embeddings         |
| cos_theta   | float32                       | CLIP cosine (or the metadata's CLIP score)              |
| meru_img    | fixed_size_list<float32>[n]   | MERU image embedding, space components on the hyperboloid |
| meru_txt    | fixed_size_list<float32>[n]   | MERU text embedding, space components                   |
| clip_img    | fixed_size_list<float32>[d]   | CLIP image embedding, L2-normalized (c_IN clustering)   |
| clip_txt    | fixed_size_list<float32>[d]   | CLIP text embedding, L2-normalized; only with embed.clip_txt |

Fixed-size lists keep each embedding contiguous: `fixed_list_to_numpy` reads a column into an (rows, n)
float32 array without a copy per row. The schema metadata records the MERU curvature and cone constant
K the embeddings were made with (`hype.curv`, `hype.K`), so later stages need not load the model.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from hype.io import read_parquet, read_parquet_schema

PAIR_COLUMNS = ("uid", "key", "text", "width", "height", "neg_d_l", "cos_theta")
EMBEDDING_COLUMNS = ("meru_img", "meru_txt", "clip_img")


def embed_schema(meru_dim: int, clip_dim: int, curv: float, K: float, *, clip_txt: bool = False) -> pa.Schema:
    fields = [
        pa.field("uid", pa.string(), nullable=False),
        pa.field("key", pa.string()),
        pa.field("text", pa.string()),
        pa.field("width", pa.int32()),
        pa.field("height", pa.int32()),
        pa.field("neg_d_l", pa.float32()),
        pa.field("cos_theta", pa.float32()),
        pa.field("meru_img", pa.list_(pa.float32(), meru_dim)),
        pa.field("meru_txt", pa.list_(pa.float32(), meru_dim)),
        pa.field("clip_img", pa.list_(pa.float32(), clip_dim)),
    ]
    if clip_txt:  # opt-in (embed.clip_txt): tables without it keep their bytes
        fields.append(pa.field("clip_txt", pa.list_(pa.float32(), clip_dim)))
    return pa.schema(fields, metadata={"hype.curv": repr(float(curv)), "hype.K": repr(float(K))})


def fixed_list(array: np.ndarray) -> pa.FixedSizeListArray:
    """(rows, n) float32 array -> fixed_size_list<float32>[n] column."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return pa.FixedSizeListArray.from_arrays(pa.array(array.reshape(-1)), array.shape[1])


def fixed_list_to_numpy(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """fixed_size_list<float32>[n] column -> (rows, n) float32 array."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    n = column.type.list_size
    flat = column.flatten().to_numpy(zero_copy_only=False)
    # A writable copy: the Arrow buffer is read-only, and torch.from_numpy wants writable memory.
    return np.array(flat, dtype=np.float32).reshape(-1, n)


def build_table(
    pairs: dict[str, list | np.ndarray], embeddings: dict[str, np.ndarray], schema: pa.Schema
) -> pa.Table:
    arrays = [pa.array(pairs[name], type=schema.field(name).type) for name in PAIR_COLUMNS]
    arrays += [fixed_list(embeddings[name]) for name in schema.names[len(arrays) :]]
    return pa.Table.from_arrays(arrays, schema=schema)


def read_columns(path, columns: list[str]) -> pa.Table:
    return read_parquet(path, columns=list(columns))


def read_embeddings(path, column: str) -> np.ndarray:
    return fixed_list_to_numpy(read_parquet(path, columns=[column]).column(column))


def model_scalars(path) -> tuple[float, float]:
    """(curv, K) recorded in an embed table's schema metadata."""
    meta = read_parquet_schema(path).metadata or {}
    return float(meta[b"hype.curv"]), float(meta[b"hype.K"])
