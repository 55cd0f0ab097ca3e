"""The GPU's correctness checks (marker `cuda`): geometry, mixed precision, specificity, models, losses and
training steps, `hype score`, `hype train` and `hype eval` on a CUDA device, each against the CPU or an
independent float64 reference.

Skipped with the reason where there is no GPU; `bench/gpu_suite.py` runs them on one (and, with `--smoke`,
on the CPU through `HYPE_CUDA_TESTS_DEVICE=cpu`, so they run in every CI). Tolerances are stated per check:
fp32 on a GPU differs from the CPU by summation order and by cuDNN's TF32 convolutions (on by default in
PyTorch, the patch embedding is one), bf16 autocast by its 8-bit mantissa in the towers.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.dataset as ds
import pytest
import torch
from click.testing import CliRunner
from reference import r_aper, r_dist, r_ext_law_of_cosines
from test_clusters import _lloyd_float64
from test_geometry import LORENTZ_FNS, _edge_inputs
from test_score_support import baseline, models, run_cli, score_args, world
from test_train_step import batch, grads_for, micro

from hype.geometry import lorentz
from hype.losses import ContrastiveEntailmentLoss
from hype.models import create_model
from hype.scoring import clusters
from hype.scoring.specificity import image_specificity, text_specificity
from hype.train.step import autocast_for

pytestmark = pytest.mark.cuda


def _np(x: torch.Tensor) -> np.ndarray:
    return x.detach().double().cpu().numpy()


@pytest.mark.parametrize("c", [0.1, 1.0])
def test_lorentz_on_the_device_matches_the_float64_reference(cuda_device, c):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 16)) * 0.5, rng.normal(size=(256, 16)) * 0.5
    tx, ty = torch.tensor(x, dtype=torch.float32, device=cuda_device), torch.tensor(y, dtype=torch.float32)
    ty = ty.to(cuda_device)
    np.testing.assert_allclose(_np(lorentz.distance(tx, ty, c)), r_dist(x, y, c), rtol=1e-4, atol=3e-3)
    np.testing.assert_allclose(
        _np(lorentz.exterior_angle(tx, ty, c)), r_ext_law_of_cosines(x, y, c), rtol=1e-4, atol=3e-3
    )
    np.testing.assert_allclose(_np(lorentz.half_aperture(tx, c)), r_aper(x, c, 0.1), rtol=1e-5, atol=1e-6)
    pairwise = _np(lorentz.pairwise_distance(tx[:32], ty[:48], c))
    ref = np.array([[r_dist(x[i : i + 1], y[j : j + 1], c)[0] for j in range(48)] for i in range(32)])
    np.testing.assert_allclose(pairwise, ref, rtol=1e-4, atol=3e-3)


@pytest.mark.parametrize("fn_name", sorted(LORENTZ_FNS))
def test_edge_cases_stay_finite_under_bf16_autocast_on_the_device(cuda_device, fn_name):
    """The battery of tests/test_geometry.py on the device: zero vectors, identical points, norms at the
    exp-map clamp, in bf16 autocast; every hyperbolic quantity is computed in fp32."""
    fn = LORENTZ_FNS[fn_name]
    for case, (a, b) in _edge_inputs().items():
        if "huge" in case and fn_name.startswith(("euc", "cosine", "geodesic", "oblique")):
            a, b = a * 1e-3, b * 1e-3
        a = a.detach().clone().to(cuda_device).requires_grad_(True)
        b = b.detach().clone().to(cuda_device).requires_grad_(True)
        with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
            out = fn(a.bfloat16(), b.bfloat16())
        assert out.dtype == torch.float32, (fn_name, case)
        assert torch.isfinite(out).all(), (fn_name, case)
        out.sum().backward()
        assert torch.isfinite(a.grad).all() and torch.isfinite(b.grad).all(), (fn_name, case)


@pytest.mark.parametrize("hinge", [False, True])
def test_specificity_kernel_on_the_device_matches_float64(cuda_device, hinge):
    """The streaming ε kernel (tiled on CPU, whole chunks on a GPU) against the same formulas in float64,
    with a budget small enough to force several chunks."""
    g = torch.Generator().manual_seed(0)
    pool, refs = torch.randn(300, 32, generator=g) * 0.3, torch.randn(500, 32, generator=g) * 0.3
    for fn in (text_specificity, image_specificity):
        want = fn(pool.double(), refs.double(), 0.5, hinge=hinge)
        got = fn(pool.to(cuda_device), refs.to(cuda_device), 0.5, hinge=hinge, budget_elems=20_000)
        assert got.device.type == cuda_device.type and got.dtype == torch.float32
        np.testing.assert_allclose(_np(got), _np(want), rtol=0, atol=2e-5, err_msg=fn.__name__)


@pytest.mark.parametrize("name", ["tiny-hyperbolic", "tiny-clip"])
def test_towers_on_the_device_match_the_cpu_and_bf16_stays_close(cuda_device, name):
    torch.manual_seed(0)
    model = create_model(micro(name)).eval()
    images, tokens = batch(model)
    with torch.no_grad():
        want_i, want_t = model.encode_image(images), model.encode_text(tokens)
        model.to(cuda_device)
        images, tokens = images.to(cuda_device), tokens.to(cuda_device)
        got_i, got_t = model.encode_image(images), model.encode_text(tokens)
        with torch.autocast(cuda_device.type, dtype=torch.bfloat16):
            bf_i, bf_t = model.encode_image(images), model.encode_text(tokens)
    for got, want in ((got_i, want_i), (got_t, want_t)):
        torch.testing.assert_close(got.cpu(), want, rtol=2e-3, atol=2e-3)  # TF32 convolutions on a GPU
    for got, want in ((bf_i, want_i), (bf_t, want_t)):
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        torch.testing.assert_close(got.cpu(), want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", ["tiny-hyperbolic", "tiny-clip"])
def test_bf16_training_gradients_on_the_device_are_finite_and_match_fp32(cuda_device, name):
    torch.manual_seed(0)
    model = create_model(micro(name))
    cfg = model.config.loss
    loss_fn = ContrastiveEntailmentLoss(model.geometry, cfg.entailment_weight or 0.0, cfg.entailment_K)
    images, tokens = batch(model)
    full = grads_for(model, loss_fn, images, tokens, 1)
    model.to(cuda_device)
    mixed = grads_for(
        model,
        loss_fn,
        images.to(cuda_device),
        tokens.to(cuda_device),
        2,
        autocast=autocast_for("bf16", cuda_device),
    )
    assert mixed.keys() == full.keys()
    for key in mixed:
        assert torch.isfinite(mixed[key]).all(), key
    for key in ("log_logit_scale", "visual.proj", "text.text_projection"):
        torch.testing.assert_close(mixed[key].cpu(), full[key], rtol=0.1, atol=2e-3, msg=key)


def _scores(run) -> dict[str, np.ndarray]:
    df = ds.dataset(run / "scores", format="parquet").to_table().to_pandas().set_index("uid").sort_index()
    return {c: df[c].to_numpy() for c in ("eps_i", "eps_t", "neg_d_l", "cos_theta", "c_in")} | {
        "uid": df.index.to_numpy()
    }


def test_neardup_search_on_the_device_gives_the_cpu_bytes(cuda_device):
    """The near-duplicate stage's searches on the device (torch block products, since faiss' GPU indexes
    have no range search) find the pairs, copy-check candidates and cosines of faiss on the CPU, byte for
    byte, in any query block: every pair found is measured again by `pair_cosines` (#37's 2-cluster search
    runs them once per cluster a row lies in; the pixel candidates rank the device's pairs by the same exact
    integer products)."""
    from test_neardup import pool_with_copies

    from hype.scoring.neardup import nearest_pairs, normalize_rows, pixel_descriptors, similar_pairs

    x, cluster = pool_with_copies(seed=2)
    xc = normalize_rows(x[cluster == 0])
    work = np.random.default_rng(2).integers(0, 256, (len(xc), 64, 64, 3), dtype=np.uint8)
    pixels = pixel_descriptors(work)
    dev = str(cuda_device) if cuda_device.type == "cuda" else "cpu:0"  # the CPU smoke: torch on the CPU
    for rows in (1, 7, len(xc)):
        block = {"pairs_per_block": rows * len(xc)}
        got = {}
        for device in ("cpu", dev):
            pairs = list(similar_pairs(xc, 0.9, **block, device=device))
            got[device] = [np.concatenate(c).tobytes() for c in zip(*pairs, strict=True)]
            got[device] += [c.tobytes() for c in nearest_pairs(xc, 0.5, 3, **block, device=device)]
            pix = nearest_pairs(xc, 0.5, 3, pixels=pixels, pixel_k=2, **block, device=device)
            got[device] += [c.tobytes() for c in pix]
        assert got[dev] == got["cpu"] and len(got["cpu"][0]) >= 8 * 20, rows
        assert len(pix[0]) > len(nearest_pairs(xc, 0.5, 3)[0])  # the pixel candidates add pairs


@pytest.mark.parametrize("precision,tol", [("fp32", 2e-3), ("bf16", 0.05)])
def test_hype_score_on_the_device_matches_the_cpu_run(cuda_device, tmp_path_factory, precision, tol):
    """`hype score --device cuda` on the small world against the CPU baseline run of the score tests:
    every column within `tol` (absolute), the same uids, c_IN identical."""
    want = _scores(baseline(tmp_path_factory))
    meru, clip = models(tmp_path_factory)
    out = tmp_path_factory.mktemp(f"score-{cuda_device.type}-{precision}") / "run"
    args = score_args(world(tmp_path_factory), meru, clip, out, f"precision={precision}")
    result = run_cli([*args, "--device", str(cuda_device)])
    assert result.exit_code == 0, result.output
    got = _scores(out)
    assert (got["uid"] == want["uid"]).all()
    for col in ("eps_i", "eps_t", "neg_d_l", "cos_theta"):
        assert np.isfinite(got[col]).all(), col
        assert np.abs(got[col] - want[col]).max() <= tol, (col, np.abs(got[col] - want[col]).max())
    assert (got["c_in"] == want["c_in"]).mean() >= 0.95  # a feature within tol of a boundary may flip


def test_hype_train_and_eval_on_the_device(cuda_device, tmp_path_factory):
    """A few bf16 steps of `hype train` on the device, then `hype eval` of that checkpoint on the device
    and on the CPU: finite losses, a loadable checkpoint, the same accuracies up to bf16/TF32 ties."""
    from train_helpers import MICRO as MICRO_OVERRIDES

    from hype.cli import main

    w = world(tmp_path_factory)
    out = tmp_path_factory.mktemp("train-cuda") / "run"
    args = ["train", "--config", "tiny-hyperbolic", "--data", str(w / "clean" / "shards"), "--out", str(out)]
    args += ["--no-progress", "batch_size=16", "samples_seen=64", "precision=bf16", f"device={cuda_device}"]
    args += ["data.workers=0", "log_every_steps=1", *MICRO_OVERRIDES]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(np.isfinite(r["loss"]) for r in rows)
    ckpt = sorted(out.glob("**/*.safetensors"))[-1]
    accs = {}
    for dev in (str(cuda_device), "cpu"):
        res = tmp_path_factory.mktemp("eval-cuda") / "r.jsonl"
        eval_args = ["eval", "--model", str(ckpt), "--data-dir", str(w), "--out", str(res), "--workers", "0"]
        eval_args += ["--tasks", "synth/shape,synth/color", "--no-progress", "--device", dev, "--json"]
        result = CliRunner().invoke(main, eval_args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
        accs[dev] = [json.loads(line)["metrics"]["acc1"] for line in res.read_text().splitlines()]
    assert np.allclose(accs[str(cuda_device)], accs["cpu"], atol=0.05), accs


def test_torch_kmeans_and_assignment_on_the_device_match_float64(cuda_device, monkeypatch):
    """`clusters.backend=torch` on the device: k-means against the float64 reference (tests/test_clusters.py)
    and the same bytes twice (float64 sums in a fixed order); the inner-product assignment, in several
    blocks, against float64's argmax wherever the best two products differ by more than fp32 rounding."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3000, 32)).astype(np.float32)
    got = clusters.torch_kmeans(x, 40, niter=5, seed=0, device=str(cuda_device))
    np.testing.assert_allclose(got, _lloyd_float64(x, 40, 5, 0), atol=1e-4)
    assert clusters.torch_kmeans(x, 40, niter=5, seed=0, device=str(cuda_device)).tobytes() == got.tobytes()

    feats, cents = (
        rng.normal(size=(20_000, 64)).astype(np.float32),
        rng.normal(size=(3000, 64)).astype(np.float32),
    )
    monkeypatch.setattr(clusters, "TORCH_BLOCK_BYTES", 4 * 3000 * 4096)  # 5 blocks of 4,096 points
    near = clusters.nearest_centroid(feats, cents, backend="torch", device=str(cuda_device))
    products = feats.astype(np.float64) @ cents.T.astype(np.float64)
    top2 = np.sort(products, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-4
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(near[clear], products.argmax(1)[clear])
