"""`hype convert meru|hype-release CKPT --out OUT.safetensors`: released checkpoints -> hype's format."""

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


@convert.command("meru")
@_common
@click.option(
    "--model-config",
    default=None,
    metavar="NAME|PATH",
    help="meru-vit-s16, meru-vit-b16, meru-vit-l16 or a YAML config [default: inferred from the ViT's "
    "width, depth and patch size].",
)
def meru(ckpt: str, out: str, ignore_keys: tuple[str, ...], overwrite: bool, as_json: bool, model_config):
    """MERU's released checkpoint (meru_vit_{s,b,l}.pth, facebookresearch/meru) -> OUT."""
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
