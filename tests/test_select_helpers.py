"""Helpers shared by the selection / reshard / report / submit tests: a synthetic world, a scores table and
DataComp's raw memmap subset files.

`hype score` is built elsewhere; these tests write schema-conformant scores tables themselves, with metric
values derived from the world's ground truth (each noise kind lowers the metric that should catch it) plus
Gaussian noise, so that selections, reports and reshards run on real pool shards.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from hype.table.schema import METRICS, SCHEMA, scores_dir


def make_world(out: Path, size: int = 600, seed: int = 0) -> Path:
    """A synthetic world (`hype synth`): small images, 256 samples per pool shard."""
    from hype.synth import make_world as synth

    synth(out, size, seed, clean_size=16, eval_size=8, reference_per_class=1, progress=False, workers=1)
    return out


def truth_scores(world: Path, seed: int = 0) -> pd.DataFrame:
    """One scores-table row per pool sample, metrics derived from the ground truth."""
    truth = pd.read_parquet(world / "truth.parquet")
    rng = np.random.default_rng(seed)
    n = len(truth)
    noise = truth["noise"].to_numpy()
    eps_i = rng.normal(0.20, 0.05, n) - 0.30 * (noise == "underspecified_image")
    eps_t = rng.normal(0.10, 0.05, n) - 0.30 * (noise == "underspecified_text")
    neg_d_l = rng.normal(-1.0, 0.10, n) - 1.0 * (noise == "misaligned")
    cos = rng.normal(0.30, 0.03, n) - 0.20 * (noise == "misaligned")
    c_in = np.where(rng.random(n) < 0.3, 10.0, 0.0)
    shards = world / "pool" / "shards"
    return pd.DataFrame(
        {
            "uid": truth["uid"],
            "eps_i": eps_i.astype(np.float32),
            "eps_t": eps_t.astype(np.float32),
            "neg_d_l": neg_d_l.astype(np.float32),
            "cos_theta": cos.astype(np.float32),
            "c_in": c_in.astype(np.float32),
            "shard": [str(shards / f"{s:08d}.tar") for s in truth["shard"]],
            "key": truth["key"],
            "text": truth["caption"],
            "width": truth["width"].astype(np.int32),
            "height": truth["height"].astype(np.int32),
        }
    )


def write_scores(df: pd.DataFrame, run_dir: Path, parts: int = 3, row_group_size: int = 97) -> Path:
    """Write `df` as RUN_DIR/scores/part-*.parquet with the schema of `hype.table.schema`."""
    folder = scores_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for i, chunk in enumerate(np.array_split(np.arange(len(df)), parts)):
        table = pa.Table.from_pandas(
            df.iloc[chunk].reset_index(drop=True), schema=SCHEMA, preserve_index=False
        )
        pq.write_table(table, folder / f"part-{i:05d}.parquet", row_group_size=row_group_size)
    return run_dir


def reference_top(df: pd.DataFrame, weights: dict[str, float], k: int) -> list[str]:
    """Independent reference: float64 weighted sum, sorted by (score desc, uid asc), first k uids."""
    score = np.zeros(len(df))
    for m in METRICS:
        if weights.get(m):
            score = score + weights[m] * df[m].to_numpy(dtype=np.float64)
    ranked = pd.DataFrame({"uid": df["uid"], "score": score}).sort_values(
        ["score", "uid"], ascending=[False, True], kind="mergesort"
    )
    return sorted(ranked["uid"].iloc[:k])


def save_memmap_subset(path: Path, uids: list[str]) -> Path:
    """A subset file in DataComp's other layout, written as its README describes: the uids encoded and sorted
    as in its README's example, then stored with `np.memmap` (raw 16-byte records, no .npy header), which
    its resharder's `load_subset` reads when the file lacks the .npy magic string."""
    records = np.array([(int(u[:16], 16), int(u[16:32], 16)) for u in uids], np.dtype("u8,u8"))
    records.sort()
    out = np.memmap(path, dtype=records.dtype, mode="w+", shape=records.shape)
    out[:] = records
    out.flush()
    del out
    return Path(path)


def test_helper_tables_follow_the_schema(tmp_path):
    df = pd.DataFrame(
        {
            "uid": [f"{i:032x}" for i in range(5)],
            **{m: np.arange(5, dtype=np.float32) for m in METRICS},
            "shard": ["a.tar"] * 5,
            "key": [str(i) for i in range(5)],
            "text": ["x"] * 5,
            "width": np.full(5, 10, np.int32),
            "height": np.full(5, 10, np.int32),
        }
    )
    write_scores(df, tmp_path, parts=2, row_group_size=2)
    files = sorted(scores_dir(tmp_path).glob("part-*.parquet"))
    assert len(files) == 2
    assert all(pq.read_schema(f).equals(SCHEMA, check_metadata=False) for f in files)
    assert pq.read_table(scores_dir(tmp_path)).num_rows == 5
