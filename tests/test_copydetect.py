"""The pixel copy check of decontamination (`hype.scoring.copydetect`): copies of an image (exact, JPEG
re-encoded, resized, cropped by 10%, in either direction) score high, other images low, flat images never
match. Images are drawn here (a few random shapes), so the test takes milliseconds."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw

from hype.data.imageprep import ImageError
from hype.scoring.copydetect import CopyCheck, copy_similarity, pair_similarities, thumbnails, work_image
from hype.synth.contaminate import KINDS, _copy


def _scene(seed: int, side: int = 96) -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (side, side), tuple(int(v) for v in rng.integers(0, 256, 3)))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x, y = rng.integers(0, side - 20, 2)
        w, h = rng.integers(10, 40, 2)
        draw.ellipse(
            (int(x), int(y), int(x + w), int(y + h)), fill=tuple(int(v) for v in rng.integers(0, 256, 3))
        )
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _thumbs(data: bytes, check: CopyCheck) -> np.ndarray:
    return thumbnails(work_image(data), check)


def test_copies_score_above_the_threshold_and_other_scenes_below():
    check, rng = CopyCheck(), np.random.default_rng(0)
    for seed in range(4):
        source = _scene(seed)
        ref = _thumbs(source, check)
        for kind in KINDS:
            copy = _thumbs(_copy(source, "png", kind, rng)[0], check)
            assert copy_similarity(copy, ref) >= check.threshold, (seed, kind)
            assert copy_similarity(ref, copy) == copy_similarity(copy, ref)  # either direction
        others = [copy_similarity(_thumbs(_scene(100 + s), check), ref) for s in range(8)]
        assert max(others) < check.threshold, (seed, others)


def test_a_flat_image_matches_nothing_and_a_broken_file_is_an_image_error():
    check = CopyCheck()
    flat = io.BytesIO()
    Image.new("RGB", (40, 40), (200, 10, 10)).save(flat, format="PNG")
    t = _thumbs(flat.getvalue(), check)
    assert not any(part.any() for part in t) and copy_similarity(t, _thumbs(_scene(0), check)) == 0.0
    with pytest.raises(ImageError):
        work_image(b"not an image")
    with pytest.raises(ValueError, match="thumbnail size"):
        CopyCheck(edge_size=2)


def test_pair_similarities_are_the_copy_similarities_of_each_pair():
    check, rng = CopyCheck(), np.random.default_rng(1)
    sources = [_scene(seed) for seed in range(3)]
    a = np.stack([work_image(_copy(s, "png", kind, rng)[0]) for s in sources for kind in KINDS])
    b = np.stack([work_image(s) for s in sources])
    pairs = np.array([(i, j) for i in range(len(a)) for j in range(len(b))])
    got = pair_similarities(a, b, pairs, check)
    want = [copy_similarity(thumbnails(a[i], check), thumbnails(b[j], check)) for i, j in pairs]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert pair_similarities(a, b, np.zeros((0, 2), np.int64), check).shape == (0,)
    # Spread over threads (one BLAS thread each), the result does not depend on how many.
    order = rng.permutation(len(pairs))
    one = pair_similarities(a, b, pairs[order], check, workers=1)
    assert one.tobytes() == pair_similarities(a, b, pairs[order], check, workers=3).tobytes()
    np.testing.assert_allclose(one, got[order], rtol=0, atol=1e-5)
