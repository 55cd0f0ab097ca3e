"""Read the open_clip model files users have, in every layout, into a `ContrastiveModel`. DESIGN §6.

    read_open_clip("ViT-L-14.pt")                        OpenAI's release (architecture from the shapes)
    read_open_clip("models--laion--CLIP-ViT-B-32-DataComp.XL-s13B-b90K/")   a Hugging Face cache folder
    read_open_clip("logs/run/checkpoints/epoch_8.pt")    open_clip_train (architecture from params.txt)
    read_open_clip("weights.safetensors", arch="ViT-B-32")   a bare state dict needs the architecture

The architecture comes, first to last, from `arch`, the folder's `open_clip_config.json`, the training
run's `params.txt` (`model: ...`, and the EuCLIP fork's `geometry: ...`) two folders above an
`open_clip_train` checkpoint, or the shapes of an OpenAI-layout release. A bare state dict with none of
these is ambiguous (ViT-B-32 and ViT-B-32-quickgelu hold the same tensors) and is refused with the
candidate names. Files are read by `hype.io.weights.load_source`, which never runs pickled code.

An architecture hype's towers build (a ViT with open_clip's text transformer) becomes a `ContrastiveModel`;
with `native=True` (what `hype.checkpoint.load_model_file` asks for: the scorer and `hype eval`) any other
CLIP-geometry architecture becomes open_clip's own model behind the same interface
(`hype.models.open_clip_native`); without it (conversion, `hype train --init`) it is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hype.geometry import GEOMETRIES
from hype.io import sha256_bytes, sha256_file
from hype.io.weights import ModelFileError, load_source, unwrap_state_dict
from hype.models.config import fit_scalar_bounds
from hype.models.contrastive import ContrastiveModel
from hype.models.factory import create_model
from hype.models.open_clip_format import (
    OPENAI_EXTRAS,
    builtin_config,
    builtin_name,
    infer_openai_config,
    model_config_from_open_clip,
    state_dict_from_open_clip,
    unsupported_features,
)
from hype.models.open_clip_native import (
    OpenClipModel,
    build_open_clip_model,
    confine_to_entry,
    open_clip_state_dict,
)

HF_CONFIG = "open_clip_config.json"
# open_clip's own preference among the weight files of a folder (factory._find_checkpoint_in_dir).
HF_WEIGHTS = (
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.safetensors",
    "open_clip_pytorch_model.bin",
    "open_clip_pytorch_model.pth",
    "model.safetensors",
    "pytorch_model.bin",
)
PARAMS = "params.txt"


@dataclass
class ImportedModel:
    """A model read from open_clip files, and where each part of it came from."""

    model: ContrastiveModel | OpenClipModel  # OpenClipModel: open_clip's own model (native=True only)
    weights: Path  # the file the tensors came from
    layout: str  # hf-folder | open_clip_train | openai | state-dict
    arch: str  # open_clip architecture name (or the folder's name for an unnamed config)
    arch_origin: str  # where the architecture was read
    geometry_origin: str
    source_tensors: int
    ignored_top_level: list[str] = field(default_factory=list)


def source_digest(path: str | Path, digest: Callable[[Path], str] = sha256_file) -> str:
    """Content digest of what `read_open_clip(path)` reads (weights plus the config beside them), each
    file hashed with `digest`."""
    p = Path(path)
    weights, config = _locate(p)
    parts = [digest(weights)]
    for extra in (config, _params_file(weights)):
        if extra is not None:
            parts.append(digest(extra))
    return parts[0] if len(parts) == 1 else sha256_bytes("+".join(parts).encode())


def read_open_clip(
    path: str | Path, *, arch: str | None = None, geometry: str | None = None, native: bool = False
) -> ImportedModel:
    """The open_clip model at `path` (file or folder), fp32, in eval mode: a `ContrastiveModel` when
    hype's towers build its architecture, else (`native=True`, CLIP geometry) open_clip's own model as an
    `OpenClipModel`; without `native`, such an architecture raises `UnsupportedArchitecture`."""
    p = Path(path)
    if not p.exists():
        raise ModelFileError(f"{p}: not found")
    weights, hf_config = _locate(p)
    sd, top_level = unwrap_state_dict(load_source(weights), weights)
    if not sd:
        raise ModelFileError(f"{weights}: holds no tensors")
    params = _read_params(_params_file(weights))
    openai = any(k in sd for k in OPENAI_EXTRAS)
    layouts = (
        ("hf-folder", hf_config),
        ("open_clip_train", params),
        ("openai", openai),
        ("state-dict", True),
    )
    layout = next(name for name, present in layouts if present)

    model_cfg, preprocess_cfg, name, arch_origin = _architecture(arch, hf_config, params, sd, weights)
    geometry, geometry_origin = _geometry(geometry, params, sd)
    described = hf_config or _params_file(weights) or weights
    try:
        model = _build(model_cfg, preprocess_cfg, name, geometry, native, hf_config, sd, weights)
    except ModelFileError as e:
        if str(described) in str(e) or str(weights) in str(e):
            raise
        raise type(e)(f"{described}: {e}") from None  # name the file the problem comes from
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # ConfigError, malformed config values
        raise ModelFileError(
            f"{described}: open_clip architecture {name!r} cannot be built from this config "
            f"({type(e).__name__}: {e})"
        ) from None
    return ImportedModel(
        model=model.eval(),
        weights=weights,
        layout=layout,
        arch=name,
        arch_origin=arch_origin,
        geometry_origin=geometry_origin,
        source_tensors=len(sd),
        ignored_top_level=top_level,
    )


def _build(
    model_cfg: dict,
    preprocess_cfg: dict,
    name: str,
    geometry: str,
    native: bool,
    hf_config: Path | None,
    sd: dict,
    weights: Path,
) -> ContrastiveModel | OpenClipModel:
    """The model, built first on the meta device and checked against the file's tensors: memory is
    allocated only for a model whose every tensor the file holds (a config cannot ask for more)."""
    if native and geometry == "clip" and unsupported_features(model_cfg):
        folder = hf_config.parent if hf_config is not None else None
        with torch.device("meta"):
            probe = build_open_clip_model(model_cfg, preprocess_cfg, name=name, folder=folder, device="meta")
        _check_tensors(probe.open_clip, open_clip_state_dict(probe, sd), weights, name)
        model = build_open_clip_model(model_cfg, preprocess_cfg, name=name, folder=folder)
        _load_strict(model.open_clip, open_clip_state_dict(model, sd), weights, name)
        return model
    config = model_config_from_open_clip(model_cfg, preprocess_cfg, name=name, geometry=geometry)
    mapped = state_dict_from_open_clip(sd)
    # open_clip clamps the logit scale (and the fork its curvature, α) only while training.
    config, _ = fit_scalar_bounds(config, mapped)
    _check_tensors(create_model(config, device="meta"), mapped, weights, name)
    model = create_model(config)
    _load_strict(model, mapped, weights, name)
    return model


# --- where the parts come from --------------------------------------------------------------------


def _locate(p: Path) -> tuple[Path, Path | None]:
    """(weights file, open_clip_config.json or None) for a file, an HF folder or an HF cache folder."""
    if p.is_file():
        return p, _config_beside(p)
    folder = _hf_snapshot(p)
    config = folder / HF_CONFIG
    for name in HF_WEIGHTS:
        if (folder / name).is_file():
            return folder / name, (config if config.is_file() else None)
    ckpts = _train_checkpoints(folder)
    if ckpts:
        return ckpts[-1], _config_beside(ckpts[-1])
    raise ModelFileError(
        f"{p}: a folder without open_clip weights; expected {HF_CONFIG} beside one of "
        f"{', '.join(HF_WEIGHTS[:3])} (a Hugging Face model folder), or an open_clip_train run folder "
        "with checkpoints/epoch_N.pt"
    )


def _config_beside(weights: Path) -> Path | None:
    # Beside the weights (a Hugging Face folder), or at the top of a run folder whose checkpoints/ holds them.
    folders = [weights.parent] + ([weights.parent.parent] if weights.parent.name == "checkpoints" else [])
    return next((f / HF_CONFIG for f in folders if (f / HF_CONFIG).is_file()), None)


def _hf_snapshot(folder: Path) -> Path:
    # A Hugging Face cache entry (models--org--name/) keeps files under snapshots/<commit>/, the
    # current one named by refs/main. Everything read from an entry stays inside it: refs/main names a
    # folder of snapshots/ (one path component), and each file of the snapshot resolves inside the entry
    # (hf's own symlinks point into its blobs/).
    ref = folder / "refs" / "main"
    if not (folder / "snapshots").is_dir():
        return folder
    snap = None
    if ref.is_file():
        commit = ref.read_text(errors="replace").strip()
        if not commit or commit in (".", "..") or any(c in commit for c in "/\\") or not commit.isprintable():
            raise ModelFileError(
                f"{ref}: names {commit!r}, not a snapshot folder under {folder / 'snapshots'}; the cache "
                "entry is damaged or crafted. Pass the snapshot folder itself (snapshots/<commit>/)"
            )
        if (folder / "snapshots" / commit).is_dir():
            snap = folder / "snapshots" / commit
    if snap is None:
        snaps = sorted(d for d in (folder / "snapshots").iterdir() if d.is_dir())
        if len(snaps) != 1:
            raise ModelFileError(
                f"{folder}: a Hugging Face cache folder with {len(snaps)} snapshots and no refs/main naming "
                "one; pass the snapshot folder itself (snapshots/<commit>/)"
            )
        snap = snaps[0]
    confine_to_entry(snap, folder)
    return snap


def _train_checkpoints(folder: Path) -> list[Path]:
    # open_clip_train writes <run>/checkpoints/epoch_<N>.pt (and epoch_latest.pt); newest last.
    ckpt_dir = folder / "checkpoints" if (folder / "checkpoints").is_dir() else folder
    latest = ckpt_dir / "epoch_latest.pt"
    if latest.is_file():
        return [latest]
    numbered = [f for f in ckpt_dir.glob("epoch_*.pt") if f.stem[6:].isdigit()]
    return sorted(numbered, key=lambda f: int(f.stem[6:]))


def _params_file(weights: Path) -> Path | None:
    # open_clip_train: <run>/params.txt beside <run>/checkpoints/epoch_N.pt (the fork's evaluation reads
    # the geometry there too).
    for candidate in (weights.parent.parent / PARAMS, weights.parent / PARAMS):
        if candidate.is_file():
            return candidate
    return None


def _read_params(path: Path | None) -> dict[str, str]:
    """open_clip_train's params.txt: one `name: value` per line."""
    if path is None:
        return {}
    out = {}
    for line in path.read_text(errors="replace").splitlines():
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip()] = value.strip()
    return out


