"""Chains of `hype` commands run as child processes: `hype run WORKFLOW.yaml` (and `hype demo`, which is
configs/workflows/demo.yaml), through the `Runner` that the benchmarks (`bench/quality.py`) also drive by
hand; the command lines they build by hand are theirs (bench/).

Each step runs the same command a user would type (echoed before it runs), so a workflow doubles as a
worked example. A workflow step is skipped when its completion marker holds its fingerprint; the commands
themselves resume too (training from its last checkpoint, scoring from its finished shards). Child stdout
goes to a per-step log; stderr (progress bars, warnings, errors) goes to the terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from hype.config import ConfigError, build, parse_override, read_config
from hype.data.uids import (
    array_to_uids,
    from_structured,
    load_subset,
    load_uid_file,
    save_subset,
    sort_order,
    to_structured,
)
from hype.io.files import read_json, write_json, write_text
from hype.io.runs import Marker, fingerprint, legacy_fingerprint


class StepError(RuntimeError):
    """A `hype` command failed; the message names the step, the command and its log."""


def fmt_seconds(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s" if s >= 60 else f"{s:.1f}s"


@dataclass
class Runner:
    """Runs `hype` subcommands in child processes, logging each to `logs/NN-name.log`."""

    logs: Path
    progress: bool = True
    echo: bool = True
    timings: dict[str, float] = field(default_factory=dict)

    def hype(self, name: str, *args: str, number: int | None = None) -> None:
        """Run `hype ARGS` as step `name`; its log is `logs/NN-name.log`, NN = `number` or the step count."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{number or len(self.timings) + 1:02d}-{name}.log"
        cmd = [sys.executable, "-P", "-m", "hype.cli", *args]  # -P: see child_env
        if self.echo:
            print("$ hype " + shlex.join(args), flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as out:
            err = None if self.progress else subprocess.STDOUT
            proc = subprocess.run(cmd, stdout=out, stderr=err, check=False, env=child_env())
        self.timings[name] = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-15:])
            raise StepError(
                f"step {name!r} failed (exit {proc.returncode}): hype {shlex.join(args)}\nlog: {log}\n{tail}"
            )
        if self.echo:
            print(f"  done in {fmt_seconds(self.timings[name])}  (log: {log})", flush=True)

    def skip(self, name: str, why: str) -> None:
        self.timings[name] = 0.0
        if self.echo:
            print(f"= {name}: {why}, skipped", flush=True)


def child_env() -> dict[str, str]:
    """The environment of a step's `python -P -m hype.cli`.

    `-P` keeps the current folder off the child's import path: `python -m` would put it first, and a
    `hype.py` or `filters.py` there would run inside the step. When hype itself was found there (a
    checkout run from its own folder, not installed), that folder is named in PYTHONPATH instead: the
    child runs the same hype, and nothing else from a folder the parent did not already import from.
    This process's storage options (`hype --storage-options`) go in HYPE_STORAGE_OPTIONS: never on a
    command line, which every user of the machine can read, nor in the step's logs and markers."""
    import hype
    from hype.io import storage

    env = dict(os.environ)
    root = str(Path(hype.__file__).resolve().parents[1])
    if root == str(Path.cwd().resolve()):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    options = storage.snapshot()
    if options:
        env[storage.ENV_OPTIONS] = json.dumps(options)
    return env


def read_eval(path: Path) -> dict[str, float]:
    """{task key: main metric} from a `hype eval` results file (DataComp's jsonl)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["key"]: float(r["metrics"]["main_metric"]) for r in rows}


def average(metrics: dict[str, float]) -> float:
    """DataComp's headline number: the unweighted mean of the tasks' main metrics."""
    return float(np.mean(list(metrics.values()))) if metrics else float("nan")


def subset_composition(subset: Path, truth: Path) -> dict[str, float]:
    """Share of each noise kind of the synthetic world among the subset's samples (from truth.parquet)."""
    table = pq.read_table(truth, columns=["uid", "noise"]).to_pandas()
    chosen = set(array_to_uids(load_subset(subset)))
    kept = table["uid"].isin(chosen).to_numpy()
    counts = table.loc[kept, "noise"].value_counts()
    total = int(kept.sum())
    return {str(k): float(v) / total for k, v in counts.items()} if total else {}


