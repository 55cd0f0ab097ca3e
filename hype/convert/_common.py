"""What both converters share: safe loading, key/shape checking, scalar read-out, writing. DESIGN §3.

A converter describes the released layout as a list of `Rule`s (one source key -> one target key of a
`ContrastiveModel`, with a simple layout change), plus keys that are only validated (buffers such as
MERU's causal mask). `map_state_dict` then applies them and refuses anything partial: every source key
must be consumed (or explicitly ignored), every target key filled, and every shape must agree.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hype.checkpoint import save_checkpoint
from hype.io.weights import ModelFileError, listing
from hype.models import ContrastiveModel, ModelConfig, create_model
from hype.models.config import fit_scalar_bounds

Tensor = torch.Tensor

# A released checkpoint that cannot be converted (raised by the loaders in `hype.io.weights` too).
ConversionError = ModelFileError


# --- mapping ------------------------------------------------------------------------------------

LAYOUTS = ("same", "transpose", "squeeze")


@dataclass(frozen=True)
class Rule:
    """One source tensor -> one target tensor.

    layout: `same` (copied), `transpose` (a torch Linear weight (out, in) -> open_clip's `x @ proj`
    matrix (in, out)) or `squeeze` (`lead` leading singleton dims dropped, e.g. timm's (1, 1, D) class
    token -> open_clip's (D,)).
    """

    source: str
    target: str
    layout: str = "same"
    lead: int = 0

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; one of {', '.join(LAYOUTS)}")

    def source_shape(self, target_shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.layout == "transpose":
            return tuple(reversed(target_shape))
        if self.layout == "squeeze":
            return (1,) * self.lead + tuple(target_shape)
        return tuple(target_shape)

    def apply(self, t: Tensor) -> Tensor:
        if self.layout == "transpose":
            return t.t().contiguous()
        if self.layout == "squeeze":
            return t.reshape(t.shape[self.lead :])
        return t


# A validator of a buffer that has no target (e.g. a causal mask): returns a problem or None.
Check = Callable[[Tensor], "str | None"]


def map_state_dict(
    sd: Mapping[str, Tensor],
    rules: list[Rule],
    target_shapes: Mapping[str, tuple[int, ...]],
    *,
    source: str,
    what: str,
    checks: Mapping[str, Check] | None = None,
    ignore: Iterable[str] = (),
) -> tuple[dict[str, Tensor], list[str]]:
    """Apply `rules`; return (target state dict, source keys ignored by the `ignore` glob patterns).

    Raises one `ConversionError` listing every problem at once: missing and unexpected source keys,
    wrong shapes (source key, its shape and the expected one) and target keys nothing fills.
    """
    checks = dict(checks or {})
    patterns = list(ignore)
    consumed = {r.source for r in rules} | set(checks)
    missing = [r.source for r in rules if r.source not in sd]
    leftover = [k for k in sd if k not in consumed]
    ignored = [k for k in leftover if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
    unexpected = [k for k in leftover if k not in ignored]
    no_target = [f"{r.source} -> {r.target}" for r in rules if r.target not in target_shapes]
    targets = {r.target for r in rules}
    unfilled = [k for k in target_shapes if k not in targets]

    problems: list[str] = []
    out: dict[str, Tensor] = {}
    for r in rules:
        if r.source not in sd or r.target not in target_shapes:
            continue
        t = sd[r.source]
        want = r.source_shape(tuple(target_shapes[r.target]))
        if tuple(t.shape) != want:
            problems.append(f"{r.source} has shape {_shape(t.shape)}, expected {_shape(want)}")
        elif not t.is_floating_point():
            problems.append(f"{r.source} has dtype {t.dtype}, expected a floating-point tensor")
        else:
            out[r.target] = r.apply(t)
    for key, check in checks.items():
        if key in sd:
            problem = check(sd[key])
            if problem:
                problems.append(f"{key} {problem}")

    sections = [
        ("missing keys", missing),
        ("unexpected keys", unexpected),
        ("wrong shapes or values", problems),
        ("keys the model config has no parameter for", no_target),
        ("model parameters nothing in the checkpoint fills", unfilled),
    ]
    found = [(title, items) for title, items in sections if items]
    if found:
        body = "\n".join(f"  {title} ({len(items)}): {listing(items)}" for title, items in found)
        hints = []
        if unexpected:
            hints.append(
                "if the unexpected keys are safe to drop (e.g. training state), pass --ignore-key PATTERN "
                "(a glob, repeatable)"
            )
        if missing or problems or no_target or unfilled:
            hints.append(
                f"check that the file is a checkpoint of {what} and that the model config describes it "
                "(--model-config NAME or a YAML path)"
            )
        raise ConversionError(
            f"{source}: the state dict does not match the layout of {what}:\n{body}\nFix: " + "; ".join(hints)
        )
    return out, ignored


def causal_mask_check(context_length: int) -> Check:
    """Validator of a stored text attention mask: must be the causal (upper-triangular) mask.

    MERU stores a bool mask (True = blocked), OpenAI/OpenCLIP code a float one (-inf = blocked).
    open_clip's text tower builds the causal mask itself, so a stored one is only verified.
    """

    def check(t: Tensor) -> str | None:
        n = context_length
        if tuple(t.shape) != (n, n):
            return f"has shape {_shape(t.shape)}, expected {_shape((n, n))} (the causal text mask)"
        blocked = t if t.dtype == torch.bool else torch.isinf(t) & (t < 0)
        if not torch.equal(blocked.cpu(), torch.ones(n, n, dtype=torch.bool).triu(1)):
            return "is not the causal text mask; a text tower with another mask cannot be converted"
        return None

    return check


_OTHER_LAYOUTS = {
    "hype": "It is already a hype checkpoint: load it with hype.checkpoint.load_checkpoint",
    "meru": "It looks like a MERU checkpoint: use `hype convert meru`",
    "hype-release": "It looks like HYPE's release: use `hype convert hype-release`",
}


def other_layout_hint(sd: Mapping[str, Tensor], expected: str) -> str:
    """' <hint>.' when `sd` is recognizably another known layout than `expected`, else ''."""
    if "log_curv" in sd or "log_logit_scale" in sd:
        guess = "hype"
    elif "curv" in sd or "visual.patch_embed.proj.weight" in sd:
        guess = "meru"
    elif "curvature" in sd or "token_embedding.weight" in sd:
        guess = "hype-release"
    else:
        return ""
    return "" if guess == expected else f" {_OTHER_LAYOUTS[guess]}."


def count_blocks(sd: Mapping[str, Tensor], prefix: str) -> int:
    """Number of transformer blocks `<prefix><i>.` (0..n-1) present in the state dict."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {int(m.group(1)) for k in sd if (m := pattern.match(k))}
    return max(found) + 1 if found else 0


def architecture_mismatches(found: Mapping[str, Any], config: ModelConfig) -> list[str]:
    """Entries of `found` (dotted config keys -> values read from the state dict) the config disagrees
    with; `vision.num_positions` stands for grid² + 1."""
    problems = []
    for key, value in found.items():
        expected = _config_value(config, key)
        if value is not None and value != expected:
            problems.append(f"{key} = {value} in the checkpoint, {expected} in the config")
    return problems


def _config_value(config: ModelConfig, key: str) -> Any:
    if key == "vision.num_positions":
        return config.vision.grid_size**2 + 1
    obj: Any = config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of every persistent tensor of the model `config` builds (on the meta device: no memory)."""
    model = create_model(config, device="meta")
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_hyperbolic(config: ModelConfig, source: str) -> None:
    if config.geometry != "hyperbolic":
        raise ConversionError(
            f"{source}: model config {config.name!r} has geometry {config.geometry!r}; released MERU/HYPE "
            "models are hyperbolic (curvature and α scalars); pick a hyperbolic config"
        )


# --- building and writing ----------------------------------------------------------------------


@dataclass
class ConversionReport:
    """What a conversion did; `lines()` is the human summary, `to_dict()` the machine-readable one."""

    kind: str
    source: str
    output: str
    model_config: str
    config_origin: str
    source_tensors: int
    parameters: int
    source_dtypes: list[str]
    scalars: dict[str, float]
    stored_scalars: dict[str, float]
    ignored_top_level: list[str] = field(default_factory=list)
    ignored_keys: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        s = self.scalars
        out = [
            f"Converted {self.kind} checkpoint {self.source} -> {self.output}",
            f"  model config   {self.model_config} ({self.config_origin})",
            f"  source         {self.source_tensors} tensors ({', '.join(self.source_dtypes)})",
            f"  parameters     {self.parameters:,} ({self.parameters / 1e6:.1f}M)",
        ]
        if "curvature" in s:  # hyperbolic models; a cosine model has its logit scale only
            out.append(f"  curvature      {s['curvature']:.6g}")
            out.append(f"  alpha          image {s['alpha_img']:.6g}, text {s['alpha_txt']:.6g}")
        out.append(f"  logit scale    {s['logit_scale']:.6g} (temperature {1.0 / s['logit_scale']:.6g})")
        if self.ignored_top_level:
            out.append(f"  not converted  top-level entries: {', '.join(self.ignored_top_level)}")
        if self.ignored_keys:
            out.append(f"  ignored keys   {listing(self.ignored_keys)}")
        out += [f"  note           {n}" for n in self.notes]
        return out


def build_model(config: ModelConfig, mapped: Mapping[str, Tensor]) -> tuple[ContrastiveModel, list[str]]:
    """A CPU fp32 model holding exactly the mapped tensors (strict: every key, every shape), and notes.

    Stored scalars outside the config's clamps are kept: the config's bounds are widened to them
    (`fit_scalar_bounds`), so the model computes what the released code computes with them."""
    config, notes = fit_scalar_bounds(config, mapped)
    model = create_model(config)
    model.load_state_dict(dict(mapped), strict=True)  # copies and casts fp16/bf16 sources to fp32
    return model.eval(), notes


SCALARS = {  # report name -> (model log-parameter, model property)
    "curvature": ("log_curv", "curv"),
    "alpha_img": ("log_alpha_img", "alpha_img"),
    "alpha_txt": ("log_alpha_txt", "alpha_txt"),
    "logit_scale": ("log_logit_scale", "logit_scale"),
}


def read_scalars(model: ContrastiveModel) -> tuple[dict[str, float], dict[str, float]]:
    """(values the model uses, values stored in its parameters): equal for a model from `build_model`."""
    effective, stored = {}, {}
    with torch.no_grad():
        for name, (param, prop) in SCALARS.items():
            if getattr(model, param, None) is None:  # a cosine model has no curvature or α
                continue
            stored[name] = math.exp(float(getattr(model, param)))
            effective[name] = float(getattr(model, prop))
    return effective, stored


def prepare_output(source: Path, out: Path, overwrite: bool) -> None:
    if out.resolve() == source.resolve():
        raise ConversionError(
            f"{out}: the output would overwrite the source checkpoint; choose another --out"
        )
    if out.exists() and not overwrite:
        raise ConversionError(f"{out}: already exists; pass --overwrite to replace it")
    if out.exists() and out.is_dir():
        raise ConversionError(f"{out}: is a directory; --out needs a file name like model.safetensors")


def write(model: ContrastiveModel, out: Path, report: ConversionReport) -> None:
    """Atomic (temp file + rename, via `save_checkpoint`), with the provenance in the metadata."""
    provenance = {
        k: v for k, v in report.to_dict().items() if k not in ("output", "parameters", "scalars", "notes")
    }
    save_checkpoint(out, model, extra={"converted_from": json.loads(json.dumps(provenance))})


def finish(
    kind: str,
    ckpt: Path,
    out: Path,
    model: ContrastiveModel,
    sd: Mapping[str, Tensor],
    top_level: list[str],
    details: Mapping[str, Any],
) -> ConversionReport:
    """Read the scalars, build the report, write the checkpoint; return the report."""
    effective, stored = read_scalars(model)
    report = ConversionReport(
        kind=kind,
        source=str(ckpt),
        output=str(out),
        model_config=model.config.name,
        config_origin=str(details["config_origin"]),
        source_tensors=len(sd),
        parameters=sum(p.numel() for p in model.parameters()),
        source_dtypes=source_dtypes(sd),
        scalars=effective,
        stored_scalars=stored,
        ignored_top_level=list(top_level),
        ignored_keys=list(details["ignored_keys"]),
        notes=list(details["notes"]),
    )
    write(model, out, report)
    return report


def source_dtypes(sd: Mapping[str, Tensor]) -> list[str]:
    return sorted({str(t.dtype).removeprefix("torch.") for t in sd.values()})


def _shape(shape: Iterable[int]) -> str:
    dims = tuple(int(s) for s in shape)
    return "(" + ", ".join(map(str, dims)) + ("," if len(dims) == 1 else "") + ")"
