"""open_clip's own model behind a hype CLIP's interface, for the architectures hype does not translate.

hype translates the open_clip ViTs that use open_clip's text transformer into its own `ContrastiveModel`
(`hype.models.open_clip_format`). Every other open_clip architecture (ResNets, timm towers such as
ConvNeXt, EVA, ViTamin, MobileCLIP and SigLIP's ViTs, Hugging Face text towers, CoCa, ...) is built here by
`open_clip.create_model` from its own config (random init: no pretrained download of any tower), and
`hype.models.open_clip_files.read_open_clip` loads the user's weights into it. `OpenClipModel` offers what
the CLIP scorer (`hype score --clip`) and `hype eval --model` read from a model:

    model.config.name / .embed_dim / .geometry ("clip") / .vision.image_size / .text.context_length
    model.config.preprocess         open_clip's final preprocess config (mean, std, resize mode,
                                    interpolation), read by `hype.data.imageprep.Preprocess`
    model.geometry, model.curv      cosine (CLIP) geometry, no curvature
    model.tokenizer()               open_clip's tokenizer for the config (`get_tokenizer`'s choice)
    model.encode_image / encode_text / similarity / logit_scale / preprocess(train)

The geometry is always the cosine one, so such a model is a CLIP scorer and an eval model only: it is not
a MERU (`--meru`), and it cannot seed hype's own towers (`hype train --init`) or be converted.

Hugging Face tokenizers and text towers need `transformers` (not a hype dependency); their files are read
from the model's own folder or the local Hugging Face cache, never downloaded (an error names the repo to
fetch).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hype.geometry import Geometry, get_geometry
from hype.io.weights import ModelFileError
from hype.models.config import PreprocessConfig

Tensor = torch.Tensor

# Files that make a folder a Hugging Face tokenizer (open_clip's push_to_hf_hub writes them beside the model).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


@dataclass(frozen=True)
class _Vision:
    image_size: int


@dataclass(frozen=True)
class _Text:
    context_length: int


@dataclass(frozen=True)
class OpenClipConfig:
    """What hype reads from a model's config, for a model open_clip builds itself."""

    name: str
    embed_dim: int
    vision: _Vision
    text: _Text
    preprocess: PreprocessConfig
    model_cfg: dict = field(repr=False)  # open_clip's model_cfg, as given
    preprocess_cfg: dict = field(repr=False)  # open_clip's final preprocess config
    geometry: str = "clip"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "geometry": self.geometry,
            "embed_dim": self.embed_dim,
            "open_clip": {"model_cfg": self.model_cfg, "preprocess_cfg": self.preprocess_cfg},
        }


class OpenClipModel(nn.Module):
    """An open_clip model (`.open_clip`) with the interface the scorer and `hype eval` use."""

    def __init__(self, model: nn.Module, config: OpenClipConfig, tokenizer: Any):
        super().__init__()
        self.open_clip = model
        self.config = config
        self.geometry: Geometry = get_geometry("clip")
        self._tokenizer = tokenizer

    curv = None  # the cosine geometry has no curvature

    @property
    def logit_scale(self) -> Tensor:
        return self.open_clip.logit_scale.exp().reshape(())

    def _embed(self, features: Tensor) -> Tensor:
        # As `ContrastiveModel`: towers may run under autocast; the normalization runs in fp32.
        if features.dtype not in (torch.float32, torch.float64):
            features = features.float()
        with torch.autocast(device_type=features.device.type, enabled=False):
            return self.geometry.embed(features)

    def encode_image(self, images: Tensor) -> Tensor:
        """Images (B, 3, H, W), normalized by `preprocess` -> unit-norm embeddings (B, embed_dim)."""
        # normalize=False: CoCa's default is True; the normalization is the geometry's, in fp32.
        return self._embed(self.open_clip.encode_image(images, normalize=False))

    def encode_text(self, tokens: Tensor) -> Tensor:
        """Token ids from `tokenizer()` -> unit-norm embeddings (B, embed_dim)."""
        return self._embed(self.open_clip.encode_text(tokens, normalize=False))

    def similarity(self, image_emb: Tensor, text_emb: Tensor) -> Tensor:
        """cos θ for all pairs (N_img, N_txt)."""
        return self.geometry.pairwise(image_emb, text_emb)

    def forward(self, images: Tensor, tokens: Tensor) -> dict[str, Any]:
        return {
            "image": self.encode_image(images),
            "text": self.encode_text(tokens),
            "logit_scale": self.logit_scale,
            "curv": None,
        }

    def tokenizer(self) -> Any:
        """open_clip's tokenizer for this architecture: call it on a string or list of strings."""
        return self._tokenizer

    def preprocess(self, train: bool) -> Any:
        """open_clip's image transform for this model's preprocess config (`image_transform_v2`)."""
        from open_clip.transform import PreprocessCfg, image_transform_v2

        return image_transform_v2(PreprocessCfg(**self.config.preprocess_cfg), is_train=train)

    def extra_repr(self) -> str:
        return f"name={self.config.name!r}, geometry='clip', embed_dim={self.config.embed_dim} (open_clip)"