def format_table(rows: list[dict], tasks: Sequence[str]) -> str:
    """A fixed-width text table: one row per arm, its size, clean share, the average and every task."""
    spread = any(r.get("average_std") is not None for r in rows)
    width = 14 if spread else 11  # "0.289±0.045" needs 11 characters plus a gap
    short = [t.split("/")[-1] for t in tasks]
    head = f"{'subset':<18}{'samples':>8}{'clean':>7}" + "".join(f"{s:>{width}}" for s in ["average", *short])
    lines = [head, "-" * len(head)]
    for r in rows:
        clean = "" if r.get("clean") is None else f"{r['clean']:.2f}"
        cells = [f"{r['name']:<18}", f"{r['samples']:>8,}", f"{clean:>7}"]
        cells.append(_cell(r["average"], r.get("average_std"), width))
        for t in tasks:
            cells.append(_cell(r["metrics"].get(t, float("nan")), (r.get("metrics_std") or {}).get(t), width))
        lines.append("".join(cells))
    return "\n".join(lines)


def _cell(value: float, std: float | None, width: int) -> str:
    text = f"{value:.3f}" if std is None else f"{value:.3f}±{std:.3f}"
    return f"{text:>{width}}"


# --- workflows: `hype run WORKFLOW.yaml` -----------------------------------------------------------
#
# A workflow file declares a chain of steps; each step is a `hype` command (or one of the few steps done
# in `hype run` itself: union, intersect, table) whose output lives in OUT/<step>, so a step names its
# inputs by the step that produces them (`score`, `world.clean`). A step is done when its marker
# OUT/.hype/steps/<step>.json (the run contract's Marker, `hype.io.runs`) says done with the step's
# fingerprint (the contract's digest of its command line, paths relative to OUT, and of its inputs'
# fingerprints) and its output exists: a rerun skips it, and reruns
# from scratch a step whose fingerprint changed (and so every step that reads it). A step cut short
# (the marker says "running" with the same fingerprint) is rerun on its own output: the commands resume
# inside (score's finished shards, train's checkpoints, download's shards).

ROOT = "${OUT}"  # the run folder inside command lines, so fingerprints survive moving the folder
STEP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
VARIABLE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([^{}]*))?\}")
SERVE = "serve"  # {serve}: the base url of the workflow's loopback server (in its `serve.steps` only)
MAX_FORMAT_NUMBER = 64  # the largest width or precision in a `{name:spec}` (a caption's `{frac:.0%}`)
# `runtime:` options: where and how fast a step runs, never what it writes, so they stay out of the
# fingerprint; anything else (a size, a device, another --out) would be skipped as done when changed.
RUNTIME_OPTIONS = ("executor", "ray-address", "workers", "threads", "processes")


@dataclass(frozen=True)
class Kind:
    """What `hype run` knows of a step kind: where its output goes inside the step's folder."""

    out: str = ""  # the --out path, relative to the step folder ("" = the folder itself)
    main: str | None = None  # what `inputs: {x: <step>}` reads [default: out]
    outputs: dict[str, str] = field(default_factory=dict)  # `<step>.<name>` -> path in the folder
    command: bool = True  # a `hype` subcommand in a child process; False: done by `hype run` itself
    root_files: tuple[str, ...] = ()  # files OUT/<step><suffix> instead of a folder (the results table)


KINDS: dict[str, Kind] = {
    "synth": Kind(
        outputs={
            "clean": "clean/shards",
            "images": "pool",
            "metadata": "pool/metadata",
            "truth": "truth.parquet",
            "classes": "eval/reference/train",
        }
    ),
    "download": Kind(),
    "train": Kind(main="model.safetensors"),
    "score": Kind(),
    "select": Kind(out="subset.npy", outputs={"table": "subset.parquet", "summary": "subset.json"}),
    "reshard": Kind(),
    "eval": Kind(out="results.jsonl"),
    "report": Kind(out="report.html"),
    "submit": Kind(),
    "union": Kind(out="subset.npy", command=False),
    "intersect": Kind(out="subset.npy", command=False),
    "table": Kind(command=False, root_files=(".json", ".md")),
}


