"""Training checkpoints: model weights in hype's checkpoint format plus a training-state file.

Layout of `OUT/checkpoints/` for a checkpoint at step N:

    step-0000000N.safetensors   the model (hype.checkpoint: loadable by `hype eval`, scoring, ...)
    step-0000000N.state.pt      optimizer, GradScaler, step, samples seen, data stream and RNG state,
                                the training config: only tensors and plain containers, so it loads
                                with `torch.load(weights_only=True)`

Both are written atomically (temporary file, fsync, rename), the weights first: the state file is the
commit marker, so a checkpoint counts only once both exist and a run killed while saving resumes from
the previous one. OUT may be a URL (`hype.io.storage`): each file is then uploaded whole once written,
the state file last, and read back through a local copy (safetensors and torch.load open files by name).
Resuming is refused when the recipe differs (`config_differences`); settings that do not change the
experiment (`RESUME_MAY_DIFFER`: workers, logging, checkpoint cadence, ...) may change.

A finished run is marked by `OUT/summary.json` (the run contract, `hype.io.runs`): state `done` once the
final model is published, with the recipe's fingerprint (`recipe_fingerprint`: every setting but
`RESUME_MAY_DIFFER`); a rerun of the same recipe finds it and returns without building anything.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_model

from hype.checkpoint import read_checkpoint_metadata, save_checkpoint
from hype.io import AnyPath, atomic_path, atomic_write, local_file, open_input, storage
from hype.io.runs import fingerprint

STATE_FORMAT = "hype-train-state/1"

# Settings that may change between a run and its resumption without changing the experiment.
RESUME_MAY_DIFFER = {
    "description",
    "out",
    "device",
    "log_every_steps",
    "grad_checkpointing",
    "max_steps",
    "debug_nan_at_step",
    "data.train",  # the same shards may have moved
    "data.workers",
    "data.prefetch",
    "data.subset_check_shards",
    "checkpoint.every_steps",
    "checkpoint.keep",
}

_STATE_RE = re.compile(r"^step-(\d{8,})\.state\.pt$")


class ResumeError(ValueError):
    """A training state that cannot be resumed (corrupt, or from a different configuration)."""


@dataclass(frozen=True)
class CheckpointPaths:
    model: AnyPath
    state: AnyPath
    step: int


def checkpoint_paths(out: str | os.PathLike | AnyPath, step: int) -> CheckpointPaths:
    folder = storage.join(out, "checkpoints")
    return CheckpointPaths(
        folder / f"step-{step:08d}.safetensors", folder / f"step-{step:08d}.state.pt", step
    )


def list_checkpoints(out: str | os.PathLike | AnyPath) -> list[CheckpointPaths]:
    """Complete checkpoints (weights and state both present), oldest first."""
    names = storage.list_sizes(storage.join(out, "checkpoints"))  # one listing, also on object storage
    found = []
    for name in names:
        m = _STATE_RE.match(name)
        if m:
            paths = checkpoint_paths(out, int(m.group(1)))
            if paths.model.name in names:
                found.append(paths)
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(out: str | os.PathLike) -> CheckpointPaths | None:
    found = list_checkpoints(out)
    return found[-1] if found else None


def _atomic_torch_save(obj: Any, path: AnyPath) -> None:
    with atomic_write(path) as f:
        torch.save(obj, f)


def save_training_checkpoint(
    out: str | os.PathLike,
    step: int,
    model: torch.nn.Module,
    state: dict[str, Any],
    *,
    extra: dict | None = None,
) -> CheckpointPaths:
    """Write the weights, then the state (the commit marker). `model` must be unwrapped (not DDP)."""
    paths = checkpoint_paths(out, step)
    extra = {"step": step, **(extra or {})}
    if storage.is_url(paths.model):  # hype.checkpoint writes a local file: uploaded whole once written
        with atomic_path(paths.model) as tmp:
            save_checkpoint(tmp, model, extra=extra)
    else:
        save_checkpoint(paths.model, model, extra=extra)
    _atomic_torch_save({"format": STATE_FORMAT, **state, "model_checkpoint": paths.model.name}, paths.state)
    return paths


def load_training_state(paths: CheckpointPaths) -> dict[str, Any]:
    """Read a state file without unpickling arbitrary objects."""
    from hype.io.weights import require_safe_torch_load

    require_safe_torch_load(paths.state)  # before the try: its message says what to upgrade
    try:
        with local_file(paths.state) as path:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ResumeError(
            f"{paths.state}: unreadable training state ({type(e).__name__}: {e}); delete it to resume from "
            "the previous checkpoint"
        ) from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise ResumeError(f"{paths.state}: not a hype training state ({STATE_FORMAT})")
    return state


def load_model_weights(model: torch.nn.Module, paths: CheckpointPaths) -> None:
    """Load a checkpoint's weights into `model` in place (strict: same architecture)."""
    with local_file(paths.model) as path:
        meta = read_checkpoint_metadata(path)
        if meta["model_config"] != model.config.to_dict():
            raise ResumeError(
                f"{paths.model}: the checkpoint's model config differs from the configured model; resume "
                "with the same model config or start a new run in another --out"
            )
        missing, unexpected = load_model(
            model, str(path), strict=False, device=str(next(model.parameters()).device)
        )
    if missing or unexpected:
        raise ResumeError(
            f"{paths.model}: weights do not match the model "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )


