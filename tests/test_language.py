"""Offline language ID and DataComp's caption rule (real fastText model, no network)."""

from hype.text.language import datacomp_caption_ok, detect_languages, fasttext_token_count


def test_languages_are_detected_offline():
    langs = detect_languages(
        ["a large red star on a striped background", "un grand chat noir sur la table", ""]
    )
    assert langs == ["en", "fr", ""]


def test_datacomp_caption_rule():
    ok = datacomp_caption_ok(
        ["two red stars on a white background", "star", "a b", "un grand chat noir sur la table", ""]
    )
    assert ok.tolist() == [True, False, False, False, False]


def test_caption_words_are_counted_like_fasttext_tokenize():
    """DataComp counts words with fasttext.tokenize: ASCII separators only, and each newline is a token.
    Expected counts are fasttext 0.9.2's `len(fasttext.tokenize(text))`."""
    cases = {
        "a photo of": 3,
        "sunset\n": 2,  # "sunset", "</s>"
        "a\r\nb": 3,
        "\n\n": 2,
        "  a  b ": 2,
        "a\x0bb\x0cc\x00d\te": 5,
        "a\xa0photo": 1,  # no-break space: not a separator
        "a\u2003b": 1,
        "": 0,
    }
    assert {t: fasttext_token_count(t) for t in cases} == cases


def test_datacomp_caption_rule_uses_fasttext_tokens():
    texts = ["Beautiful\xa0sunset\xa0photograph", "Beautiful sunset photograph", "Landscape\n", "Landscape"]
    assert detect_languages(texts) == ["en"] * 4
    # str.split: 3, 3, 1, 1 words; fastText: 1, 3, 2 ("</s>" for the newline), 1 tokens.
    assert datacomp_caption_ok(texts).tolist() == [False, True, True, False]