class WorkflowError(ValueError):
    """A workflow that cannot run as asked (a step before --from not done, an unknown step name)."""


@dataclass(frozen=True)
class StepSpec:
    """One step of a workflow file.

    `args` are the command's options (`{frac: 0.2}` -> `--frac 0.2`; true -> a flag, false -> `--no-x`,
    a list -> the option repeated); `settings` its `key=value` config overrides; `inputs` options whose
    values name producing steps (`{scores: score}`, `{data: world.clean}`); `runtime` options that do
    not change the output (`RUNTIME_OPTIONS`: threads, executor, ...), left out of the fingerprint."""

    name: str
    run: str
    args: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    runtime: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not STEP_NAME.match(self.name):
            raise ConfigError("name", f"{self.name!r}: use letters, digits, - and _ (it names a folder)")
        if self.run not in KINDS:
            raise ConfigError(
                f"{self.name}.run", f"unknown step kind {self.run!r}; known: {', '.join(KINDS)}"
            )
        for section, options in (("args", self.args), ("runtime", self.runtime)):
            if "out" in options:
                raise ConfigError(
                    f"{self.name}.{section}.out",
                    "hype run writes each step to OUT/<step>; set the workflow's out instead",
                )
        other = [k for k in self.runtime if k not in RUNTIME_OPTIONS]
        if other:
            raise ConfigError(
                f"{self.name}.runtime.{other[0]}",
                f"runtime holds only options that change no output ({', '.join(RUNTIME_OPTIONS)}), "
                "left out of the fingerprint; put it under args",
            )


@dataclass(frozen=True)
class ServeSpec:
    """A loopback HTTP server over `root` (`<step>.<output>`) while the `steps` run, its url `{serve}`.
    The steps run together: the urls name the server's port, so when one must run, all rerun."""

    root: str
    steps: list[str]


@dataclass(frozen=True)
class WorkflowSpec:
    name: str
    out: str
    steps: list[StepSpec]
    vars: dict[str, Any] = field(default_factory=dict)
    serve: ServeSpec | None = None

    def __post_init__(self) -> None:
        seen: dict[str, StepSpec] = {}
        for step in self.steps:
            if step.name in seen:
                raise ConfigError(f"steps.{step.name}", "two steps have this name")
            for option, value in step.inputs.items():
                for ref in _refs(value):
                    _check_ref(ref, seen, f"steps.{step.name}.inputs.{option}")
            seen[step.name] = step
        if not self.steps:
            raise ConfigError("steps", "no steps")
        if self.serve is not None:
            unknown = [s for s in self.serve.steps if s not in seen]
            if unknown:
                raise ConfigError("serve.steps", f"no step named {', '.join(unknown)}")
            _check_ref(self.serve.root, seen, "serve.root")


