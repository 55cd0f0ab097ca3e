"""The `hype score --metadata` uid index: built in batches into columns of the declared size, sorted by one
integer sort and written in slices, against the earlier build (each file read whole, per-file structured
parts concatenated, `np.lexsort`, the sorted copy saved through an in-memory `.npy`). Same metadata, same
index bytes (asserted).

    python bench/metadata_index.py [--rows 8000000 --files 4]

Each build runs in its own child process (peak RSS cannot be reset between two builds in one process);
prints seconds and peak RSS growth of each, per row, and their ratios.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hype.data.uids import normalize_arrow_uids, pairs_to_arrow
from hype.io import read_parquet
from hype.scoring.metadata import INDEX_DTYPE, metadata_files


def earlier_build(folder: Path, index_path: Path, score_column: str) -> None:
    """The index build before issue 34 (its core, as it was)."""
    parts = []
    for i, path in enumerate(metadata_files(folder)):
        table = read_parquet(path, columns=["uid", score_column])
        hi, lo, valid = normalize_arrow_uids(table.column("uid"))
        rows = np.flatnonzero(valid)
        part = np.empty(len(rows), INDEX_DTYPE)
        part["hi"], part["lo"], part["file"] = hi[rows], lo[rows], i
        part["row"] = rows.astype(np.uint32)
        part["score"] = table.column(score_column).to_numpy(zero_copy_only=False).astype(np.float32)[rows]
        parts.append(part)
    index = np.concatenate(parts)
    index = index[np.lexsort((index["lo"], index["hi"]))]
    buf = io.BytesIO()
    np.save(buf, index, allow_pickle=False)
    index_path.write_bytes(buf.getvalue())


_CHILD = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
import metadata_index
from hype.scoring.metadata import build_index
def status(key):
    return int(next(x for x in open("/proc/self/status") if x.startswith(key + ":")).split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
rss = status("VmRSS")
t0 = time.perf_counter()
if {which!r} == "new":
    build_index({folder!r}, Path({out!r}), "clip_l14_similarity_score")
else:
    metadata_index.earlier_build(Path({folder!r}), Path({out!r}), "clip_l14_similarity_score")
print(json.dumps({{"s": time.perf_counter() - t0, "peak_mb": (status("VmHWM") - rss) / 2**20}}))
"""


def run(which: str, folder: Path, out: Path) -> dict:
    code = _CHILD.format(bench=str(Path(__file__).parent), which=which, folder=str(folder), out=str(out))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8_000_000)
    ap.add_argument("--files", type=int, default=4)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="hype-metadata-index-") as tmp:
        folder = Path(tmp) / "metadata"
        folder.mkdir()
        per = args.rows // args.files
        for f in range(args.files):
            hi = rng.integers(0, 2**63, per, dtype=np.uint64)
            lo = rng.integers(0, 2**63, per, dtype=np.uint64)
            hi[::1000], lo[::1000] = hi[0], lo[0]  # a repeated uid: resolves to its first row
            score = rng.random(per, dtype=np.float32)
            table = pa.table({"uid": pairs_to_arrow(hi, lo), "clip_l14_similarity_score": score})
            pq.write_table(table, folder / f"{f:04d}.parquet", row_group_size=1 << 20)
        new = run("new", folder, Path(tmp) / "new" / "index.npy")
        old = run("old", folder, Path(tmp) / "old.npy")
        same = (Path(tmp) / "new" / "index.npy").read_bytes() == (Path(tmp) / "old.npy").read_bytes()
        assert same, "the two builds disagree"
        n = per * args.files
        print(
            json.dumps(
                {
                    "rows": n,
                    "files": args.files,
                    "index_mb": round(n * INDEX_DTYPE.itemsize / 2**20, 1),
                    "batched_s": round(new["s"], 2),
                    "earlier_s": round(old["s"], 2),
                    "time_ratio": round(new["s"] / old["s"], 3),
                    "batched_peak_mb": round(new["peak_mb"], 1),
                    "earlier_peak_mb": round(old["peak_mb"], 1),
                    "peak_ratio": round(new["peak_mb"] / old["peak_mb"], 3),
                    "peak_bytes_per_row": {
                        "batched": round(new["peak_mb"] * 2**20 / n, 1),
                        "earlier": round(old["peak_mb"] * 2**20 / n, 1),
                    },
                    "identical_index": same,
                }
            )
        )


if __name__ == "__main__":
    main()
