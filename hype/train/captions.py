"""Caption augmentation hooks applied before tokenization.

MERU trained on RedCaps with captions rewritten as `"{subreddit} : {caption}"`. A template names fields
of the sample's `.json` (plus `{caption}`); `caption_fn` imports any `(caption, meta) -> str` function.
A sample whose template field is missing is skipped and counted (`caption_transform_failed`).
"""

from __future__ import annotations

import importlib
import string
from collections.abc import Callable

from hype.config import ConfigError


class TemplateCaption:
    """`template.format(caption=caption, **meta)` restricted to the fields the template names."""

    def __init__(self, template: str):
        try:
            fields = {f for _, f, _, _ in string.Formatter().parse(template) if f is not None}
        except ValueError as e:
            raise ConfigError("data.caption_template", f"not a valid format string ({e})") from None
        if any(not f or not f.isidentifier() for f in fields):
            raise ConfigError(
                "data.caption_template", f"fields must be plain names like {{caption}}, got {template!r}"
            )
        self.template = template
        self.fields = sorted(fields - {"caption"})

    def __call__(self, caption: str, meta: dict) -> str:
        values = {}
        for f in self.fields:
            if f not in meta:
                raise KeyError(f"the sample's .json has no {f!r} field required by the caption template")
            values[f] = meta[f]
        return self.template.format(caption=caption, **values)


def import_caption_fn(spec: str) -> Callable[[str, dict], str]:
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError("data.caption_fn", f"cannot import {spec!r} ({e})") from None
    if not callable(fn):
        raise ConfigError("data.caption_fn", f"{spec!r} is not callable")
    return fn


def make_caption_transform(
    template: str | None, fn: str | None
) -> tuple[Callable[[str, dict], str] | None, bool]:
    """(transform or None, whether it needs the sample's parsed .json)."""
    if template is not None:
        t = TemplateCaption(template)
        return t, bool(t.fields)
    if fn is not None:
        return import_caption_fn(fn), True
    return None, False
