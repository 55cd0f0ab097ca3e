"""The `hype` command line.

Subcommands live in their own modules under `hype.cli` and are imported only when invoked, so that
`hype --help` answers instantly instead of importing torch.
"""

from __future__ import annotations

import importlib
import os

import click

import hype.pipelines  # noqa: F401 - registers the bundled executors; hype.cli composes the layers
from hype import __version__

# name -> (module, attribute, one-line help shown by `hype --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "synth": ("hype.cli.synth", "synth", "Generate the synthetic world: clean set, noisy pool, eval tasks."),
    "train": (
        "hype.cli.train",
        "train",
        "Train a contrastive model (MERU, CLIP, EuCLIP, oblique) on shards.",
    ),
    "eval": ("hype.cli.eval", "eval_cmd", "Run the DataComp zero-shot benchmark (or the synthetic one)."),
    "convert": (
        "hype.cli.convert",
        "convert",
        "Convert MERU / HYPE releases and open_clip models to hype's format.",
    ),
    "export": ("hype.cli.export", "export", "Write a hype model as an open_clip (or EuCLIP fork) model."),
    "score": ("hype.cli.score", "score", "Score a pool: ε_i, ε_t, −d_L, cos θ and c_IN for every sample."),
    "plan": (
        "hype.cli.plan",
        "plan",
        "Estimate a score run: time, device-hours, output bytes, bucket requests (a short probe).",
    ),
    "select": (
        "hype.cli.select",
        "select",
        "Select a subset from a scores table (HYPE, ablations, filters).",
    ),
    "fit": (
        "hype.cli.fit",
        "fit",
        "Fit weights over score columns to a small labelled sample (cross-validated).",
    ),
    "explain": (
        "hype.cli.explain",
        "explain",
        "Why a sample was kept or dropped: per-term contributions and the decisive term.",
    ),
    "reshard": (
        "hype.cli.reshard",
        "reshard",
        "Write training shards for a subset (DataComp resharder layout).",
    ),
    "verify": (
        "hype.cli.verify",
        "verify",
        "Check a run's score card: recompute its sampled scores from the pool.",
    ),
    "report": ("hype.cli.report", "report", "Write an HTML report of a scored pool and a subset."),
    "submit": ("hype.cli.submit", "submit", "Assemble and validate a DataComp submission folder."),
    "download": (
        "hype.cli.download",
        "download",
        "Download a pool from its metadata (img2dataset, DataComp settings).",
    ),
    "run": (
        "hype.cli.run",
        "run",
        "Run a workflow file: a declared chain of steps, resumable at any point.",
    ),
    "demo": (
        "hype.cli.demo",
        "demo",
        "The whole pipeline on a synthetic world, offline, with a results table.",
    ),
}


class _ExecutorChoice(click.Choice):
    """The executors registered in `hype.executor.EXECUTORS` (bundled or installed plug-ins), read when an
    option is parsed or shown, never a list of its own."""

    def __init__(self) -> None:
        super().__init__([])

    @property
    def choices(self) -> list[str]:
        from hype.executor import EXECUTORS

        return sorted(EXECUTORS.names())

    @choices.setter
    def choices(self, value: object) -> None:
        pass  # click.Choice sets it in __init__; the registry is the one source


def executor_choice() -> click.Choice:
    """The type of every `--executor` option."""
    return _ExecutorChoice()


def lock_output(out: str, command: str, *, option: str = "--out") -> None:
    """Take the lock of a command's output (the run contract's, `hype.io.runs`; `hype score` takes it on its
    run directory) until the command returns; an output another command holds is refused, holder named."""
    from hype.io.runs import LockError, output_lock

    try:
        click.get_current_context().with_resource(output_lock(out, command, option=option))
    except LockError as e:
        raise click.ClickException(str(e)) from None


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        # The bundled rules register themselves (imported here: `hype --help` stays fast).
        importlib.import_module("hype.filters")
        return getattr(importlib.import_module(module), attr)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except OSError as e:
            from hype.io.files import UnsafePathError  # here, not at the top: `hype --help` stays fast
            from hype.io.storage import StorageError

            # A missing bucket, refused credentials, a link planted where hype creates a file: the message
            # is the fix.
            if isinstance(e, (StorageError, UnsafePathError)):
                raise click.ClickException(str(e)) from None
            raise

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][2]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hype")
@click.option(
    "--storage-options",
    metavar="JSON",
    envvar="HYPE_STORAGE_OPTIONS",
    show_envvar=True,
    help='fsspec options for s3:// gs:// hf:// paths, e.g. \'{"endpoint_url": "http://host:9000"}\' '
    'or per protocol \'{"s3": {"profile": "x"}}\'. Credentials otherwise come from the usual places '
    "(AWS_* variables, ~/.aws, instance roles, gcloud). Never printed or written into run files; but a "
    "command line shows in `ps` to every user: put secrets in the variable or a config file instead.",
)
def main(storage_options: str | None) -> None:
    """HYPE: score an image-text pool with hyperbolic entailment and select the subset that trains the
    best CLIP.

    \b
    Typical use:
      hype demo                                           # everything, offline, on a synthetic world
      hype download --metadata meta --out pool            # fetch a pool (img2dataset)
      hype score --pool pool --meru M --clip C --out run  # score it
      hype select --scores run --frac 0.2 --out subset.npy

    Every path may be a URL (s3://bucket/pool, gs://..., hf://datasets/...): see --storage-options.
    """
    if storage_options:
        from hype.io import storage

        storage.configure(storage_options)
        # Read once, then out of the environment that every child (a local Ray cluster's processes)
        # inherits: workers get the options as an argument, `hype run`'s steps from hype.workflow.
        os.environ.pop(storage.ENV_OPTIONS, None)
