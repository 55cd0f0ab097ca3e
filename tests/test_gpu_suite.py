"""bench/gpu_suite.py, the one prepared GPU run: its `--smoke` mode runs every section's code on the CPU at
tiny sizes (so the suite cannot rot between the rare GPU runs), and its preflight fails in seconds, naming
what is missing, instead of minutes into a run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from background import background_run, waited

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "bench" / "gpu_suite.py"


@background_run("gpu_smoke", timeout=3000)  # bounded, far above the idle ~2 min: CI machines can be loaded
def _smoke_command(folder: Path) -> list[str]:
    return [sys.executable, str(SUITE), "--smoke", "--out", str(folder / "out")]


@pytest.fixture(scope="module")
def gpu_smoke(request) -> tuple[subprocess.CompletedProcess, Path]:
    """The smoke run, started in the background when the session began (tests/background.py)."""
    folder, done = waited(request, "gpu_smoke")
    return done, folder / "out"


def _finite(*values) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) for v in values)


@pytest.mark.slow
def test_smoke_runs_every_section_and_writes_every_figure(gpu_smoke):
    p, out = gpu_smoke
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "gpu_suite.json").read_text())
    assert report["mode"].startswith("smoke")
    sections = report["sections"]
    assert list(sections) == ["cuda_tests", "agreement", "embed", "specificity", "kmeans", "train", "eval"]
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(sections, "ok")
    r = {name: s["result"] for name, s in sections.items()}

    # The cuda tests ran (on the CPU here), none skipped: they are the ones a GPU run executes.
    assert r["cuda_tests"]["passed"] == r["cuda_tests"]["tests"] >= 20 and r["cuda_tests"]["skipped"] == 0
    assert (out / "cuda_tests.xml").exists()

    # fp32 vs bf16 towers on the same pool: every column within the stated tolerance, and every sample that
    # the cut treats differently lies within the tie margin of the cut-off.
    bf16 = r["agreement"]["cpu-bf16"]
    assert bf16["rows_compared"] == r["agreement"]["pool"]
    assert 0 < bf16["max_abs_diff"]["neg_d_l"] <= r["agreement"]["tolerance"]["bf16"]
    assert bf16["unexplained_by_ties"] == 0 and bf16["subset_size"] > 0

    pair, meru = r["embed"]["pair"], r["embed"]["metadata_meru_only"]
    assert pair["models"] == "MERU + CLIP" and meru["models"] == "MERU only (--metadata)"
    assert pair["image_side"] == 160 and pair["samples"] == meru["samples"] > 0
    assert _finite(pair["ceiling_samples_per_s"], pair["pipeline_samples_per_s"], pair["ratio"])
    assert pair["gflops_per_sample"] > 0 and pair["pipeline_mfu"] is None  # no peak known for a CPU

    spec = r["specificity"]
    assert _finite(spec["streaming_s"], spec["bare_matmul_s"], spec["ratio"])
    assert spec["max_abs_err_fp32"] < 1e-4 and spec["projected_eps_t_plus_eps_i_s"]["medium"] > 0

    km = r["kmeans"]
    assert km["points_per_s"]["fp32"] > 0 and km["faiss_cpu_points_per_s"] > 0
    assert 0 <= km["bf16_assignment_changes"] < 0.5 and km["model_training_s_hype"]["small"] > 0
    hype_km = km["hype_torch_backend"]  # hype's own clusters.backend=torch, not only bare matmuls
    assert hype_km["kmeans_iteration_points_per_s"] > 0 and hype_km["assign_points_per_s"] > 0
    assert _finite(hype_km["vs_fp32_matmul"], km["model_training_s_faiss_cpu"]["medium"])

    b32 = r["train"]["b32_vs_open_clip"]
    assert _finite(b32["hype_samples_per_s"], b32["open_clip_samples_per_s"], b32["ratio"])
    assert r["train"]["meru_step"]["median_step_s"] > 0
    assert _finite(r["eval"]["ratio"]) and r["eval"]["ratio"] > 0


def _suite():
    """bench/gpu_suite.py as a module (bench/ is not a package)."""
    sys.path.insert(0, str(SUITE.parent))
    try:
        import gpu_suite
    finally:
        sys.path.remove(str(SUITE.parent))
    return gpu_suite


def _main_in_process(monkeypatch, *argv: str) -> str:
    """`python bench/gpu_suite.py ARGV` run here, for the runs that must stop in its preflight: what it
    exits with (a child process would pay ~7 s of imports to say the same). The smoke runs the script."""
    gpu_suite = _suite()
    monkeypatch.setattr(sys, "argv", ["gpu_suite.py", *argv])
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() drops bench/ from it
    with pytest.raises(SystemExit) as e:
        gpu_suite.main()
    assert e.value.code not in (None, 0)
    return str(e.value.code)


def test_the_wheels_carry_every_import_the_gpu_image_lacks():
    gpu_suite = _suite()
    script = (SUITE.parent / "gpu_wheels.sh").read_text()
    for _, dist, _ in gpu_suite.REQUIRED:
        name = dist.split(" ")[0].split(">")[0]
        assert name in gpu_suite.ON_GPU_IMAGE or f'"{name}"' in script, f"{name}: add it to gpu_wheels.sh"


def test_preflight_fails_in_seconds_naming_what_is_missing(tmp_path, monkeypatch):
    # A bare GPU image without webdataset: the suite stops before any section, naming it and the fix.
    monkeypatch.setitem(sys.modules, "webdataset", None)  # `import webdataset` raises ImportError
    message = _main_in_process(monkeypatch, "--smoke", "--out", str(tmp_path))
    assert "preflight failed" in message and "cannot import webdataset" in message, message
    assert (
        not (tmp_path / "gpu_suite.json").exists() and not (tmp_path / "gpu_suite.log").exists()
    )  # no section ran


def test_without_a_gpu_the_full_run_says_so(tmp_path, monkeypatch):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the full run would start")
    message = _main_in_process(monkeypatch, "--out", str(tmp_path), "--only", "kmeans")
    assert "CUDA is not available" in message and "--smoke" in message, message
    assert not (tmp_path / "gpu_suite.json").exists()  # no section ran