def _refs(value: Any) -> list[str]:
    """The step references in an `inputs` value: a name, a list of names or a mapping label -> name."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs(v)]
    raise ConfigError("", f"an input names a step (`score`, `world.clean`), got {value!r}")


def _check_ref(ref: str, earlier: dict[str, StepSpec], key: str) -> None:
    name, _, output = ref.partition(".")
    if name not in earlier:
        raise ConfigError(
            key, f"{ref!r}: no earlier step named {name!r}; earlier: {', '.join(earlier) or '-'}"
        )
    outputs = KINDS[earlier[name].run].outputs
    if output and output not in outputs:
        known = ", ".join(outputs) or "none besides the step itself"
        raise ConfigError(
            key, f"{ref!r}: a {earlier[name].run} step has no output {output!r}; outputs: {known}"
        )


def load_workflow(config: str | PathLike, overrides: Sequence[str] = ()) -> Workflow:
    """A workflow file (a path, or a name in configs/workflows/) with `key=value` overrides: `out=...`,
    `vars.size=4000` (or just `size=4000`), `steps.<step>.args.frac=0.3`."""
    data, source = read_config("workflows", str(config), what="workflow")
    for item in overrides:
        _override(data, item)
    source += " (with overrides)" if overrides else ""
    spec = build(WorkflowSpec, data, source=source)
    return Workflow(spec, source)


def _override(data: dict, item: str) -> None:
    path, value = parse_override(item)
    variables = data.get("vars") or {}
    if len(path) == 1 and path[0] in ("name", "out"):
        data[path[0]] = value
    elif len(path) == 1 and path[0] in variables:
        variables[path[0]] = value
    elif path[0] == "vars" and len(path) == 2:
        if path[1] not in variables:
            raise ConfigError(
                item, f"no variable {path[1]!r}; vars: {', '.join(variables) or '-'}", "override"
            )
        variables[path[1]] = value
    elif path[0] == "steps" and len(path) >= 4 and path[2] in ("args", "settings", "inputs", "runtime"):
        steps = {s.get("name"): s for s in data.get("steps") or [] if isinstance(s, dict)}
        if path[1] not in steps:
            raise ConfigError(item, f"no step {path[1]!r}; steps: {', '.join(map(str, steps))}", "override")
        # A dotted setting (reference.m) is one key of `settings`, not a nested mapping.
        section = steps[path[1]].setdefault(path[2], {})
        section[".".join(path[3:])] = value
    else:
        known = ", ".join(["out", "name", *variables])
        raise ConfigError(
            item,
            f"unknown key; set {known}, vars.NAME or steps.STEP.(args|settings|inputs|runtime).KEY",
            "override",
        )


def interpolate(value: Any, variables: dict[str, Any], key: str) -> Any:
    """`{name}` and `{name:spec}` in the strings of `value` replaced by workflow variables; a string that is
    exactly `{name}` takes the variable's value as it is (a number stays a number)."""
    if isinstance(value, list):
        return [interpolate(v, variables, key) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, variables, f"{key}.{k}") for k, v in value.items()}
    if not isinstance(value, str):
        return value

    def lookup(m: re.Match) -> Any:
        if m.group(1) not in variables:
            raise ConfigError(key, f"unknown variable {m.group(0)}; vars: {', '.join(variables) or '-'}")
        return variables[m.group(1)]

    def formatted(m: re.Match) -> str:
        spec = m.group(2) or ""
        # A width or precision is a size to allocate: `{size:>3000000000}` is 3 GB of spaces.
        if any(int(n) > MAX_FORMAT_NUMBER for n in re.findall(r"\d+", spec)):
            raise ConfigError(key, f"{m.group(0)}: widths and precisions go up to {MAX_FORMAT_NUMBER}")
        try:
            return format(lookup(m), spec)
        except (ValueError, TypeError) as e:
            raise ConfigError(key, f"{m.group(0)}: {e} (e.g. {{frac:.0%}}, {{size:,}})") from None

    whole = VARIABLE.fullmatch(value)
    if whole and whole.group(2) is None:
        return lookup(whole)
    return VARIABLE.sub(formatted, value)


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def _options(options: dict[str, Any]) -> list[str]:
    """`{frac: 0.2, overwrite: true, union: [a, b]}` -> `--frac 0.2 --overwrite --union a --union b`."""
    argv: list[str] = []
    for key, value in options.items():
        flag = f"--{key}"
        for v in value if isinstance(value, list) else [value]:
            if v is True:
                argv.append(flag)
            elif v is False:
                argv.append(f"--no-{key}")
            elif isinstance(v, dict):
                argv += [x for k, item in v.items() for x in (flag, f"{k}={item}")]
            elif v is not None:
                argv += [flag, _text(v)]
    return argv


@dataclass
class Step:
    """A step resolved against its workflow: its command line (paths under ROOT) and fingerprint."""

    spec: StepSpec
    number: int
    argv: list[str]
    runtime: list[str]
    needs: list[str]
    fingerprint: str
    legacy_fingerprint: str = ""  # what a hype before the run contract recorded (sha256): still done

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kind(self) -> Kind:
        return KINDS[self.spec.run]


@dataclass
class Outcome:
    name: str
    state: str  # done (before this run) | ran | failed | not run
    seconds: float = 0.0


