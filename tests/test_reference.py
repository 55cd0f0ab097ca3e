"""Reference-set selection (HYPE §3.3) and reference files."""

from __future__ import annotations

import logging
import pickle

import numpy as np
import pytest
import torch
from reference import r_aper, r_ext_law_of_cosines

from hype.geometry import lorentz
from hype.scoring.reference import ReferenceError, ReferenceSet, load_reference, select_references


def _pool(n=120, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    img = lorentz.exp_map0(torch.randn(n, dim, generator=g, dtype=torch.float64) * 0.7, 0.5)
    txt = lorentz.exp_map0(torch.randn(n, dim, generator=g, dtype=torch.float64) * 0.4, 0.5)
    cos = torch.rand(n, generator=g, dtype=torch.float64)
    return img, txt, cos


def test_selection_follows_the_paper_step_by_step():
    img, txt, cos = _pool()
    refs = select_references(img, txt, cos, 0.5, n_top=30, m=10, hinge=True)
    # Brute force in float64 numpy: top-30 pairs by cos θ, then mean hinged L_e against the opposite
    # modality of those pairs, then the 10 best of each modality.
    top = np.argsort(-cos.numpy(), kind="stable")[:30]
    x, y = txt.numpy(), img.numpy()
    e_img = np.maximum(
        r_ext_law_of_cosines(x[top][:, None], y[None], 0.5) - r_aper(x[top], 0.5, 0.1)[:, None], 0
    )
    e_txt = np.maximum(r_ext_law_of_cosines(x[:, None], y[top][None], 0.5) - r_aper(x, 0.5, 0.1)[:, None], 0)
    s_i = np.argsort(-e_img.mean(0), kind="stable")[:10]
    s_t = np.argsort(-e_txt.mean(1), kind="stable")[:10]
    np.testing.assert_allclose(refs.img.double().numpy(), lorentz.log_map0(img[s_i], 0.5).numpy(), atol=1e-5)
    np.testing.assert_allclose(refs.txt.double().numpy(), lorentz.log_map0(txt[s_t], 0.5).numpy(), atol=1e-5)
    assert refs.meta["n_top"] == 30 and refs.meta["m"] == 10
    lifted_i, _ = refs.lifted(0.5)
    torch.testing.assert_close(lifted_i.double(), img[s_i], atol=1e-5, rtol=1e-5)


def test_small_pools_reduce_n_and_m_with_a_warning(caplog):
    img, txt, cos = _pool(n=15)
    with caplog.at_level(logging.WARNING):
        refs = select_references(img, txt, cos, 0.5, n_top=100, m=50)
    assert "reduced" in caplog.text
    assert refs.img.shape == (15, 8) and refs.meta["n_top"] == 15
    with pytest.raises(ReferenceError, match="same pool"):
        select_references(img, txt[:3], cos, 0.5)
    with pytest.raises(ReferenceError, match="empty pool"):
        select_references(img[:0], txt[:0], cos[:0], 0.5)


def test_reference_files_round_trip_in_both_formats(tmp_path):
    refs = ReferenceSet(torch.randn(5, 8), torch.randn(7, 8), {"m": 5})
    loaded = load_reference(refs.save(tmp_path / "refs.safetensors"), dim=8)
    assert torch.equal(loaded.img, refs.img) and torch.equal(loaded.txt, refs.txt)
    # HYPE's released format: a torch-saved dict of tangent vectors.
    torch.save({"img": refs.img, "txt": refs.txt}, tmp_path / "reference.pt")
    released = load_reference(tmp_path / "reference.pt")
    assert torch.equal(released.txt, refs.txt)


def test_bad_reference_files_give_clear_errors(tmp_path):
    with pytest.raises(ReferenceError, match="not found"):
        load_reference(tmp_path / "none.pt")
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (tmp_path / "evil.pt").write_bytes(pickle.dumps({"img": Evil()}, protocol=2))
    with pytest.raises(ReferenceError, match="weights_only"):
        load_reference(tmp_path / "evil.pt")
    assert not marker.exists()
    torch.save({"image": torch.zeros(2, 2)}, tmp_path / "keys.pt")
    with pytest.raises(ReferenceError, match="'img' and 'txt'"):
        load_reference(tmp_path / "keys.pt")
    torch.save({"img": torch.zeros(2, 4), "txt": torch.zeros(2, 4)}, tmp_path / "dim.pt")
    with pytest.raises(ReferenceError, match="does not match"):
        load_reference(tmp_path / "dim.pt", dim=8)
    torch.save({"img": torch.full((2, 4), float("nan")), "txt": torch.zeros(2, 4)}, tmp_path / "nan.pt")
    with pytest.raises(ReferenceError, match="NaN"):
        load_reference(tmp_path / "nan.pt")
