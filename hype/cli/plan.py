"""`hype plan`: what `hype score` with the same arguments will cost (time, device-hours, output bytes,
bucket requests), from a short probe on the actual device and models. `hype score --dry-run` prints it too."""

from __future__ import annotations

import click

from hype.cli.score import print_plan, score, score_config


def _plan(config, overrides, as_json, probe_samples, count_tars, **options) -> None:
    from hype.scoring.decode import share_cores_with_decoders

    # before score_config: it imports torch, and OpenMP reads its wait policy when torch loads it; a
    # probe with spinning threads ran ~2x slower per sample than the run it planned
    share_cores_with_decoders()
    cfg = score_config(config, overrides, **options)
    print_plan(cfg, as_json=as_json, probe_samples=probe_samples, count_tars=count_tars)


_SKIP = ("progress", "dry_run", "as_json")
plan = click.Command(
    "plan",
    callback=_plan,
    context_settings={"help_option_names": ["-h", "--help"]},
    params=[
        *(p for p in score.params if p.name not in _SKIP),
        click.Option(
            ["--probe-samples"],
            type=click.IntRange(1),
            help="Samples the probe scores (the first ones of the pool) [default: 1024].",
        ),
        click.Option(
            ["--count-tars"],
            is_flag=True,
            help="Count each tar's samples from its headers (reads every tar) instead of img2dataset's "
            "<shard>_stats.json.",
        ),
        click.Option(["--json", "as_json"], is_flag=True, help="Print the plan as JSON."),
    ],
    help="""Estimate a `hype score` run before it runs: wall time, device-hours, output bytes and bucket
    requests (GET/PUT/LIST of a fresh run), per stage.

    \b
    Takes `hype score`'s arguments. The pool's size comes from its shards' img2dataset _stats.json (or
    their tar headers with --count-tars, or --metadata's parquet rows); a probe then scores the first
    --probe-samples samples with the same models, device and executor in a temporary folder (deleted
    after; --out is only read to count its requests) and each stage is extrapolated with its scaling:
    samples (embed, captions, merge), samples x N / x M (reference candidates / specificity), K x points
    (k-means), samples x K (cluster assignment); model loads and Ray's start are fixed costs. A per-shard
    stage's shard times are fitted as a + b x samples over probe shards of two sizes by medians (one
    shard caught in a slow moment barely moves it); the L_e kernel of the reference and specificity
    stages is timed at the probe's and the run's N and M (a + b x M). The estimate holds for the load
    the probe saw: on a shared machine, --json records the load average at the probe's start and end.

    \b
    Example:
      hype plan --pool pool/shards --meru meru.safetensors --clip clip.safetensors \\
          --class-images world/eval/reference/train --config tiny --out runs/score
    """,
)
