"""open_clip models in and out: `hype convert open-clip` and `hype export --format open_clip`. DESIGN §6.

Import (`convert_open_clip`) reads any open_clip file or folder (`hype.models.open_clip_files`) and
writes hype's checkpoint. Export (`export_open_clip`) writes what open_clip and DataComp load:

- a CLIP (`geometry: clip`) becomes a Hugging Face style folder, `open_clip_config.json` (model and
  preprocess config) beside `open_clip_model.safetensors` (open_clip's `CLIP` key layout). open_clip
  loads it with `create_model_and_transforms("local-dir:OUT")`, or, when the architecture is one of its
  built-ins (hype's `clip-vit-b32` is `ViT-B-32`), with `create_model_and_transforms("ViT-B-32",
  pretrained="OUT/open_clip_model.safetensors")`, which is how DataComp's `evaluate.py --use_model`
  and its `eval_utils` load a model;
- every other geometry becomes an `open_clip_train` run folder in the EuCLIP fork's layout:
  `params.txt` (`model`, `geometry`, the entailment settings) and `checkpoints/epoch_latest.pt`
  (`{"epoch", "name", "state_dict"}`, tensors only, so `torch.load(weights_only=True)` reads it), plus the
  same `open_clip_config.json`. The fork's training and evaluation code (EIFY/open_clip, branch euclip)
  read this layout; stock open_clip cannot build a geometry other than the cosine one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hype.checkpoint import load_checkpoint, save_checkpoint
from hype.convert._common import prepare_output
from hype.io import atomic_path, write_json, write_text
from hype.io.weights import ModelFileError
from hype.models.open_clip_files import read_open_clip
from hype.models.open_clip_format import (
    builtin_name,
    open_clip_config,
    state_dict_to_open_clip,
)

HF_CONFIG = "open_clip_config.json"
HF_WEIGHTS = "open_clip_model.safetensors"
FORK_CHECKPOINT = "checkpoints/epoch_latest.pt"


@dataclass
class ImportReport:
    source: str
    output: str
    layout: str
    architecture: str
    architecture_from: str
    geometry: str
    geometry_from: str
    source_tensors: int
    parameters: int
    logit_scale: float
    ignored_top_level: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [
            f"Converted open_clip model {self.source} -> {self.output}",
            f"  layout         {self.layout}",
            f"  architecture   {self.architecture} (from {self.architecture_from})",
            f"  geometry       {self.geometry} (from {self.geometry_from})",
            f"  source         {self.source_tensors} tensors",
            f"  parameters     {self.parameters:,} ({self.parameters / 1e6:.1f}M)",
            f"  logit scale    {self.logit_scale:.6g}",
        ]
        if self.ignored_top_level:
            out.append(f"  not converted  top-level entries: {', '.join(self.ignored_top_level)}")
        return out


def convert_open_clip(
    source: str | Path,
    out: str | Path,
    *,
    arch: str | None = None,
    geometry: str | None = None,
    overwrite: bool = False,
) -> ImportReport:
    """Any open_clip model file or folder -> a hype checkpoint at `out`."""
    source, out = Path(source), Path(out)
    prepare_output(source, out, overwrite)
    imported = read_open_clip(source, arch=arch, geometry=geometry)
    model = imported.model
    report = ImportReport(
        source=str(source),
        output=str(out),
        layout=imported.layout,
        architecture=imported.arch,
        architecture_from=imported.arch_origin,
        geometry=model.config.geometry,
        geometry_from=imported.geometry_origin,
        source_tensors=imported.source_tensors,
        parameters=sum(p.numel() for p in model.parameters()),
        logit_scale=model.logit_scale.item(),
        ignored_top_level=imported.ignored_top_level,
    )
    provenance = {k: v for k, v in report.to_dict().items() if k not in ("output", "parameters")}
    save_checkpoint(out, model, extra={"converted_from": provenance})
    return report


@dataclass
class ExportReport:
    source: str
    output: str
    layout: str  # open_clip | euclip-fork
    architecture: str
    builtin: bool  # the architecture is one of open_clip's built-in names
    geometry: str
    files: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = [
            f"Exported {self.source} -> {self.output}/ ({self.layout} layout)",
            f"  architecture   {self.architecture}"
            + (" (an open_clip built-in)" if self.builtin else " (described by open_clip_config.json)"),
            f"  geometry       {self.geometry}",
            f"  files          {', '.join(self.files)}",
            "  load it with",
        ]
        out += [f"    {line}" for line in self.usage()]
        return out

    def usage(self) -> list[str]:
        folder = self.output
        if self.layout != "open_clip":
            return [
                f"the EuCLIP fork (EIFY/open_clip, euclip): a run folder, geometry in {folder}/params.txt",
                f"hype: hype convert open-clip {folder} --out model.safetensors",
            ]
        lines = [f'open_clip.create_model_and_transforms("local-dir:{folder}")']
        if self.builtin:
            weights = f"{folder}/{HF_WEIGHTS}"
            lines += [
                f'open_clip.create_model_and_transforms("{self.architecture}", pretrained="{weights}")',
                f'DataComp: python evaluate.py --use_model "{self.architecture} {weights}" '
                "--train_output_dir EVAL_DIR",
            ]
        return lines


def export_open_clip(model_path: str | Path, out: str | Path, *, overwrite: bool = False) -> ExportReport:
    """A hype checkpoint -> an open_clip folder (CLIP) or an EuCLIP-fork run folder (other geometries)."""
    model_path, out = Path(model_path), Path(out)
    model = load_checkpoint(model_path)
    cfg = model.config
    oc = open_clip_config(cfg)
    name = builtin_name(oc["model_cfg"])
    arch = name or cfg.name
    _check_output_folder(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / HF_CONFIG, {**oc, "hype": {"model_config": cfg.name, "geometry": cfg.geometry}})
    sd = state_dict_to_open_clip(model)
    if cfg.geometry == "clip":
        from safetensors.torch import save_file

        with atomic_path(out / HF_WEIGHTS) as tmp:
            save_file(sd, str(tmp), metadata={"format": "pt"})
        files, layout = [HF_CONFIG, HF_WEIGHTS], "open_clip"
    else:
        ckpt = out / FORK_CHECKPOINT
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(ckpt) as tmp:
            torch.save({"epoch": 0, "name": arch, "state_dict": sd}, tmp)
        write_text(out / "params.txt", _params_txt(arch, cfg))
        files, layout = [HF_CONFIG, "params.txt", FORK_CHECKPOINT], "euclip-fork"
    return ExportReport(
        source=str(model_path),
        output=str(out),
        layout=layout,
        architecture=arch,
        builtin=name is not None,
        geometry=cfg.geometry,
        files=files,
    )


def _params_txt(arch: str, cfg) -> str:
    # open_clip_train's params.txt: `name: value` lines, sorted; the fork's evaluation reads `geometry`.
    params = {"model": arch, "geometry": cfg.geometry, "force_quick_gelu": bool(cfg.quick_gelu)}
    if cfg.loss.entailment_weight:
        params["entailment_weight"] = cfg.loss.entailment_weight
        params["min_radius"] = cfg.loss.entailment_K
    s = cfg.scalars
    if s.curv_init is not None:
        params["curvature_init"] = s.curv_init
    params["logit_scale_init"] = math.log(s.logit_scale_init)
    return "".join(f"{k}: {params[k]}\n" for k in sorted(params))


def _check_output_folder(out: Path, overwrite: bool) -> None:
    if out.is_file():
        raise ModelFileError(f"{out}: is a file; the export writes a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ModelFileError(f"{out}: exists and is not empty; pass --overwrite to replace its files")


__all__ = ["ExportReport", "ImportReport", "convert_open_clip", "export_open_clip"]