def build_open_clip_model(
    model_cfg: Mapping[str, Any],
    preprocess_cfg: Mapping[str, Any] | None,
    *,
    name: str,
    folder: Path | None = None,
    device: str = "cpu",
) -> OpenClipModel:
    """open_clip's model for `model_cfg` (random init, fp32, eval mode), its tokenizer and preprocess.

    `folder` is the model's Hugging Face folder, where open_clip looks for a Hugging Face tokenizer first.
    `device="meta"` (inside `with torch.device("meta")`) builds without allocating, to check a config.
    Raises `ModelFileError` naming what is missing (`transformers`, a tokenizer or text-tower config that
    is not on this machine) or what open_clip could not build.
    """
    cfg = copy.deepcopy(dict(model_cfg))
    text = dict(cfg.get("text_cfg") or {})
    hf_repos = [text[k] for k in ("hf_model_name", "hf_tokenizer_name") if text.get(k)]
    if hf_repos and importlib.util.find_spec("transformers") is None:
        raise ModelFileError(
            f"open_clip architecture {name!r} uses Hugging Face's {' and '.join(sorted(set(hf_repos)))} "
            "(a tokenizer or text tower), which needs `transformers`: pip install transformers"
        )
    tokenizer = _tokenizer(text, folder, name)
    if text.get("hf_model_name"):
        # open_clip reads the text tower's Hugging Face config by name; give it the local copy.
        tower = _hf_local(text["hf_model_name"], ("config.json",), "text tower", name)
        _refuse_custom_code(tower, name)
        text["hf_model_name"] = str(tower)
        cfg["text_cfg"] = text
    model = _create(cfg, dict(preprocess_cfg or {}), name, device)
    config = _config(model, dict(model_cfg), name, tokenizer)
    return OpenClipModel(model.eval(), config, tokenizer)