def prune_checkpoints(out: str | os.PathLike | AnyPath, keep: int) -> list[AnyPath]:
    """Delete all but the newest `keep` checkpoints; returns the removed files."""
    removed = []
    for old in list_checkpoints(out)[:-keep] if keep > 0 else []:
        for p in (old.state, old.model):  # state first: a half-deleted checkpoint is never "complete"
            storage.remove(p)
            removed.append(p)
    return removed


def publish_final(paths: CheckpointPaths, target: AnyPath) -> AnyPath:
    """Expose the final weights at `target` (e.g. OUT/model.safetensors): a hard link when possible (a
    copy on object storage)."""
    with atomic_path(target) as tmp:
        if storage.is_url(paths.model):
            with open_input(paths.model, stream=True) as f, open(tmp, "wb") as g:
                shutil.copyfileobj(f, g, 1 << 20)
        else:
            try:
                tmp.unlink()  # atomic_path made it as ours; a link needs the name free
                os.link(paths.model, tmp)
            except OSError:
                shutil.copyfile(paths.model, tmp)
    return target


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "model":
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    a, b = _flatten(saved), _flatten(current)
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if k not in RESUME_MAY_DIFFER and a.get(k) != b.get(k)
    ]


def recipe_fingerprint(config: dict) -> str:
    """The run contract's fingerprint of a training recipe (`TrainConfig.to_dict()`): every setting that
    changes the experiment, i.e. all but `RESUME_MAY_DIFFER`."""
    return fingerprint({k: v for k, v in _flatten(config).items() if k not in RESUME_MAY_DIFFER})


def resolve_resume(resume: str, out: AnyPath) -> CheckpointPaths | None:
    """The checkpoint to continue from: `auto` (latest in OUT, if any), `never` (refuse an existing run),
    a run folder, or a step-*.state.pt / .safetensors file."""
    if resume in ("auto", "never"):
        found = latest_checkpoint(out)
        if found is not None and resume == "never":
            raise ResumeError(
                f"{out} already holds a run (checkpoint at step {found.step}); resume it (--resume auto) or "
                "choose another --out"
            )
        return found
    path = storage.location(resume)
    if storage.is_dir(path):
        found = latest_checkpoint(path.parent if path.name == "checkpoints" else path)
        if found is None:
            raise ResumeError(
                f"{path}: no complete checkpoint (step-*.state.pt + .safetensors) to resume from"
            )
        return found
    name = path.name
    for suffix in (".state.pt", ".safetensors"):
        if name.endswith(suffix) and name.startswith("step-"):
            step = int(name[len("step-") : -len(suffix)])
            paths = checkpoint_paths(path.parent.parent, step)
            if not (storage.is_file(paths.state) and storage.is_file(paths.model)):
                raise ResumeError(f"{path}: needs both {paths.state.name} and {paths.model.name} next to it")
            return paths
    raise ResumeError(f"--resume {resume}: expected auto, never, a run folder or a step-*.state.pt file")