class Workflow:
    """A loaded workflow: its steps resolved in order, their states read from the run folder."""

    def __init__(self, spec: WorkflowSpec, source: str = "<dict>"):
        self.spec, self.source = spec, source
        variables = dict(spec.vars)
        if spec.serve is not None:
            variables[SERVE] = "{" + SERVE + "}"  # filled in at run time, outside the fingerprint
        try:
            self.out = Path(str(interpolate(spec.out, variables, "out"))).resolve()
            self.steps: dict[str, Step] = {}
            for number, s in enumerate(spec.steps, 1):
                self.steps[s.name] = self._resolve(s, number, variables)
        except ConfigError as e:
            raise e.from_source(source) from None

    def _resolve(self, s: StepSpec, number: int, variables: dict[str, Any]) -> Step:
        where = f"steps.{s.name}"
        serving = self.spec.serve is not None and s.name in self.spec.serve.steps
        scope = variables if serving else {k: v for k, v in variables.items() if k != SERVE}
        inputs = {k: self._input_paths(v) for k, v in s.inputs.items()}
        args = interpolate(s.args, scope, f"{where}.args")
        kind = KINDS[s.run]
        for key, value in args.items():  # an option given both ways (union's subsets) takes both
            inputs[key] = _as_list(inputs[key]) + _as_list(value) if key in inputs else value
        argv = [s.run, *_options(inputs)]
        if not kind.root_files:
            argv += ["--out", self._folder(s.name, kind.out)]
        argv += [f"{k}={_text(v)}" for k, v in interpolate(s.settings, scope, f"{where}.settings").items()]
        runtime = _options(interpolate(s.runtime, scope, f"{where}.runtime"))
        needs = sorted({r.partition(".")[0] for r in _refs(list(s.inputs.values()))})
        digest = fingerprint({"argv": argv, "inputs": [self.steps[n].fingerprint for n in needs]})
        legacy_inputs = [self.steps[n].legacy_fingerprint for n in needs]
        legacy = legacy_fingerprint({"argv": argv, "inputs": legacy_inputs}, sort_keys=False)
        return Step(s, number, argv, runtime, needs, digest, legacy)

    def _input_paths(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self._input_paths(v) for v in value]
        if isinstance(value, dict):
            return {k: self._input_paths(v) for k, v in value.items()}
        name, _, output = value.partition(".")
        kind = KINDS[self.spec.steps[self._index(name)].run]
        if kind.root_files:
            return f"{ROOT}/{name}{kind.root_files[0]}"
        return self._folder(name, kind.outputs[output] if output else (kind.main or kind.out))

    def _index(self, name: str) -> int:
        return [s.name for s in self.spec.steps].index(name)

    @staticmethod
    def _folder(name: str, rel: str) -> str:
        return f"{ROOT}/{name}/{rel}" if rel else f"{ROOT}/{name}"

    # --- paths and state --------------------------------------------------------------------------

    def real(self, text: str) -> str:
        return text.replace(ROOT, str(self.out))

    def path(self, ref: str) -> Path:
        """The path of an output: `score`, `world.truth`."""
        return Path(self.real(self._input_paths(ref)))

    def command(self, step: Step) -> list[str]:
        return [self.real(a) for a in step.argv] + step.runtime

    def marker_path(self, name: str) -> Path:
        return self.out / ".hype" / "steps" / f"{name}.json"

    def marker(self, name: str) -> dict | None:
        return Marker(self.marker_path(name)).read()

    def state(self, step: Step) -> str:
        """done: finished with this fingerprint and its output is there; changed: made (or begun) with
        other settings or inputs; pending: never run, cut short, or its output was removed."""
        marker = Marker(self.marker_path(step.name))
        record = marker.read()
        if record is None:
            return "pending"
        if record.get("fingerprint") not in (step.fingerprint, step.legacy_fingerprint):
            return "changed"
        done = marker.done(record["fingerprint"]) is not None and self.path(step.name).exists()
        return "done" if done else "pending"

    def _outputs(self, step: Step) -> list[Path]:
        if step.kind.root_files:
            return [self.out / f"{step.name}{suffix}" for suffix in step.kind.root_files]
        return [self.out / step.name]

    def _check_owned(self, step: Step) -> None:
        """Refuse to replace a step's output that this workflow did not make: only a step whose marker is
        there (written before its command starts) made its folder; a link is never followed; an empty
        folder holds nothing to lose."""
        made = self.marker(step.name) is not None
        for p in self._outputs(step):
            empty = p.is_dir() and not p.is_symlink() and next(p.iterdir(), None) is None
            if p.is_symlink() or (p.exists() and not made and not empty):
                raise WorkflowError(
                    f"{p}: hype run would replace it, but this workflow did not make it (no "
                    f"{self.marker_path(step.name)}); use another out= or remove it yourself"
                )

    def _clear(self, step: Step) -> None:
        self._check_owned(step)
        for p in self._outputs(step):
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        self.marker_path(step.name).unlink(missing_ok=True)

    def _clears(self, step: Step, state: str) -> bool:
        """Whether running `step` starts it over: other settings, --from on a done step, or a served
        step (its urls name the server's port, which changes with every run)."""
        record = self.marker(step.name)
        fresh = state == "changed" or (record is not None and record.get("state") == "done")
        return fresh or (self.spec.serve is not None and step.name in self.spec.serve.steps)

    # --- planning ---------------------------------------------------------------------------------

    def plan(self, start: str | None = None, until: str | None = None) -> list[tuple[Step, str, bool]]:
        """(step, state, runs) for every step in order: `runs` says whether this run executes it."""
        names = list(self.steps)
        for option, name in (("--from", start), ("--until", until)):
            if name is not None and name not in self.steps:
                raise WorkflowError(f"{option} {name}: no such step; steps: {', '.join(names)}")
        first = names.index(start) if start else 0
        last = names.index(until) if until else len(names) - 1
        if first > last:
            raise WorkflowError(f"--from {start} comes after --until {until}")
        states = {n: self.state(s) for n, s in self.steps.items()}
        missing = [n for n in names[:first] if states[n] != "done"]
        if missing:
            raise WorkflowError(
                f"--from {start}: the steps before it are not all done ({', '.join(missing)}); "
                f"run them first (hype run ... --until {missing[-1]})"
            )
        runs = {
            n: first <= i <= last and (start is not None or states[n] != "done") for i, n in enumerate(names)
        }
        serve = self.spec.serve
        if serve is not None and any(runs[n] for n in serve.steps):
            for n in serve.steps:  # the urls name the server's port: the serve steps run together
                runs[n] = names.index(n) <= last
        return [(self.steps[n], states[n], runs[n]) for n in names]

    # --- running ----------------------------------------------------------------------------------

    def run(
        self,
        *,
        start: str | None = None,
        until: str | None = None,
        executor: str | None = None,
        progress: bool = True,
        echo: Callable[[str], None] = print,
    ) -> list[Outcome]:
        """Run the steps that are not done (all from `start` on), up to `until`; returns one outcome per
        step. A failed step raises `StepError` after the summary is printed."""
        from hype.io.runs import output_lock

        plan = self.plan(start, until)
        # Before anything runs, so that a refusal never stops a run halfway: what a step replaces (or,
        # done by hype run itself, writes) must be this workflow's.
        for step, state, runs in plan:
            if runs and (self._clears(step, state) or not step.kind.command):
                self._check_owned(step)
        self.out.mkdir(parents=True, exist_ok=True)
        runner = Runner(self.out / "logs", progress=progress, echo=False)
        outcomes = [
            Outcome(s.name, "done" if st == "done" and not runs else "not run") for s, st, runs in plan
        ]
        t0 = time.perf_counter()
        try:
            with output_lock(self.out, "run"), contextlib.ExitStack() as server:
                url = None
                for (step, state, runs), outcome in zip(plan, outcomes, strict=True):
                    head = f"[{step.number:02d}/{len(plan)}] {step.name}"
                    if not runs:
                        echo(f"{head}: {outcome.state}{', skipped' if outcome.state == 'done' else ''}")
                        continue
                    if url is None and self.spec.serve is not None and step.name in self.spec.serve.steps:
                        from hype.synth.serve import serve_directory  # here: only a served workflow pays

                        url = server.enter_context(serve_directory(self.path(self.spec.serve.root)))
                    outcome.state = "failed"
                    outcome.seconds = self._run_step(step, state, head, runner, url, executor, progress, echo)
                    outcome.state = "ran"
        finally:
            echo(self.summary(outcomes, time.perf_counter() - t0))
        return outcomes

    def _run_step(self, step, state, head, runner, url, executor, progress, echo) -> float:
        if self._clears(step, state):
            self._clear(step)
        command = self.command(step)
        if url is not None:
            command = [a.replace("{" + SERVE + "}", url) for a in command]
        if step.spec.run == "score" and executor:
            command = _replace_option(command, "--executor", executor)
        if step.kind.command and not progress:
            command.append("--no-progress")
        shown = ("$ hype " if step.kind.command else "$ (hype run) ") + shlex.join(command)
        echo(f"{head}: {state}, running\n{shown}")
        marker = Marker(self.marker_path(step.name))
        marker.begin(step.fingerprint, step=step.name, pid=os.getpid())  # first: it claims the folder
        if not step.kind.root_files:
            (self.out / step.name).mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if step.kind.command:
            runner.hype(step.name, *command, number=step.number)
            if step.spec.run == "download":
                _check_download(Path(self.real(self._folder(step.name, ""))))
        else:
            try:
                BUILT_IN[step.spec.run](self, step)
            except (OSError, ValueError) as e:
                raise StepError(f"step {step.name!r} failed: {e}") from e
        seconds = time.perf_counter() - t0
        marker.write(step.fingerprint, step=step.name, command=shown, seconds=round(seconds, 1))
        echo(f"{head}: done in {fmt_seconds(seconds)}")
        return seconds

    def dry_run(self, start: str | None = None, until: str | None = None) -> str:
        """The plan: every step with its state, whether it would run, and its command."""
        lines = []
        plan = self.plan(start, until)
        for step, state, runs in plan:
            action = "runs" if runs else ("skipped" if state == "done" else "not run")
            shown = ("$ hype " if step.kind.command else "$ (hype run) ") + shlex.join(self.command(step))
            lines.append(f"[{step.number:02d}/{len(plan)}] {step.name}: {state}, {action}\n    {shown}")
        return "\n".join(lines)

    def summary(self, outcomes: list[Outcome], elapsed: float) -> str:
        ran = sum(o.state == "ran" for o in outcomes)
        width = max(len(o.name) for o in outcomes)
        took = fmt_seconds(elapsed)
        lines = [f"hype run {self.spec.name}: {ran} of {len(outcomes)} steps ran in {took} ({self.out})"]
        for o in outcomes:
            seconds = fmt_seconds(o.seconds) if o.state in ("ran", "failed") else ""
            lines.append(f"  {o.name:<{width}}  {o.state:<8} {seconds:>7}")
        return "\n".join(lines)


