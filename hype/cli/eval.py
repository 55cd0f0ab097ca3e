"""`hype eval`: DataComp's zero-shot benchmark (or the synthetic world's) for a model of any geometry."""

from __future__ import annotations

import json

import click


@click.command("eval")
@click.option(
    "--model",
    "checkpoint",
    type=click.Path(exists=True),
    help="hype checkpoint (.safetensors from `hype train` or `hype convert`), or an open_clip model "
    "file or folder (see `hype convert open-clip --help`).",
)
@click.option(
    "--model-config",
    help="Evaluate a randomly initialized model of this config (name or YAML path), e.g. for chance-level "
    "baselines. Mutually exclusive with --model.",
)
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Seed of the random init (--model-config)."
)
@click.option(
    "--data-dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Folder holding the evaluation sets (wds_<task>_test/ ...); a synthetic world's root also works. "
    "May be a URL (s3://...), like --out: tars are streamed, and on object storage the results file is "
    "rewritten whole after each task (no appends there).",
)
@click.option(
    "--out",
    default="eval_results.jsonl",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Results file (DataComp format); finished tasks in it are skipped on rerun.",
)
@click.option(
    "--tasks",
    default="all",
    show_default=True,
    help="all (DataComp's 40 tasks), synthetic (the synthetic world's 7), a suite YAML, or task keys "
    "separated by commas, e.g. imagenet1k,vtab/cifar100.",
)
@click.option("--batch-size", default=64, show_default=True, type=int, help="Images per forward pass.")
@click.option("--device", default=None, help="cpu, cuda or cuda:N [default: cuda if available, else cpu].")
@click.option(
    "--workers",
    default=None,
    type=int,
    help="Image decoding processes; 0 decodes in this process [default: up to 8 beside a GPU; on CPU the "
    "cores torch's threads leave free, often 0, since decoding on the model's cores slows both].",
)
@click.option("--amp", is_flag=True, help="bf16 autocast in the encoders (the geometry stays fp32).")
@click.option(
    "--strict", is_flag=True, help="Fail when a dataset is missing or a task fails, instead of skipping it."
)
@click.option("--progress/--no-progress", default=True, show_default=True, help="Progress bars on stderr.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON instead of the table.")
def eval_cmd(
    checkpoint: str | None,
    model_config: str | None,
    seed: int,
    data_dir: str,
    out: str,
    tasks: str,
    batch_size: int,
    device: str | None,
    workers: int | None,
    amp: bool,
    strict: bool,
    progress: bool,
    as_json: bool,
) -> None:
    """Evaluate a model on DataComp's zero-shot benchmark: 40 tasks (38 scored) of classification,
    retrieval and WinoGAViL, with DataComp's metrics and aggregates, for every geometry.

    \b
    Appends one line per finished task to --out in DataComp's format
      {"key": ..., "dataset": ..., "metrics": {..., "main_metric": ...}}
    skips tasks already there, reports missing datasets, and prints the scores with the aggregates
    (ImageNet, ImageNet dist. shifts, VTAB, Retrieval, Average of 38).

    \b
    Examples:
      hype eval --model runs/meru.safetensors --data-dir /data/datacomp_eval
      hype eval --model-config tiny-hyperbolic --data-dir world --tasks synthetic --out chance.jsonl
    """
    if (checkpoint is None) == (model_config is None):
        raise click.UsageError("give exactly one of --model CHECKPOINT or --model-config NAME")
    if batch_size < 1:
        raise click.BadParameter(f"must be >= 1, got {batch_size}", param_hint="--batch-size")
    if workers is not None and workers < 0:
        raise click.BadParameter(f"must be >= 0, got {workers}", param_hint="--workers")

    from hype.cli import lock_output
    from hype.scoring.decode import share_cores_with_decoders

    lock_output(out, "eval")
    share_cores_with_decoders()  # decode workers and torch's OpenMP threads share the cores
    import torch

    from hype.eval import EvalError, RunOptions, TaskConfigError, run_eval, select_tasks
    from hype.eval.report import format_table
    from hype.eval.results import ResultsFileError

    try:
        selected = select_tasks(tasks)
    except TaskConfigError as e:
        raise click.BadParameter(str(e), param_hint="--tasks") from None
    if device is not None:
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise click.BadParameter(str(e), param_hint="--device") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise click.BadParameter(
                "CUDA is not available on this machine; use --device cpu", param_hint="--device"
            )

    model, identity = _load_model(checkpoint, model_config, seed)
    options = RunOptions(
        batch_size=batch_size, device=device, workers=workers, amp=amp, strict=strict, progress=progress
    )
    try:
        summary = run_eval(model, selected, data_dir, out, options, identity=identity)
    except (EvalError, ResultsFileError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(summary, indent=2) if as_json else format_table(summary))
    if summary["failed"]:
        raise SystemExit(1)


def _load_model(checkpoint: str | None, model_config: str | None, seed: int):
    import torch

    if checkpoint is not None:
        from hype.checkpoint import load_model_file, model_file_digest

        try:
            model = load_model_file(checkpoint)
            digest = model_file_digest(checkpoint)
        except ValueError as e:  # CheckpointError, ModelFileError: both name the file and the fix
            raise click.BadParameter(str(e), param_hint="--model") from None
        return model, {"checkpoint_sha256": digest, "config": model.config.name}

    from hype.models import create_model

    torch.manual_seed(seed)
    try:
        model = create_model(model_config)
    except (ValueError, FileNotFoundError) as e:
        raise click.BadParameter(str(e), param_hint="--model-config") from None
    return model, {"random_init": model_config, "seed": seed}
