"""The run directory's Parquet writer settings against pyarrow's defaults with snappy (the earlier setting).

Two tables of the shapes `hype score` writes: a scores-table part (`hype.table.schema.SCHEMA`: random
128-bit uids as hex, five float32 metrics, the shard path) and a per-shard embed output (uid, caption,
two float32 scores, MERU image/text and CLIP image embeddings). For each, the bytes per row, the time to
write and to read back the columns a selection reads (uid + metrics; for the embed output, everything),
best of `--repeats`, the two settings alternating. Prints the new / old ratios.

    python bench/parquet_writer.py [--rows 100000] [--embed-rows 10000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from hype.data.uids import pairs_to_arrow  # noqa: E402
from hype.scoring.rundir import parquet_bytes  # noqa: E402
from hype.table.schema import SCHEMA  # noqa: E402

OLD = {"compression": "snappy", "row_group_size": 1 << 20, "write_statistics": True}
METRICS = ["uid", "eps_i", "eps_t", "neg_d_l", "cos_theta", "c_in"]


def _uids(rng: np.random.Generator, n: int) -> pa.Array:
    hi = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
    lo = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
    return pairs_to_arrow(hi, lo).cast(pa.string())


def scores_table(n: int) -> pa.Table:
    rng = np.random.default_rng(0)
    cols = {
        "uid": _uids(rng, n),
        "eps_i": pa.array(rng.normal(0.2, 0.1, n).astype(np.float32)),
        "eps_t": pa.array(rng.normal(0.05, 0.1, n).astype(np.float32)),
        "neg_d_l": pa.array(rng.normal(-1.0, 0.2, n).astype(np.float32)),
        "cos_theta": pa.array(rng.normal(0.3, 0.05, n).astype(np.float32)),
        "c_in": pa.array(np.where(rng.random(n) < 0.25, 10.0, 0.0).astype(np.float32)),
        "shard": pa.array(np.repeat([f"pool/{i:08d}.tar" for i in range(n // 10_000 + 1)], 10_000)[:n]),
        "key": pa.array([f"{i:09d}" for i in range(n)]),
        "text": pa.nulls(n, pa.string()),
        "width": pa.array(rng.integers(64, 4096, n).astype(np.int32)),
        "height": pa.array(rng.integers(64, 4096, n).astype(np.int32)),
    }
    return pa.Table.from_arrays([cols[f.name] for f in SCHEMA], schema=SCHEMA)


def embed_table(n: int, meru_dim: int = 512, clip_dim: int = 768) -> pa.Table:
    rng = np.random.default_rng(1)

    def emb(d: int) -> pa.Array:
        x = rng.normal(0, 1, (n, d)).astype(np.float32)
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        return pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), d)

    return pa.table(
        {
            "uid": _uids(rng, n),
            "text": pa.array([f"a photo of item {i % 997} on a table" for i in range(n)]),
            "neg_d_l": pa.array(rng.normal(-1.0, 0.2, n).astype(np.float32)),
            "cos_theta": pa.array(rng.normal(0.3, 0.05, n).astype(np.float32)),
            "meru_img": emb(meru_dim),
            "meru_txt": emb(meru_dim),
            "clip_img": emb(clip_dim),
        }
    )


def measure(table: pa.Table, columns: list[str] | None, repeats: int) -> dict:
    out: dict[str, dict] = {}
    for _ in range(repeats):
        for name in ("old", "new"):
            t0 = time.perf_counter()
            if name == "old":
                buf = io.BytesIO()
                pq.write_table(table, buf, **OLD)
                data = buf.getvalue()
            else:
                data = parquet_bytes(table)
            write = time.perf_counter() - t0
            t0 = time.perf_counter()
            back = pq.read_table(io.BytesIO(data), columns=columns)
            read = time.perf_counter() - t0
            assert back.equals(table.select(columns) if columns else table)  # same values either way
            meta = pq.ParquetFile(io.BytesIO(data)).metadata
            chunks = [
                meta.row_group(g).column(c)
                for g in range(meta.num_row_groups)
                for c in range(meta.num_columns)
            ]
            wanted = sum(
                c.total_compressed_size
                for c in chunks
                if columns is None or c.path_in_schema.split(".")[0] in columns
            )
            first = {
                "bytes_per_row": len(data) / table.num_rows,
                "read_bytes_per_row": wanted / table.num_rows,
            }
            r = out.setdefault(name, {**first, "write_s": write, "read_s": read})
            r["write_s"], r["read_s"] = min(r["write_s"], write), min(r["read_s"], read)
    keys = ("bytes_per_row", "read_bytes_per_row", "write_s", "read_s")
    out["ratio"] = {k: out["new"][k] / out["old"][k] for k in keys}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000, help="rows of the scores-table part")
    p.add_argument("--embed-rows", type=int, default=10_000, help="rows of the embed output")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    results = {
        "scores part (select reads uid + metrics)": measure(scores_table(args.rows), METRICS, args.repeats),
        "embed output (read whole)": measure(embed_table(args.embed_rows), None, args.repeats),
    }
    print(json.dumps(results, indent=2))
    for name, r in results.items():
        o, n, q = r["old"], r["new"], r["ratio"]
        print(
            f"{name}: file {o['bytes_per_row']:.1f} -> {n['bytes_per_row']:.1f} bytes/row "
            f"(x{q['bytes_per_row']:.2f}), columns read {o['read_bytes_per_row']:.1f} -> "
            f"{n['read_bytes_per_row']:.1f} (x{q['read_bytes_per_row']:.2f}), write x{q['write_s']:.2f}, "
            f"read x{q['read_s']:.2f} (new / old)"
        )


if __name__ == "__main__":
    main()
