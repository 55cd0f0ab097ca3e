"""`hype export MODEL OUT --format open_clip`: hand a model to open_clip, DataComp and the EuCLIP fork."""

from __future__ import annotations

import json

import click


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model", type=click.Path(exists=True, dir_okay=False))
@click.argument("out", type=click.Path(dir_okay=True, file_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["open_clip"]),
    default="open_clip",
    show_default=True,
    help="open_clip: a CLIP becomes open_clip_config.json + open_clip_model.safetensors; other "
    "geometries become an EuCLIP-fork run folder (params.txt + checkpoints/epoch_latest.pt).",
)
@click.option("--overwrite", is_flag=True, help="Replace the files of a non-empty OUT.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text.")
def export(model: str, out: str, fmt: str, overwrite: bool, as_json: bool) -> None:
    """Write the hype checkpoint MODEL as an open_clip model in folder OUT.

    \b
    hype export runs/train/clip/final.safetensors exported/
    python -c 'import open_clip; open_clip.create_model_and_transforms("local-dir:exported")'
    """
    from hype.cli import lock_output

    lock_output(out, "export", option="OUT")  # before the imports (torch, open_clip): a refusal is instant
    from hype.convert.open_clip import export_open_clip

    try:
        report = export_open_clip(model, out, overwrite=overwrite)
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(report.to_dict(), sort_keys=True) if as_json else "\n".join(report.lines()))