def _replace_option(command: list[str], option: str, value: str) -> list[str]:
    """`command` with `option`'s value set to `value` (appended when absent)."""
    out = list(command)
    if option in out:
        out[out.index(option) + 1] = value
        return out
    return [*out, option, value]


def _check_download(pool: Path) -> None:
    summary = read_json(pool / "_hype" / "summary.json")  # written by `hype download` at the end
    if summary is None or summary.get("status") != "complete":
        raise StepError(
            f"hype download left shards to retry in {pool}; see {pool / '_hype' / 'summary.json'}"
        )


# --- the steps `hype run` does itself ---------------------------------------------------------------


def _set_operation(wf: Workflow, step: Step) -> None:
    """union / intersect: the uids of the `subsets` (input steps and files), each uid once."""
    files = [Path(wf.real(p)) for p in _as_list(wf._input_paths(step.spec.inputs.get("subsets", [])))]
    files += [
        Path(p) for p in _as_list(interpolate(step.spec.args.get("subsets", []), wf.spec.vars, step.name))
    ]
    unknown = set(step.spec.args) - {"subsets"} | set(step.spec.inputs) - {"subsets"}
    if unknown or len(files) < 2:
        raise ValueError(
            f"a {step.spec.run} step takes `subsets` (at least two steps or files) and nothing else"
        )
    his, los = [], []
    for f in files:
        hi, lo = _unique(*from_structured(load_uid_file(f, step.spec.run)))
        his.append(hi)
        los.append(lo)
    hi, lo = np.concatenate(his), np.concatenate(los)
    order = sort_order(hi, lo)
    hi, lo = hi[order], lo[order]
    starts = np.flatnonzero(np.r_[True, (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])])
    counts = np.diff(np.r_[starts, len(hi)])
    keep = starts if step.spec.run == "union" else starts[counts == len(files)]
    out = wf.path(step.name)
    save_subset(out, to_structured(hi[keep], lo[keep]))
    write_json(
        out.with_suffix(".json"),
        {"operation": step.spec.run, "inputs": [str(f) for f in files], "samples": int(len(keep))},
    )