def _architecture(
    arch: str | None, hf_config: Path | None, params: dict[str, str], sd: dict, weights: Path
) -> tuple[dict[str, Any], dict[str, Any], str, str]:
    """(model_cfg, preprocess_cfg, name, where it came from)."""
    if arch is not None:
        cfg = builtin_config(arch)
        if cfg is None:
            raise ModelFileError(
                f"--arch {arch!r}: not an open_clip architecture name; see open_clip.list_models() "
                "(e.g. ViT-B-32, ViT-B-16, ViT-L-14, ViT-L-14-quickgelu)"
            )
        return cfg, {}, arch, "--arch"
    if hf_config is not None:
        try:
            data = json.loads(hf_config.read_text())
            model_cfg = data["model_cfg"]
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise ModelFileError(f"{hf_config}: not an open_clip config with a model_cfg ({e})") from None
        _check_config_types(hf_config, data)
        name = builtin_name(model_cfg) or hf_config.parent.name
        return model_cfg, data.get("preprocess_cfg") or {}, name, str(hf_config)
    if params.get("model"):
        name = params["model"]
        cfg = builtin_config(name)
        if cfg is None:
            raise ModelFileError(
                f"{weights}: params.txt names model {name!r}, which this open_clip does not know; pass "
                "--arch with the matching built-in name"
            )
        if params.get("force_quick_gelu") == "True":
            cfg = {**cfg, "quick_gelu": True}
        return cfg, {}, name, "params.txt"
    if any(k in sd for k in OPENAI_EXTRAS):
        cfg = infer_openai_config(sd)
        name = builtin_name(cfg) or "openai-clip"
        return cfg, {}, name, "OpenAI release (shapes; QuickGELU)"
    raise ModelFileError(
        f"{weights}: a bare state dict does not say its architecture (ViT-B-32 and ViT-B-32-quickgelu hold "
        f"the same tensors); pass --arch NAME{_candidates(sd)}"
    )


