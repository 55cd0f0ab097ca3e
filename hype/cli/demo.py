"""`hype demo`: the whole pipeline on the synthetic world, offline."""

from __future__ import annotations

import json
from pathlib import Path

import click

from hype.cli import executor_choice


@click.command("demo")
@click.option(
    "--out",
    default="runs/demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Folder for everything the demo makes; a rerun resumes it.",
)
@click.option("--size", default=2000, show_default=True, type=int, help="Samples in the noisy pool.")
@click.option(
    "--clean-size", default=2000, show_default=True, type=int, help="Clean samples for the scorers."
)
@click.option("--eval-size", default=500, show_default=True, type=int, help="Images per evaluation task.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the world and the trainings.")
@click.option(
    "--frac", default=0.2, show_default=True, type=float, help="Fraction of the pool each subset keeps."
)
@click.option(
    "--scorer-samples", default=6400, show_default=True, type=int, help="Samples seen by each scorer."
)
@click.option(
    "--subset-samples",
    default=4800,
    show_default=True,
    type=int,
    help="Samples seen by the tiny CLIP of each subset (the same for every subset).",
)
@click.option("--num-clusters", default=48, show_default=True, type=int, help="k-means clusters for c_IN.")
@click.option(
    "--executor",
    type=executor_choice(),
    default="ray",
    show_default=True,
    help="`hype score` executor (ray: a local Ray cluster).",
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON instead of the table.")
def demo(
    out: str,
    size: int,
    clean_size: int,
    eval_size: int,
    seed: int,
    frac: float,
    scorer_samples: int,
    subset_samples: int,
    num_clusters: int,
    executor: str,
    progress: bool,
    as_json: bool,
) -> None:
    """Run the whole pipeline offline on a synthetic world and print a results table.

    Generates a world, serves its pool on 127.0.0.1 and downloads it with `hype download`, trains tiny
    MERU and CLIP scorers, runs `hype score` (on a local Ray cluster), selects HYPE, CLIP-score and
    random subsets of the same size, trains a tiny CLIP on each at equal samples seen, evaluates them
    with `hype eval` and writes `hype report`. About 6-8 minutes on 2 CPU cores; every step is printed
    as the `hype` command it runs. The demo is the workflow configs/workflows/demo.yaml: `hype run demo`
    runs the same steps.
    """
    from hype.demo import DemoConfig, run_demo, summary_text
    from hype.io.runs import LockError
    from hype.workflow import StepError

    cfg = DemoConfig(
        out=Path(out), size=size, clean_size=clean_size, eval_size=eval_size, seed=seed, frac=frac,
        scorer_samples=scorer_samples, subset_samples=subset_samples, num_clusters=num_clusters,
        executor=executor, progress=progress,
    )  # fmt: skip
    try:
        result = run_demo(cfg)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    except (StepError, LockError) as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        click.echo(json.dumps({k: v for k, v in result.items() if k != "table"}, indent=2))
    else:
        click.echo("\nhype demo: results\n" + summary_text(result))
