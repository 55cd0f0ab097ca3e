"""`hype synth`: generate the synthetic world."""

from __future__ import annotations

import json

import click

DEFAULT_BASE_URL = "http://127.0.0.1:8000"  # kept equal to hype.synth.DEFAULT_BASE_URL (checked in tests)


@click.command("synth")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder to create the world in.")
@click.option("--size", required=True, type=int, help="Number of samples in the noisy pool, e.g. 2000.")
@click.option("--seed", default=0, show_default=True, type=int, help="Everything is a function of the seed.")
@click.option(
    "--clean-size", type=int, default=None, help="Samples in the clean training set [default: --size]."
)
@click.option("--eval-size", default=500, show_default=True, type=int, help="Images per evaluation task.")
@click.option(
    "--reference-per-class",
    default=20,
    show_default=True,
    type=int,
    help="Images per class in the ImageNet-like reference set (eval/reference).",
)
@click.option("--shard-size", default=256, show_default=True, type=int, help="Samples per tar.")
@click.option(
    "--proxy-size",
    default=0,
    show_default=True,
    type=int,
    help="Images per task of the proxy task set DIR/proxy/ (eval's task families, other images, disjoint "
    "from eval/) that `hype fit --proxy` chooses weights on; 0: none. Adds it to an existing world.",
)
@click.option(
    "--noise",
    default=None,
    metavar="KIND=FRAC,...",
    help="Pool noise proportions, e.g. 'clean=0.6,misaligned=0.2' (unnamed kinds keep their defaults; "
    "normalised). Kinds: clean, misaligned, underspecified_text, underspecified_image, near_duplicate.",
)
@click.option(
    "--base-url",
    default=DEFAULT_BASE_URL,
    show_default=True,
    help="Prefix of the pool's image urls (<base-url>/images/<uid>.jpg). Serve DIR/pool at it, e.g. "
    "`python -m http.server 8000 --directory DIR/pool`; to serve on another port pass that url here.",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing world in --out.")
@click.option(
    "--workers", type=int, default=None, help="Rendering processes [default: CPU count, at most 8]."
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bar on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of text.")
def synth(
    out: str,
    size: int,
    seed: int,
    clean_size: int | None,
    eval_size: int,
    reference_per_class: int,
    shard_size: int,
    proxy_size: int,
    noise: str | None,
    base_url: str,
    overwrite: bool,
    workers: int | None,
    progress: bool,
    as_json: bool,
) -> None:
    """Generate the synthetic world: a clean training set, a noisy pool in img2dataset/DataComp layout,
    evaluation tasks in DataComp's layout, and the ground truth of every pool sample.

    \b
    Layout of DIR:
      clean/shards/{shard:08d}.tar|.parquet|_stats.json   clean training shards
      pool/shards/{shard:08d}.tar|.parquet|_stats.json    noisy pool (img2dataset output)
      pool/metadata/<hash>.parquet                        DataComp metadata (uid, url, text, ...)
      pool/images/<uid>.jpg                               raw images, serve DIR/pool over HTTP
      eval/wds_synth-<task>_test/                         7 tasks (CLIP_benchmark webdataset layout)
      eval/reference/                                     labelled ImageNet-like set
      proxy/wds_synth-<task>_test/                        with --proxy-size: the proxy task set
      truth.parquet, subsets/oracle_clean.npy, world.json
    """
    from hype.cli import lock_output
    from hype.synth import SynthError, make_world

    lock_output(out, "synth")
    if workers is not None and workers < 1:
        raise click.BadParameter(
            f"must be >= 1, got {workers}; use 1 to render in this process", param_hint="--workers"
        )
    try:
        summary = make_world(
            out,
            size,
            seed,
            clean_size=clean_size,
            eval_size=eval_size,
            reference_per_class=reference_per_class,
            shard_size=shard_size,
            noise=noise,
            base_url=base_url,
            overwrite=overwrite,
            progress=progress,
            workers=workers,
            proxy_size=proxy_size,
        )
    except SynthError as e:
        raise click.UsageError(str(e)) from None
    click.echo(json.dumps(summary, indent=2, sort_keys=True) if as_json else format_summary(summary))


def format_summary(s: dict) -> str:
    """The short human summary printed at the end of `hype synth`."""
    out, c, a = s["out"], s["counts"], s["args"]
    total = max(1, c["pool"])
    noise = ", ".join(f"{k} {v} ({100 * v / total:.0f}%)" for k, v in s["noise_counts"].items())
    tasks = ", ".join(t.split("/", 1)[-1] for t in s["eval_tasks"])
    rows = [
        ("pool", f"{c['pool']} samples in {c['pool_shards']} shards", f"{out}/pool/shards"),
        ("", noise, ""),
        ("", "metadata, raw images", f"{out}/pool/metadata, {out}/pool/images"),
        ("clean", f"{c['clean']} samples in {c['clean_shards']} shards", f"{out}/clean/shards"),
        ("eval", f"{len(s['eval_tasks'])} tasks x {c['eval_per_task']} images", f"{out}/eval ({tasks})"),
        ("reference", f"{c['reference']} images ({a['reference_per_class']}/class)", f"{out}/eval/reference"),
        ("truth", "per pool sample", f"{out}/truth.parquet (summary: {out}/world.json)"),
    ]
    if "proxy" in s:
        per_task = s["proxy"]["per_task"]
        rows.insert(6, ("proxy", f"{len(s['eval_tasks'])} tasks x {per_task} images", f"{out}/proxy"))
    width = max(len(r[1]) for r in rows if r[2])
    if s.get("skipped"):
        lines = [f"synthetic world (seed {s['seed']}) already in {out} with these settings: skipped"]
    else:
        lines = [f"synthetic world (seed {s['seed']}) written to {out} in {s['elapsed_s']:.1f} s"]
    lines += [f"  {k:<10} {v:<{width}}   {where}".rstrip() for k, v, where in rows]
    lines.append(
        f"  {'serve':<10} python -m http.server {_port(a['base_url'])} --directory {out}/pool"
        f"   (urls: {a['base_url']}/images/<uid>.jpg)"
    )
    return "\n".join(lines)


def _port(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return str(parts.port or (443 if parts.scheme == "https" else 80))