def _check_config_types(path: Path, data: dict) -> None:
    """The JSON types of an open_clip_config.json's sections (values are checked when it is built)."""
    model_cfg = data["model_cfg"]
    problems = [] if isinstance(model_cfg, dict) else ["model_cfg is not an object"]
    if not problems:
        problems += [
            f"model_cfg.{k} is not an object"
            for k in ("vision_cfg", "text_cfg")
            if not isinstance(model_cfg.get(k, {}), dict)
        ]
    if not isinstance(data.get("preprocess_cfg") or {}, dict):
        problems.append("preprocess_cfg is not an object")
    if problems:
        raise ModelFileError(f"{path}: not a valid open_clip config: {'; '.join(problems)}")


def _candidates(sd: dict) -> str:
    """', e.g. one of: ...' listing built-in names whose tensors have these shapes."""
    try:
        base = infer_openai_config(state_dict_to_top_level(sd))
    except Exception:  # not a ViT CLIP at all: no suggestion
        return ""
    from hype.models.open_clip_format import _normalized, builtin_names

    found = []
    for name in builtin_names():
        cfg = builtin_config(name)
        if cfg is None:
            continue
        for quick in (False, True):
            probe = {**base, "quick_gelu": quick, "vision_cfg": {**base["vision_cfg"]}}
            probe["vision_cfg"]["head_width"] = cfg.get("vision_cfg", {}).get("head_width", 64)
            probe["text_cfg"] = {**base["text_cfg"], "heads": cfg.get("text_cfg", {}).get("heads")}
            probe["custom_text"] = cfg.get("custom_text", False)
            if _normalized(probe) == _normalized(cfg):
                found.append(name)
    return f", e.g. one of: {', '.join(sorted(set(found)))}" if found else ""


