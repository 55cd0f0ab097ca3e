"""Pools that grow: a complete run scores new shards against its frozen reference, centroids and models.

Once a run is complete, `RUN_DIR/card.json` (`hype.scoring.card`) records the digests of its models, its
reference sets S_i/S_t (`reference.safetensors`), its centroids and c_IN targets. `hype score --pool P
--out RUN` on such a run whose pool P lists shards that are not in `plan.json` grows it:

- the run's shards become its old shards (old order, old indices) followed by P's new ones; P lists
  either all of the old shards or none of them (only new shards: `--pool NEW_SHARDS`); a pool that drops
  some is refused, since a grown run never forgets a shard (score a subset into a new --out);
- the reference sets, centroids and targets are kept as they are (not selected or trained again), so
  every old shard's outputs keep their fingerprints and are reused: only the new shards are embedded,
  scored, assigned and merged (dedup runs over all shards, the first occurrence winning, so old parts
  keep their rows);
- the models given must have the card's digests, and a `--reference`/`--centroids`/class set given must
  equal the frozen one: otherwise the run is refused, naming what differs and the fix.

The result equals, bit for bit, a from-scratch run over all shards given the same reference and centroids
(`--reference RUN/reference.safetensors --centroids RUN/clusters/centroids.npy`, the same class images).
`plan.json` then says `"frozen": true`: every later run of that folder keeps the frozen parts too (a rerun
after a failed grow resumes it instead of selecting a new reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hype.io import blake2b128_file, load_npy, read_json
from hype.scoring.rundir import RunDir, ShardTask, plan_tasks

CARD = "card.json"


class GrowError(ValueError):
    """A grow that would not equal a from-scratch run with the frozen parts; says what differs and the fix."""


@dataclass(frozen=True)
class Frozen:
    """What a grown run keeps: the card's digests and the markers of its reference and clusters model."""

    card: dict
    reference: dict  # reference.json: its digest keys the specificity outputs
    clusters: dict | None  # clusters/model.json (None: the run was scored without c_IN)
    added: int  # shards this invocation adds


def grow_plan(run: RunDir, tasks: list[ShardTask]) -> tuple[list[ShardTask], Frozen | None]:
    """The run's shards and its frozen parts when this invocation grows (or resumes growing) the run;
    `(tasks, None)` for an ordinary run."""
    card, plan = read_json(run.root / CARD), read_json(run.plan)
    if not isinstance(plan, dict):
        return tasks, None
    if not isinstance(card, dict):
        if plan.get("frozen"):  # grown once: without the card, nothing says what is frozen
            raise GrowError(
                f"{run.root / CARD}: missing or unreadable, but {run.plan} says the run has grown against "
                "its frozen reference; restore the card, or score the pool into a new --out"
            )
        return tasks, None
    old = plan_tasks(plan)
    old_ids = {t.shard_id for t in old}
    new = [t for t in tasks if t.shard_id not in old_ids]
    if not new and not plan.get("frozen"):
        return tasks, None  # a rerun of the same run (or of fewer shards): the ordinary contract
    kept = len(tasks) - len(new)
    if new and 0 < kept < len(old):
        missing = next(t.path for t in old if t.shard_id not in {u.shard_id for u in tasks})
        raise GrowError(
            f"--out {run.root} holds a complete run of {len(old)} shards; --pool adds {len(new)} new ones "
            f"but leaves out {len(old) - kept} of its shards (e.g. {missing}). A run grows by adding shards: "
            "list all of its shards or only the new ones, or score this pool into a new --out"
        )
    grown = old + [ShardTask(len(old) + i, t.path, t.shard_id, t.source) for i, t in enumerate(new)]
    return grown, _frozen(run, card, len(new))


def _frozen(run: RunDir, card: dict, added: int) -> Frozen:
    """The frozen parts, checked against the card: a file changed since the card was written is refused."""
    reference = read_json(run.reference_marker)
    clusters = read_json(run.clusters_marker) if card.get("centroids") is not None else None
    files = [("reference", run.reference, reference)]
    if card.get("centroids") is not None:
        files += [("centroids", run.centroids, clusters), ("targets", run.targets, clusters)]
    for key, path, marker in files:
        if marker is None or not path.is_file() or blake2b128_file(path) != card[key]:
            raise GrowError(
                f"{path}: missing or not the {key} {run.root / CARD} records (digest {card[key]}): the run "
                "was changed after it completed; rerun it with its last pool to complete it, then grow it, "
                "or score the pool into a new --out"
            )
    if reference.get("digest") != card["reference"]:
        raise GrowError(f"{run.reference_marker}: does not describe the frozen reference; use a new --out")
    return Frozen(card=card, reference=reference, clusters=clusters, added=added)


def check_model(frozen: Frozen, role: str, path: str | None, digest: str | None) -> None:
    """The model given for `role` must be the one the run was scored with (its card's digest)."""
    want = (frozen.card.get("models") or {}).get(role)
    if want is None or digest == want:
        return
    was = (frozen.card.get("model_paths") or {}).get(role)
    given = f"--{role} {path} (digest {digest})" if path else f"no --{role}"
    raise GrowError(
        f"{given}: the run's scores were computed with another {role} model (digest {want}, {was}), "
        f"recorded in its {CARD}; its reference sets and old shards' scores are frozen with that model. Pass "
        f"--{role} {was or 'with that model'} to grow the run, or score the pool into a new --out"
    )


def check_reference(frozen: Frozen, run: RunDir, given: str | None, dim: int) -> None:
    """A `--reference` given to a grow must hold the frozen S_i/S_t."""
    if given is None:
        return
    from hype.scoring.reference import load_reference

    mine, theirs = load_reference(run.reference, dim=dim), load_reference(given, dim=dim)
    if not (_same(mine.img, theirs.img) and _same(mine.txt, theirs.txt)):
        raise GrowError(
            f"--reference {given}: not the run's frozen reference sets ({run.reference}, digest "
            f"{frozen.card['reference']}); drop --reference to keep them, or score the pool into a new --out"
        )


def check_centroids(frozen: Frozen, run: RunDir, given: str | None, centroids: np.ndarray | None) -> None:
    """A `--centroids` given to a grow (`centroids`: the file `given`, read) must equal the frozen ones."""
    if given is None:
        return
    if frozen.clusters is None or not _same(load_npy(run.centroids), centroids):
        raise GrowError(
            f"--centroids {given}: not the run's frozen centroids ({run.centroids}); drop --centroids to "
            "keep them, or score the pool into a new --out"
        )


def check_targets(frozen: Frozen, run: RunDir, targets: np.ndarray | None, source: str) -> None:
    """The class set given must give the frozen c_IN targets with the frozen centroids."""
    if frozen.clusters is None:
        raise GrowError(
            f"{source}: the run was scored without c_IN (no class features or images); drop the option to "
            "grow it as it is, or score the pool into a new --out"
        )
    if not _same(load_npy(run.targets), targets):
        raise GrowError(
            f"{source}: gives other c_IN targets than the run's frozen ones ({run.targets}); pass the class "
            "features or images the run was scored with, or score the pool into a new --out"
        )


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.array_equal(a, b))
