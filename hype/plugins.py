"""Plug-in registries: how the library finds code that lives above it without importing it.

`hype.filters` (selection rules) and `hype.pipelines` (executors; the repository's top-level `filters/` and
`pipelines/` folders, installed under hype's name by pyproject's package-dir) are plug-ins. The library
(`hype.select`, `hype.scoring`, ...) defines the interface and a `Registry`; a plug-in module registers its
classes with `registry.register(cls)` when it is imported. Plug-ins are found the way pytest and fsspec
find theirs: through the package metadata's entry points (group `hype.<registry name>`, declared in
`pyproject.toml` for the bundled packages and by any third-party package the same way), loaded the first
time a name is looked up. `hype.cli` also imports the bundled plug-ins directly, since it composes the
layers. The library itself never imports a plug-in package by name.
"""

from __future__ import annotations

import importlib.metadata
import logging
from collections.abc import Iterator
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Registry(Generic[T]):
    """Named plug-in classes of one kind (`name` -> class), filled by the plug-ins themselves."""

    def __init__(self, kind: str):
        self.kind = kind  # also the entry-point group suffix: hype.<kind>
        self._items: dict[str, T] = {}
        self._loaded = False

    @property
    def group(self) -> str:
        return f"hype.{self.kind}"

    def register(self, item: T, name: str | None = None) -> T:
        """Add `item` under `name` (default: its `name` attribute); usable as a class decorator."""
        key = name or getattr(item, "name", None)
        if not key:
            raise ValueError(f"{item!r} has no name to register it under in hype.{self.kind}")
        old = self._items.get(key)
        if old is not None and old is not item:
            raise ValueError(f"two {self.kind} named {key!r}: {old!r} and {item!r}")
        self._items[key] = item
        return item

    def load_entry_points(self) -> None:
        """Import every module declared in the `hype.<kind>` entry-point group (once)."""
        if self._loaded:
            return
        self._loaded = True
        for ep in importlib.metadata.entry_points(group=self.group):
            try:
                ep.load()  # the module registers what it defines when imported
            except Exception as e:  # a broken third-party plug-in must not hide the others
                log.warning("could not load %s plug-in %s (%s): %s", self.kind, ep.name, ep.value, e)

    def get(self, name: str) -> T | None:
        if name not in self._items:
            self.load_entry_points()
        return self._items.get(name)

    def names(self) -> list[str]:
        self.load_entry_points()
        return list(self._items)

    def items(self) -> Iterator[tuple[str, T]]:
        self.load_entry_points()
        return iter(list(self._items.items()))

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None