def state_dict_to_top_level(sd: dict) -> dict:
    """`CustomTextCLIP` keys (`text.*`) -> `CLIP` keys, for reading shapes the OpenAI way."""
    return {k[len("text.") :] if k.startswith("text.") else k: v for k, v in sd.items()}


def _geometry(geometry: str | None, params: dict[str, str], sd: dict) -> tuple[str, str]:
    if geometry is not None:
        return geometry, "--geometry"
    if params.get("geometry"):
        g = params["geometry"]
        if g not in GEOMETRIES:
            known = ", ".join(GEOMETRIES)
            raise ModelFileError(f"params.txt: geometry {g!r} is not one hype builds ({known})")
        return g, "params.txt"
    if "curvature" in sd:
        raise ModelFileError(
            "the state dict has a curvature (an EuCLIP-fork hyperbolic model) but no params.txt says which "
            "geometry; pass --geometry hyperbolic or --geometry hyperbolic-squared"
        )
    return "clip", "default (no params.txt)"


def _load_strict(model: torch.nn.Module, mapped: dict, weights: Path, name: str) -> None:
    _check_tensors(model, mapped, weights, name)
    with torch.no_grad():
        model.load_state_dict(mapped, strict=True)  # casts fp16 releases to the model's fp32


def _check_tensors(model: torch.nn.Module, mapped: dict, weights: Path, name: str) -> None:
    """Every tensor of `model` (meta or real) in `mapped`, with its shape, and nothing else."""
    want = model.state_dict()
    missing = sorted(set(want) - set(mapped))
    unexpected = sorted(set(mapped) - set(want))
    shapes = [
        f"{k}: {tuple(mapped[k].shape)} in the file, {tuple(want[k].shape)} in {name}"
        for k in sorted(set(want) & set(mapped))
        if mapped[k].shape != want[k].shape
    ]
    if missing or unexpected or shapes:
        from hype.io.weights import listing

        parts = [
            f"missing ({len(missing)}): {listing(missing)}" if missing else "",
            f"unexpected ({len(unexpected)}): {listing(unexpected)}" if unexpected else "",
            f"wrong shapes ({len(shapes)}): {listing(shapes)}" if shapes else "",
        ]
        raise ModelFileError(
            f"{weights}: the tensors do not match architecture {name!r}: "
            + "; ".join(x for x in parts if x)
            + ". Check --arch (open_clip.list_models()) or that the file is an open_clip CLIP checkpoint"
        )
