"""The noise kinds of the pool and how many samples of each a pool gets."""

from __future__ import annotations

from collections.abc import Mapping

NOISE_KINDS: tuple[str, ...] = (
    "clean",
    "misaligned",
    "underspecified_text",
    "underspecified_image",
    "near_duplicate",
)

DEFAULT_NOISE: dict[str, float] = {
    "clean": 0.5,
    "misaligned": 0.15,
    "underspecified_text": 0.12,
    "underspecified_image": 0.13,
    "near_duplicate": 0.10,
}


class NoiseSpecError(ValueError):
    """A noise specification that cannot be used."""


def parse_noise(spec: str | Mapping[str, float] | None) -> dict[str, float]:
    """Normalised fractions from `{"clean": 0.6, ...}` or `"clean=0.6,misaligned=0.2"`.

    Kinds not named keep their default weight, so `"misaligned=0.3"` just raises misalignment.
    """
    if spec is None or spec == "":
        weights = dict(DEFAULT_NOISE)
    else:
        given: dict[str, float] = {}
        if isinstance(spec, str):
            for part in spec.split(","):
                name, sep, value = part.partition("=")
                name = name.strip()
                if not sep:
                    raise NoiseSpecError(f"noise entry {part!r} is not NAME=FRACTION, e.g. 'misaligned=0.2'")
                try:
                    given[name] = float(value)
                except ValueError:
                    raise NoiseSpecError(f"noise fraction {value!r} for {name!r} is not a number") from None
        else:
            given = {k: float(v) for k, v in spec.items()}
        unknown = sorted(set(given) - set(NOISE_KINDS))
        if unknown:
            raise NoiseSpecError(f"unknown noise kind(s) {unknown}; known kinds: {', '.join(NOISE_KINDS)}")
        weights = {k: given.get(k, DEFAULT_NOISE[k]) for k in NOISE_KINDS}
    if any(v < 0 for v in weights.values()) or sum(weights.values()) <= 0:
        raise NoiseSpecError(f"noise fractions must be >= 0 and not all zero, got {weights}")
    total = sum(weights.values())
    fractions = {k: weights[k] / total for k in NOISE_KINDS}
    needs_source = fractions["misaligned"] > 0 or fractions["near_duplicate"] > 0
    if needs_source and fractions["clean"] == 0:
        raise NoiseSpecError(
            "misaligned and near_duplicate samples copy clean ones: give 'clean' a fraction > 0"
        )
    return fractions


def allocate(n: int, fractions: Mapping[str, float]) -> dict[str, int]:
    """Integer counts summing to `n` (largest remainder), every kind with a positive fraction getting at
    least one sample when `n` allows, so small test pools still contain every kind."""
    kinds = [k for k in NOISE_KINDS if fractions.get(k, 0) > 0]
    counts = {k: int(n * fractions[k]) for k in kinds}
    rest = n - sum(counts.values())
    by_remainder = sorted(kinds, key=lambda k: (-(n * fractions[k] - counts[k]), NOISE_KINDS.index(k)))
    for k in by_remainder[:rest]:
        counts[k] += 1
    # Lift empty kinds to one sample, taken from the largest kind.
    for k in kinds:
        if counts[k] == 0:
            donor = max(kinds, key=lambda d: (counts[d], -NOISE_KINDS.index(d)))
            if counts[donor] > 1:
                counts[donor] -= 1
                counts[k] += 1
    return {k: counts.get(k, 0) for k in NOISE_KINDS}