def _unique(hi: np.ndarray, lo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = sort_order(hi, lo)
    hi, lo = hi[order], lo[order]
    keep = np.r_[True, (hi[1:] != hi[:-1]) | (lo[1:] != lo[:-1])] if len(hi) else np.zeros(0, bool)
    return hi[keep], lo[keep]


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


def _table(wf: Workflow, step: Step) -> None:
    """The results table: one row per `rows` entry (label -> an eval step), its subset found through the
    eval's `model` input (a train step) and that step's `subset` input; the clean share from `truth`
    (a synthetic world's truth.parquet) when given. Writes OUT/<step>.json and OUT/<step>.md."""
    inputs = step.spec.inputs
    if not isinstance(inputs.get("rows"), dict):
        raise ValueError("a table step takes inputs.rows: {label: <eval step>, ...}")
    truth = wf.path(inputs["truth"]) if "truth" in inputs else None
    rows = []
    for label, ref in inputs["rows"].items():
        metrics = read_eval(wf.path(ref))
        train = wf.spec.steps[wf._index(ref)].inputs.get("model", "")
        producer = wf.spec.steps[wf._index(train.partition(".")[0])] if train else None
        subset = wf.path(producer.inputs["subset"]) if producer and "subset" in producer.inputs else None
        comp = subset_composition(subset, truth) if subset is not None and truth is not None else {}
        rows.append(
            {"name": label, "samples": len(load_subset(subset)) if subset is not None else None,
             "clean": comp.get("clean", 0.0) if truth is not None else None, "composition": comp,
             "average": average(metrics), "metrics": metrics}
        )  # fmt: skip
    tasks = sorted(rows[0]["metrics"]) if rows else []
    caption = str(interpolate(step.spec.args.get("caption", ""), wf.spec.vars, f"{step.name}.args.caption"))
    report = wf.path(inputs["report"]) if "report" in inputs else None
    result = {
        "workflow": wf.spec.name,
        "vars": wf.spec.vars,
        "rows": rows,
        "tasks": tasks,
        "report": str(report) if report is not None else None,
        "table": format_table(rows, tasks),
    }
    write_text(wf.out / f"{step.name}.md", markdown_table(rows, tasks, caption))
    write_json(wf.out / f"{step.name}.json", result, sort_keys=False)


def markdown_table(rows: list[dict], tasks: Sequence[str], caption: str = "") -> str:
    """The results table as markdown, under an optional caption."""
    head = (
        "| subset | samples | clean share | average | " + " | ".join(t.split("/")[-1] for t in tasks) + " |"
    )
    lines = [caption, ""] if caption else []
    lines += [head, "|" + "---|" * (4 + len(tasks))]
    for r in rows:
        samples = "" if r["samples"] is None else f"{r['samples']:,}"
        clean = "" if r.get("clean") is None else f"{r['clean']:.2f}"
        cells = [r["name"], samples, clean, f"{r['average']:.3f}"]
        cells += [f"{r['metrics'].get(t, float('nan')):.3f}" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


BUILT_IN: dict[str, Callable[[Workflow, Step], None]] = {
    "union": _set_operation,
    "intersect": _set_operation,
    "table": _table,
}
