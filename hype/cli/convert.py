"""`hype convert meru|hycoclip|hype-release|open-clip SRC --out OUT.safetensors`: models -> hype."""

from __future__ import annotations

import json
from collections.abc import Callable

import click

_COMMON = [
    click.argument("ckpt", type=click.Path(dir_okay=False)),
    click.option(
        "--out",
        required=True,
        type=click.Path(dir_okay=False),
        help="Output checkpoint, e.g. meru_vit_l.safetensors (written atomically).",
    ),
    click.option(
        "--ignore-key",
        "ignore_keys",
        multiple=True,
        metavar="PATTERN",
        help="Drop unexpected source keys matching this glob (repeatable); every other key must map.",
    ),
    click.option("--overwrite", is_flag=True, help="Replace an existing --out file."),
    click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text."),
]


def _common(f: Callable) -> Callable:
    for decorator in reversed(_COMMON):
        f = decorator(f)
    return f


def _lock(out: str) -> None:
    """Take --out's lock before importing a converter (torch, open_clip: seconds): a refusal is instant."""
    from hype.cli import lock_output

    lock_output(out, "convert")


def _run(convert_fn: Callable, ckpt: str, out: str, as_json: bool, **kwargs) -> None:
    try:
        report = convert_fn(ckpt, out, **kwargs)
    except (ValueError, FileNotFoundError) as e:
        # ConversionError, ConfigError and an unknown --model-config name: all name the file and the fix.
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(report.to_dict(), sort_keys=True))
    else:
        click.echo("\n".join(report.lines()))


@click.group("convert")
def convert() -> None:
    """Convert released MERU / HYPE checkpoints into hype's safetensors format.

    Released .pt/.pth files are opened with torch.load(weights_only=True): a file holding pickled code
    is refused, never executed. The result loads with `hype.checkpoint.load_checkpoint`.
    """


_MERU_MODEL_CONFIG = click.option(
    "--model-config",
    default=None,
    metavar="NAME|PATH",
    help="meru-vit-{s,b,l}16 (meru-clip-vit-{s,b,l}16 for a CLIP baseline) or a YAML config [default: "
    "inferred from the ViT's width, depth and patch size, and from the curvature's presence].",
)


@convert.command("meru")
@_common
@_MERU_MODEL_CONFIG
def meru(ckpt: str, out: str, ignore_keys: tuple[str, ...], overwrite: bool, as_json: bool, model_config):
    """MERU's released checkpoint (meru_vit_{s,b,l}.pth or the CLIP baseline clip_vit_{s,b,l}.pth,
    facebookresearch/meru) -> OUT."""
    _lock(out)
    from hype.convert import convert_meru

    _run(
        convert_meru,
        ckpt,
        out,
        as_json,
        model_config=model_config,
        ignore_keys=ignore_keys,
        overwrite=overwrite,
    )


@convert.command("hycoclip")
@_common
@_MERU_MODEL_CONFIG
def hycoclip(ckpt: str, out: str, ignore_keys: tuple[str, ...], overwrite: bool, as_json: bool, model_config):
    """HyCoCLIP's released checkpoints (hycoclip_vit_{s,b}.pth and its baselines meru_vit_{s,b}.pth,
    clip_vit_{s,b}.pth, PalAvik/hycoclip) -> OUT. HyCoCLIP's model is MERU's (the same modules and
    scalars; only its training differs), so this is `hype convert meru` under the release's name."""
    meru.callback(ckpt, out, ignore_keys, overwrite, as_json, model_config)


@convert.command("hype-release")
@_common
@click.option(
    "--model-config",
    default=None,
    metavar="NAME|PATH",
    help="Model config [default: hype-meru-vit-l14].",
)
def hype_release(
    ckpt: str, out: str, ignore_keys: tuple[str, ...], overwrite: bool, as_json: bool, model_config
):
    """HYPE's released hyperbolic CLIP ViT-L/14 (ckpt.pt, naver-ai/hype) -> OUT."""
    _lock(out)
    from hype.convert import convert_hype_release

    _run(
        convert_hype_release,
        ckpt,
        out,
        as_json,
        model_config=model_config,
        ignore_keys=ignore_keys,
        overwrite=overwrite,
    )


@convert.command("open-clip")
@click.argument("source", type=click.Path(exists=True))
@click.option(
    "--out",
    required=True,
    type=click.Path(dir_okay=False),
    help="Output checkpoint, e.g. clip_l14.safetensors (written atomically).",
)
@click.option(
    "--arch",
    default=None,
    metavar="NAME",
    help="open_clip architecture (ViT-B-32, ViT-L-14, ...) [default: from open_clip_config.json, the "
    "run's params.txt, or the shapes of an OpenAI release; a bare state dict needs it].",
)
@click.option(
    "--geometry",
    default=None,
    metavar="NAME",
    help="EuCLIP fork models: the geometry [default: params.txt's, else clip].",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text.")
def open_clip_cmd(
    source: str, out: str, arch: str | None, geometry: str | None, overwrite: bool, as_json: bool
) -> None:
    """An open_clip model you have -> OUT: a state dict (.bin/.pt/.safetensors, with or without a
    'state_dict' wrapper or DDP 'module.' prefix), an open_clip_train epoch_N.pt, a Hugging Face folder
    (open_clip_config.json + open_clip_model.safetensors), OpenAI's ViT-*.pt release, or an EuCLIP fork
    run. Embeddings equal open_clip's own model's; preprocessing and tokenizer follow the model's config.

    \b
    hype convert open-clip ~/.cache/clip/ViT-L-14.pt --out clip_l14.safetensors
    hype convert open-clip logs/run/checkpoints/epoch_8.pt --out mine.safetensors
    hype convert open-clip weights.safetensors --arch ViT-B-32 --out b32.safetensors
    """
    _lock(out)
    from hype.convert.open_clip import convert_open_clip

    _run(convert_open_clip, source, out, as_json, arch=arch, geometry=geometry, overwrite=overwrite)
