"""`hype train`: train a contrastive model (MERU, CLIP, EuCLIP, oblique) on webdataset shards."""

from __future__ import annotations

import json
import os
import sys

import click

EXIT_INTERRUPTED = 3


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _clean(e: BaseException) -> str:
    # Errors raised in DataLoader workers come back wrapped with the worker's traceback; keep the message.
    msg = str(e)
    marker = "DataError: "
    return msg.rsplit(marker, 1)[-1].strip() if marker in msg else msg


def sampler_overrides(spec: str) -> list[str]:
    """`softcap:scores=RUN,cap=8` -> the overrides `sampler.kind=softcap`, `sampler.scores=RUN`, ..."""
    kind, _, rest = spec.partition(":")
    items = [p.strip() for p in rest.split(",") if p.strip()]
    bad = [p for p in items if "=" not in p]
    if bad:
        raise click.UsageError(
            f"--sampler {spec!r}: {bad[0]!r} is not KEY=VALUE; e.g. softcap:scores=RUN,cap=8"
        )
    return [f"sampler.kind={kind.strip()}", *(f"sampler.{p}" for p in items)]


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config",
    metavar="NAME|PATH",
    help="Training preset (configs/train/NAME.yaml, see --list) or a YAML file.",
)
@click.option(
    "--data",
    metavar="DIR_OR_PATTERN",
    help="Webdataset shards: a folder of .tar, 'dir/{00000000..00000127}.tar' or a glob; join several "
    "with '::'. Any of them may be a URL (s3://...): the tars are streamed.",
)
@click.option(
    "--subset",
    type=click.Path(dir_okay=False),
    help="DataComp subset file (.npy or raw memmap): train only on these uids.",
)
@click.option(
    "--sampler",
    metavar="softcap:scores=RUN_DIR[,KEY=VALUE...]",
    help="How samples are drawn (default: stream, every sample of --data / --subset alike): softcap draws "
    "samples_seen samples by their scores, FLYT's soft-cap sampling; keys column, temperature, penalty, "
    "cap, round (README 'Soft-cap sampling'). Same as the overrides sampler.kind=softcap sampler.KEY=VALUE.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    help="Output folder [default: runs/train/<preset name>]. A URL works too: checkpoints are uploaded "
    "whole once written (the state file last) and metrics.jsonl with each checkpoint; resuming reads "
    "the latest checkpoint from there.",
)
@click.option(
    "--resume",
    default="auto",
    show_default=True,
    metavar="auto|never|PATH",
    help="auto: continue the run in --out if it has a checkpoint; never: refuse to touch an existing run; "
    "or a run folder / step-*.state.pt to continue from.",
)
@click.option(
    "--init",
    metavar="CKPT",
    help="Start from these weights: a hype checkpoint or an open_clip model (file or folder) with the "
    "model config's architecture, e.g. --config datacomp-small --init ViT-B-32-weights/.",
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text.")
@click.option("--list", "list_presets", is_flag=True, help="List the training presets and exit.")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
def train(
    config: str | None,
    data: str | None,
    subset: str | None,
    sampler: str | None,
    out: str | None,
    resume: str,
    init: str | None,
    progress: bool,
    as_json: bool,
    list_presets: bool,
    overrides: tuple[str, ...],
) -> None:
    """Train a contrastive image-text model for a fixed number of samples seen (DataComp semantics).

    \b
    Examples:
      hype train --config tiny-hyperbolic --data world/clean/shards
      hype train --config datacomp-small --data pool/shards --subset hype_top20.npy --out runs/small
      hype train --config datacomp-small --data pool/shards --subset hype_top20.npy \\
          --sampler softcap:scores=runs/score,temperature=2,cap=10
      hype train --config meru-vit-b16 --data 'redcaps/{00000000..00001023}.tar' \\
          data.caption_template='{subreddit} : {caption}' optim.lr=5e-4
      torchrun --nproc_per_node 8 -m hype.train --config datacomp-medium --data ...

    KEY=VALUE overrides any config field (optim.lr=1e-3, batch_size=512, precision=bf16,
    model.vision.layers=2, ...). Outputs in --out: checkpoints/step-*.safetensors (+ .state.pt),
    model.safetensors (final weights), metrics.jsonl, summary.json, config.yaml.
    """
    if list_presets:
        # Only YAML files: hype.train.config imports the models (torch, open_clip: 5-7 s before a line).
        from hype.config import list_presets as presets
        from hype.config import read_yaml, resolve_preset

        for name in presets("train"):
            desc = read_yaml(resolve_preset("train", name, "training")).get("description", "")
            click.echo(f"{name:<28} {desc}")
        return
    from hype.train.config import load_train_config

    if config is None:
        raise click.UsageError("--config NAME|PATH is required (see `hype train --list` for presets)")

    from hype.cli import lock_output
    from hype.config import ConfigError
    from hype.data.errors import SelectError
    from hype.data.pipeline import DataError
    from hype.data.shards import ShardError
    from hype.data.subset_index import SubsetError
    from hype.data.uids import UidError
    from hype.train import InitError, ResumeError, TrainingDiverged, format_summary
    from hype.train import train as run_training

    extra = list(overrides) if sampler is None else [*sampler_overrides(sampler), *overrides]
    for key, value in (("data.train", data), ("data.subset", subset), ("out", out), ("init", init)):
        if value is not None:
            extra.append(f"{key}={json.dumps(value)}")  # JSON strings are YAML strings: paths stay strings
    try:
        cfg = load_train_config(config, extra)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if cfg.data.train is None:
        raise click.UsageError(
            "no training data: pass --data DIR_OR_PATTERN (or set data.train in the config)"
        )
    if _rank() == 0:  # one lock per run: rank 0 holds it for every rank of a distributed run
        lock_output(cfg.out, "train")

    try:
        summary = run_training(cfg, resume=resume, progress=progress)
    except TrainingDiverged as e:
        raise click.ClickException(f"training diverged: {e}") from None
    except (ConfigError, ShardError, SelectError, SubsetError, UidError, ResumeError, InitError) as e:
        raise click.ClickException(str(e)) from None
    except DataError as e:
        raise click.ClickException(_clean(e)) from None
    except RuntimeError as e:
        if "DataError" in str(e):
            raise click.ClickException(_clean(e)) from None
        raise
    if _rank() == 0:
        click.echo(json.dumps(summary, indent=2, sort_keys=True) if as_json else format_summary(summary))
    if summary["status"] == "interrupted":
        sys.exit(EXIT_INTERRUPTED)  # not finished: let job scripts (and requeue logic) see it
