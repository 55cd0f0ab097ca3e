"""Near-duplicate search at scale on the CPU: the stage's core against bare faiss of the same shapes.

Features: N × d float32, random but clustered (N / cluster_size true centres, each point its centre plus
noise) with a share of near copies injected (a point plus a little noise), L2-normalised. Two arms, each
in a fresh process (so peak RSS is its own):

- `stage`: what `hype score`'s near-duplicate stage computes, without the run directory's I/O: hype's
  k-means (`kmeans_centroids`: faiss, niter, seed, ≤ 256 points per centroid), every row's cluster
  (`nearest_centroid`), then per cluster `cluster_forest` (faiss range search in blocks, the spanning
  forest), `components` and the keepers (`semdedup`);
- `faiss`: `faiss.Kmeans` with the same settings, `IndexFlatIP.search` for the assignment, and per cluster
  one `IndexFlatIP.range_search` of the cluster against itself, nothing kept beyond the counts.

Prints time and peak RSS of each (features included: they are the floor; also printed less the features),
their ratio (target ≤ 1.5×), the time of each phase, and a projection to DataComp small (12.8M) and
medium (128M) from the measured rates: the per-cluster search and the assignment scale as N·m·d and N·K·d
(m = N / K rows per cluster), the k-means as iterations · 256 · K² · d (K grows with N at a fixed m).

    python bench/neardup_scale.py [--rows 1000000] [--dim 768] [--cluster-size 1000] [--threshold 0.95]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]  # bench/ holds scripts

import numpy as np  # noqa: E402

CHUNK = 1 << 16


def features(n: int, d: int, cluster_size: int, dup_share: float, seed: int = 0) -> np.ndarray:
    """Clustered unit features, generated in chunks (peak: the array itself)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(max(1, n // cluster_size), d)).astype(np.float32)
    x = np.empty((n, d), np.float32)
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        c = rng.integers(0, len(centres), stop - start)
        x[start:stop] = centres[c] + 0.6 * rng.normal(size=(stop - start, d)).astype(np.float32)
    dups = rng.choice(n, int(n * dup_share), replace=False)
    sources = rng.integers(0, n, len(dups))
    x[dups] = x[sources] + 0.02 * rng.normal(size=(len(dups), d)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def rss_mb(field: str = "VmHWM") -> float:
    """Peak (VmHWM) or current (VmRSS) resident memory of this process in MB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> None:
    """Start the peak over from the current RSS (Linux: clear_refs 5), so loading the features' transient
    copies does not count as the arm's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def by_cluster(assign: np.ndarray):
    order = np.argsort(assign, kind="stable")
    bounds = np.flatnonzero(np.diff(assign[order])) + 1
    return order, zip([0, *bounds], [*bounds, len(order)], strict=True)


def arm_stage(x: np.ndarray, k: int, threshold: float, niter: int) -> dict:
    from hype.scoring.clusters import kmeans_centroids, nearest_centroid
    from hype.scoring.neardup import cluster_forest, components, keepers, normalize_rows

    t = {}
    t0 = time.perf_counter()
    centroids = kmeans_centroids(x, k, niter=niter, seed=0)
    t["kmeans"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    assign = nearest_centroid(x, centroids)
    unit_c = normalize_rows(centroids)
    t["assign"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    order, spans = by_cluster(assign)
    members = removed = edges = 0
    for start, stop in spans:
        rows = order[start:stop]
        if len(rows) < 2:
            continue
        xc = normalize_rows(x[rows])  # the stage reads and normalises each cluster's rows
        a, b, _ = cluster_forest(xc, threshold)
        edges += len(a)
        if not len(a):
            continue
        nodes = np.unique(np.concatenate([a, b]))
        local = np.searchsorted(nodes, np.arange(len(rows)))
        group = components(len(nodes), local[a], local[b])
        csim = xc[nodes] @ unit_c[assign[rows[0]]]
        hi = rows[nodes].astype(np.uint64)
        keep = keepers(group, "semdedup", hi=hi, lo=np.zeros_like(hi), centroid_sim=csim)
        members += len(nodes)
        removed += int((~keep).sum())
    t["search"] = time.perf_counter() - t0
    return {"seconds": t, "members": members, "removed": removed, "edges": edges}


def arm_faiss(x: np.ndarray, k: int, threshold: float, niter: int) -> dict:
    import faiss

    t = {}
    t0 = time.perf_counter()
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=0, verbose=False)
    km.train(x)
    t["kmeans"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = faiss.IndexFlatIP(x.shape[1])
    index.add(km.centroids)
    assign = np.concatenate([index.search(x[s : s + CHUNK], 1)[1][:, 0] for s in range(0, len(x), CHUNK)])
    t["assign"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    order, spans = by_cluster(assign)
    pairs = 0
    for start, stop in spans:
        xc = np.ascontiguousarray(x[order[start:stop]])
        ci = faiss.IndexFlatIP(x.shape[1])
        ci.add(xc)
        lims, _, _ = ci.range_search(xc, threshold)
        pairs += int(lims[-1]) - len(xc)  # less the self pairs
    t["search"] = time.perf_counter() - t0
    return {"seconds": t, "pairs": pairs // 2}


def child(args) -> None:
    import faiss

    faiss.omp_set_num_threads(args.threads or os.cpu_count())
    x = np.load(args.features)  # generated once by the parent: the floor of both arms' RSS
    reset_peak_rss()
    base = rss_mb("VmRSS")
    k = max(1, args.rows // args.cluster_size)
    fn = arm_stage if args.child == "stage" else arm_faiss
    out = fn(x, k, args.threshold, args.niter)
    out |= {"peak_rss_mb": rss_mb(), "features_rss_mb": base, "k": k}
    print("RESULT " + json.dumps(out), flush=True)


def run_child(arm: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", arm, "--features", args.features]
    for key in ("rows", "dim", "cluster_size", "threshold", "niter", "dup_share", "threads"):
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{arm} arm failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(lines[-1][len("RESULT ") :])


def project(stage: dict, n: int, d: int, m: int, target: int, gpu_tflops: float) -> tuple[float, float]:
    """(CPU seconds, GPU seconds) of the stage's own work at `target` rows with `m` rows per cluster: the
    per-cluster search, N·m·d multiply-adds, from the measured CPU rate; on a GPU at `gpu_tflops` sustained
    (an assumption, printed). The k-means and the assignment are the clusters stage's (c_IN), reused."""
    flops = 2.0 * n * (n / stage["k"]) * d
    cpu_rate = flops / stage["seconds"]["search"]
    target_flops = 2.0 * target * m * d
    return target_flops / cpu_rate, target_flops / (gpu_tflops * 1e12)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument(
        "--cluster-size", type=int, default=1000, help="rows per k-means cluster (K = rows / this)"
    )
    p.add_argument("--threshold", type=float, default=0.95)
    p.add_argument("--niter", type=int, default=20)
    p.add_argument("--dup-share", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=0, help="faiss OpenMP threads (0: every core)")
    p.add_argument("--gpu-tflops", type=float, default=20.0, help="sustained fp32 rate of the projection")
    p.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternated; the fastest counts")
    p.add_argument("--features", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=("stage", "faiss"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="neardup-scale-") as tmp:
        args.features = os.path.join(tmp, "features.npy")
        np.save(args.features, features(args.rows, args.dim, args.cluster_size, args.dup_share))
        runs: dict[str, list[dict]] = {"faiss": [], "stage": []}
        for _ in range(args.repeats):  # alternated, the fastest of each kept: the cores are shared
            for arm in runs:
                runs[arm].append(run_child(arm, args))
    results = {arm: min(r, key=lambda x: sum(x["seconds"].values())) for arm, r in runs.items()}
    st, fa = results["stage"], results["faiss"]
    t_st, t_fa = sum(st["seconds"].values()), sum(fa["seconds"].values())
    over_st = st["peak_rss_mb"] - st["features_rss_mb"]
    over_fa = fa["peak_rss_mb"] - fa["features_rss_mb"]
    print(
        f"{args.rows:,} x {args.dim} float32, K={st['k']:,} (~{args.cluster_size} rows per cluster), "
        f"cosine >= {args.threshold}, {args.niter} k-means iterations, {os.cpu_count()} CPU cores, "
        f"fastest of {args.repeats} alternated runs per arm"
    )
    for name, r in results.items():
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in r["seconds"].items())
        print(
            f"  {name:<6} {sum(r['seconds'].values()):8.1f} s ({phases}); "
            f"peak RSS {r['peak_rss_mb']:,.0f} MB "
            f"(features {r['features_rss_mb']:,.0f} MB)"
        )
    print(
        f"  stage: {st['members']:,} rows in groups, {st['removed']:,} to remove; "
        f"faiss: {fa['pairs']:,} pairs"
    )
    print(
        f"  ratio stage / faiss: time {t_st / t_fa:.2f}x, "
        f"peak RSS {st['peak_rss_mb'] / fa['peak_rss_mb']:.2f}x "
        f"(beyond the features: {over_st:,.0f} vs {over_fa:,.0f} MB)"
    )
    rate = 2.0 * args.rows * (args.rows / st["k"]) * args.dim / st["seconds"]["search"]
    print(f"  search phase alone: stage / faiss {st['seconds']['search'] / fa['seconds']['search']:.2f}x")
    print(f"  search rate (stage, CPU): {rate / 1e9:,.1f} GFLOP/s")
    # DataComp's c_IN k-means has 100,000 clusters at every scale: ~128 rows per cluster at 12.8M, ~1,280
    # at 128M.
    for target, m in ((12_800_000, 128), (128_000_000, 1280)):
        cpu, gpu = project(st, args.rows, args.dim, m, target, args.gpu_tflops)
        print(
            f"  projected at {target / 1e6:g}M rows, K=100,000 (~{m:,} rows per cluster): search "
            f"{cpu / 3600:,.2f} CPU-hours at this rate, {gpu:,.1f} s of arithmetic on one GPU at "
            f"{args.gpu_tflops:g} TFLOP/s sustained (an assumption); features "
            f"{target * args.dim * 4 / 2**30:,.0f} GiB, one group of clusters in memory at a time"
        )


if __name__ == "__main__":
    main()
