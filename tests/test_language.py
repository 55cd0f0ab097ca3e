"""Offline language ID and DataComp's caption rule (real fastText model, no network)."""

from hype.text.language import datacomp_caption_ok, detect_languages


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
