"""`hype run WORKFLOW.yaml`: a declared chain of `hype` steps, resumable at any point."""

from __future__ import annotations

import click

from hype.cli import executor_choice


@click.command("run")
@click.argument("workflow", metavar="WORKFLOW")
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...")
@click.option("--until", "until", metavar="STEP", help="Stop after this step.")
@click.option(
    "--from", "start", metavar="STEP", help="Rerun from this step on (its output and later ones replaced)."
)
@click.option("--dry-run", is_flag=True, help="Print each step's state (done/changed/pending) and command.")
@click.option(
    "--executor",
    type=executor_choice(),
    default=None,
    help="Executor of the score steps [default: the workflow's].",
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
def run(
    workflow: str,
    overrides: tuple[str, ...],
    until: str | None,
    start: str | None,
    dry_run: bool,
    executor: str | None,
    progress: bool,
) -> None:
    """Run the steps of WORKFLOW (a YAML file, or a name in configs/workflows/: demo, datacomp-small,
    union-external) that are not done yet.

    Each step is a `hype` command (or a union / intersect of uid files, or a results table) writing to
    OUT/<step>; a step names its inputs by the step that makes them. A step is done when its marker
    (OUT/.hype/steps/<step>.json) holds the fingerprint of its command and inputs: a rerun skips it, and
    reruns a step whose settings changed, with every step that reads it. Kill it at any point and run it
    again: it goes on where it stopped, with the same outputs.

    \b
    Examples:
      hype run demo                                    # = hype demo
      hype run configs/workflows/demo.yaml out=runs/d2 size=4000 references=2000
      hype run my.yaml --dry-run                       # what is done, what would run
      hype run my.yaml steps.select-hype.args.frac=0.3 # it and the steps reading it rerun
      hype run my.yaml --until score                   # stop after the step named score
    """
    from hype.config import ConfigError
    from hype.io.runs import LockError
    from hype.workflow import StepError, WorkflowError, load_workflow

    try:
        wf = load_workflow(workflow, overrides)
        if dry_run:
            click.echo(wf.dry_run(start, until))
            return
        wf.run(start=start, until=until, executor=executor, progress=progress, echo=_echo)
    except (ConfigError, WorkflowError) as e:
        raise click.UsageError(str(e)) from None
    except (StepError, LockError) as e:
        raise click.ClickException(str(e)) from None


def _echo(text: str) -> None:
    click.echo(text)