def open_clip_state_dict(model: OpenClipModel, sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A checkpoint's tensors as open_clip's `load_checkpoint` hands them to `load_state_dict`: third-party
    layouts converted (Apple's MobileCLIP), `CLIP` text keys moved under `text.` for a `CustomTextCLIP`,
    scalar shapes matched. Non-persistent buffers a TorchScript archive keeps (the causal mask) and
    OpenAI's extra entries are dropped; positional embeddings are not resized (a mismatch is an error)."""
    from open_clip.convert import convert_state_dict
    from open_clip.model import convert_to_custom_text_state_dict

    from hype.models.open_clip_format import OPENAI_EXTRAS

    inner = model.open_clip
    keep = set(inner.state_dict())
    rebuilt = {k for k, _ in inner.named_buffers()} - keep
    out = {k: v for k, v in sd.items() if k not in OPENAI_EXTRAS and k not in rebuilt}
    out = convert_state_dict(inner, out)
    if "positional_embedding" in out and not hasattr(inner, "positional_embedding"):
        out = convert_to_custom_text_state_dict(out)
    for scalar in ("logit_scale", "logit_bias"):
        own = getattr(inner, scalar, None)
        if scalar in out and own is not None and out[scalar].ndim != own.ndim:
            out[scalar] = out[scalar].reshape(own.shape)
    if "logit_bias" not in out and getattr(inner, "logit_bias", None) is not None and "logit_scale" in out:
        out["logit_bias"] = torch.zeros_like(out["logit_scale"])  # as open_clip: a CLIP file in a SigLIP
    if "text.transformer.embeddings.position_ids" not in keep:  # dropped by transformers >= 4.31
        out.pop("text.transformer.embeddings.position_ids", None)
    return out


# --- building --------------------------------------------------------------------------------------


class _DropOpenClipLogs(logging.Filter):
    # open_clip logs "no pretrained weights loaded, initialized randomly" on the root logger; here the
    # weights come right after, so the message would only mislead.
    def filter(self, record: logging.LogRecord) -> bool:
        return Path(record.pathname).parent.name != "open_clip"


def _create(model_cfg: dict, preprocess_cfg: dict, name: str, device: str) -> nn.Module:
    """`open_clip.create_model` on this config, as open_clip builds a `local-dir:` model without weights."""
    import open_clip

    drop = _DropOpenClipLogs()
    root = logging.getLogger()
    with tempfile.TemporaryDirectory(prefix="hype-open-clip-") as tmp:
        cfg = {"model_cfg": model_cfg, "preprocess_cfg": preprocess_cfg}
        (Path(tmp) / "open_clip_config.json").write_text(json.dumps(cfg))
        root.addFilter(drop)
        try:
            return open_clip.create_model(
                f"local-dir:{tmp}", pretrained_image=False, pretrained_text=False, device=device
            )
        except Exception as e:  # timm / transformers / open_clip raise many types for a config they reject
            raise ModelFileError(
                f"open_clip {getattr(open_clip, '__version__', '?')} could not build architecture "
                f"{name!r}: {type(e).__name__}: {e}"
            ) from e
        finally:
            root.removeFilter(drop)


def _config(model: nn.Module, model_cfg: dict, name: str, tokenizer: Any) -> OpenClipConfig:
    from open_clip import get_model_preprocess_cfg
    from open_clip.transform import PreprocessCfg

    pre = {**vars(PreprocessCfg()), **get_model_preprocess_cfg(model)}
    size = pre["size"]
    if isinstance(size, (list, tuple)):
        if len(size) != 2 or size[0] != size[1]:
            raise ModelFileError(
                f"open_clip architecture {name!r} takes {size[0]}x{size[1]} images; hype's image "
                "preprocessing makes square crops only"
            )
        size = size[0]
    mean, std = pre["mean"], pre["std"]
    mean = tuple(mean) if isinstance(mean, (list, tuple)) else (mean,) * 3
    std = tuple(std) if isinstance(std, (list, tuple)) else (std,) * 3
    # open_clip's eval transform treats "random" interpolation as bicubic.
    interpolation = "bilinear" if pre.get("interpolation") == "bilinear" else "bicubic"
    if pre.get("resize_mode") == "longest" and pre.get("fill_color", 0) != 0:
        raise ModelFileError(
            f"open_clip architecture {name!r} pads with fill_color={pre['fill_color']}; hype pads with 0"
        )
    preprocess = PreprocessConfig(
        mean=mean, std=std, resize_mode=pre.get("resize_mode") or "shortest", interpolation=interpolation
    )
    final = {
        "size": int(size),
        "mode": pre.get("mode", "RGB"),
        "mean": list(mean),
        "std": list(std),
        "interpolation": interpolation,
        "resize_mode": preprocess.resize_mode,
        "fill_color": pre.get("fill_color", 0),
    }
    return OpenClipConfig(
        name=name,
        embed_dim=int(model_cfg["embed_dim"]),
        vision=_Vision(int(size)),
        text=_Text(int(tokenizer.context_length)),
        preprocess=preprocess,
        model_cfg=model_cfg,
        preprocess_cfg=final,
    )


# --- tokenizers and Hugging Face files -------------------------------------------------------------


# The tokenizer options an open_clip config may set (`text_cfg.tokenizer_kwargs`), per tokenizer, with a
# test of each value. hype builds the options it hands a tokenizer from this list and its own fixed ones:
# nothing else in a model file (trust_remote_code, cache_dir, bpe_path, ...) ever reaches a loader.
_CLEAN = ("canonicalize", "lower", "whitespace")
_TOKENIZER_OPTIONS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "SimpleTokenizer": {
        "clean": lambda v: v in _CLEAN,
        "reduction_mask": lambda v: v in ("", "simple", "random", "shuffle", "syntax"),
    },
    "HFTokenizer": {
        "clean": lambda v: v in _CLEAN,
        "strip_sep_token": lambda v: isinstance(v, bool),
        "language": lambda v: isinstance(v, str),
    },
}
# Files in which a Hugging Face folder declares Python code of its own for transformers to import.
_CODE_DECLARATIONS = ("tokenizer_config.json", "config.json", "processor_config.json")


def _tokenizer_options(text_cfg: Mapping[str, Any], kind: str, name: str) -> dict[str, Any]:
    given = text_cfg.get("tokenizer_kwargs") or {}
    allowed = _TOKENIZER_OPTIONS[kind]
    if not isinstance(given, Mapping):
        raise ModelFileError(f"open_clip architecture {name!r}: text_cfg.tokenizer_kwargs is not a mapping")
    for key, value in given.items():
        if key not in allowed or not allowed[key](value):
            raise ModelFileError(
                f"open_clip architecture {name!r}: text_cfg.tokenizer_kwargs {key!r}: {value!r} is not a "
                f"tokenizer option hype accepts from a model file (for {kind}: {', '.join(allowed)} with "
                "open_clip's values); hype never passes loader options from a model file to a loader. "
                "Remove it from the model's open_clip_config.json"
            )
    return dict(given)


def _refuse_custom_code(folder: Path, name: str) -> None:
    """Refuse a Hugging Face folder that declares code of its own (`auto_map`): hype reads model files
    as data, and transformers would import that code when asked to trust it."""
    for filename in _CODE_DECLARATIONS:
        path = folder / filename
        if not path.is_file():
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ModelFileError(f"{path}: unreadable JSON ({e}); open_clip architecture {name!r}") from None
        if isinstance(data, dict) and ("auto_map" in data or data.get("trust_remote_code")):
            raise ModelFileError(
                f"{path}: declares Python code of its own (auto_map / trust_remote_code); hype never runs "
                f"code from a model folder (open_clip architecture {name!r}). Use a tokenizer and text "
                "tower that transformers implements itself"
            )


def _tokenizer(text_cfg: Mapping[str, Any], folder: Path | None, name: str) -> Any:
    """open_clip's `get_tokenizer` choice for this text config, with Hugging Face files read locally."""
    from open_clip.tokenizer import DEFAULT_CONTEXT_LENGTH, HFTokenizer, SimpleTokenizer

    context_length = text_cfg.get("context_length", DEFAULT_CONTEXT_LENGTH)
    repo = text_cfg.get("hf_tokenizer_name")
    if not repo:
        return SimpleTokenizer(
            context_length=context_length, **_tokenizer_options(text_cfg, "SimpleTokenizer", name)
        )
    options = _tokenizer_options(text_cfg, "HFTokenizer", name)
    mode = text_cfg.get("tokenizer_mode")
    if mode not in (None, "", "clips"):
        raise ModelFileError(f"open_clip architecture {name!r}: unknown text_cfg.tokenizer_mode {mode!r}")
    # open_clip reads a local-dir model's Hugging Face tokenizer from the model's folder; else by name.
    if folder is not None and any((folder / f).is_file() for f in TOKENIZER_FILES):
        source = folder
    else:
        source = _hf_local(repo, TOKENIZER_FILES, "tokenizer", name)
    _refuse_custom_code(source, name)
    try:
        return HFTokenizer(
            str(source),
            context_length=context_length,
            tokenizer_mode=mode,
            local_files_only=True,
            trust_remote_code=False,
            **options,
        )
    except (OSError, ValueError) as e:
        raise ModelFileError(f"open_clip architecture {name!r}: tokenizer {repo!r} at {source}: {e}") from e


def _hf_local(repo: str, filenames: tuple[str, ...], what: str, name: str) -> Path:
    """The local folder with Hugging Face repo `repo`'s files: `repo` itself if a folder, else the snapshot
    in the Hugging Face cache holding one of `filenames`."""
    if Path(repo).is_dir():
        return Path(repo)
    from huggingface_hub import constants, try_to_load_from_cache

    for filename in filenames:
        found = try_to_load_from_cache(repo, filename)
        if isinstance(found, str):
            snap = Path(found).parent  # <cache>/models--org--name/snapshots/<commit>/
            confine_to_entry(snap, snap.parent.parent)  # read only inside the entry, as model folders are
            return snap
    raise ModelFileError(
        f"open_clip architecture {name!r} needs the Hugging Face {what} {repo!r}, which is neither beside "
        f"the model nor in the Hugging Face cache ({constants.HF_HUB_CACHE}); hype never downloads at run "
        f"time: fetch it once with `hf download {repo}` (or set HF_HUB_CACHE to where it is)"
    )


def confine_to_entry(snap: Path, entry: Path) -> None:
    """Refuse a Hugging Face cache snapshot `snap` with an entry (at any depth) that resolves outside its
    cache entry `entry` (`models--org--name/`): a crafted link would read files hype was not given."""
    # Every entry at any depth: readers look into subfolders too (checkpoints/epoch_N.pt). Each folder is
    # walked once, by its real location, so a link to a folder is checked and a loop ends.
    root, seen, folders = entry.resolve(), set(), [snap]
    while folders:
        folder = folders.pop()
        if folder.resolve() in seen:
            continue
        seen.add(folder.resolve())
        for item in folder.iterdir():
            try:
                target = item.resolve()
            except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
                target = None
            if target is None or not target.is_relative_to(root):
                raise ModelFileError(
                    f"{item}: resolves to {target or 'a symlink loop'}, outside the Hugging Face cache entry "
                    f"{entry}; hype reads a cache entry's files only inside it. Pass a folder holding the "
                    "model's own files"
                )
            if target.is_dir():
                folders.append(item)


__all__ = ["OpenClipConfig", "OpenClipModel", "build_open_clip_model", "open_clip_state_dict"]
