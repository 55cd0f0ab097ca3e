"""`hype run WORKFLOW.yaml`: planning (fingerprints, states, --from/--until, dry runs, overrides) on small
workflows of the steps `hype run` does itself, then the demo workflow killed in every step."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from background import background_run, waited
from click.testing import CliRunner
from conftest import DEMO_VARS

from hype.cli import main
from hype.config import ConfigError, list_presets
from hype.data.uids import array_to_uids, load_subset, save_subset, uids_to_array
from hype.workflow import StepError, WorkflowError, load_workflow


def _uids(*ints: int) -> np.ndarray:
    return uids_to_array([f"{i:032x}" for i in ints])


def _sets(tmp_path: Path, **steps) -> Path:
    """A workflow of union/intersect steps over uid files a.npy = {1..4}, b.npy = {3..6}, c.npy = {4, 9}."""
    for name, ints in {"a": (1, 2, 3, 4), "b": (3, 4, 5, 6), "c": (4, 9)}.items():
        save_subset(tmp_path / f"{name}.npy", _uids(*ints))
    spec = {
        "name": "sets",
        "out": str(tmp_path / "run"),
        "vars": {"a": str(tmp_path / "a.npy"), "b": str(tmp_path / "b.npy"), "c": str(tmp_path / "c.npy")},
        "steps": [
            {"name": "both", "run": "intersect", "args": {"subsets": ["{a}", "{b}"]}},
            {"name": "either", "run": "union", "args": {"subsets": ["{a}", "{b}"]}},
            {"name": "more", "run": "union", "inputs": {"subsets": ["both"]}, "args": {"subsets": ["{c}"]}},
        ],
        **steps,
    }
    path = tmp_path / "sets.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _ints(path: Path) -> list[int]:
    return [int(u, 16) for u in array_to_uids(load_subset(path))]


def _quiet(wf, **kw):
    lines: list[str] = []
    outcomes = wf.run(echo=lines.append, **kw)
    return {o.name: o.state for o in outcomes}, "\n".join(lines)


def test_union_and_intersect_steps_name_their_inputs_by_step(tmp_path):
    wf = load_workflow(_sets(tmp_path))
    states, text = _quiet(wf)
    assert states == {"both": "ran", "either": "ran", "more": "ran"}
    assert _ints(wf.out / "both" / "subset.npy") == [3, 4]
    assert _ints(wf.out / "either" / "subset.npy") == [1, 2, 3, 4, 5, 6]
    assert _ints(wf.out / "more" / "subset.npy") == [3, 4, 9]  # `both` (a step) ∪ c.npy (a file)
    # Progress: one line per step with its state, then the summary with one line per step.
    assert "[01/3] both: pending, running" in text and "[03/3] more: done in" in text
    summary = text[text.index("hype run sets: 3 of 3 steps ran") :].splitlines()
    assert [line.split()[:2] for line in summary[1:]] == [["both", "ran"], ["either", "ran"], ["more", "ran"]]


def test_rerun_skips_done_steps_and_a_changed_setting_reruns_that_step_and_its_readers(tmp_path):
    path = _sets(tmp_path)
    wf = load_workflow(path)
    _quiet(wf)
    again = load_workflow(path)
    assert _quiet(again)[0] == {"both": "done", "either": "done", "more": "done"}

    changed = load_workflow(path, ['steps.both.args.subsets=["{a}", "{c}"]'])
    assert [changed.steps[n].fingerprint != wf.steps[n].fingerprint for n in wf.steps] == [True, False, True]
    plan = changed.dry_run()
    assert "both: changed, runs" in plan and "either: done, skipped" in plan and "more: changed, runs" in plan
    states, _ = _quiet(changed)
    assert states == {"both": "ran", "either": "done", "more": "ran"}
    assert _ints(changed.out / "both" / "subset.npy") == [4]
    assert _ints(changed.out / "more" / "subset.npy") == [4, 9]
    # Back to the first settings: a rerun again, not the stale outputs of the other settings.
    assert _quiet(load_workflow(path))[0] == {"both": "ran", "either": "done", "more": "ran"}
    assert _ints(wf.out / "more" / "subset.npy") == [3, 4, 9]


def test_step_markers_are_the_run_contract_s_and_older_markers_still_count(tmp_path):
    from hype.io.runs import fingerprint, is_done

    wf = load_workflow(_sets(tmp_path))
    _quiet(wf)
    for name, step in wf.steps.items():
        inputs = [wf.steps[n].fingerprint for n in step.needs]
        assert step.fingerprint == fingerprint({"argv": step.argv, "inputs": inputs})
        assert is_done(wf.marker_path(name), step.fingerprint)["step"] == name
    # Markers written before the contract held the sha256 of the same description: still done.
    legacy: dict[str, str] = {}
    for name, step in wf.steps.items():
        described = {"argv": step.argv, "inputs": [legacy[n] for n in step.needs]}
        legacy[name] = hashlib.sha256(json.dumps(described).encode()).hexdigest()
        marker = json.loads(wf.marker_path(name).read_text())
        wf.marker_path(name).write_text(json.dumps({**marker, "fingerprint": legacy[name]}))
    mtimes = {p: p.stat().st_mtime_ns for p in wf.out.glob("*/subset.npy")}
    assert _quiet(load_workflow(_sets(tmp_path)))[0] == {"both": "done", "either": "done", "more": "done"}
    assert {p: p.stat().st_mtime_ns for p in wf.out.glob("*/subset.npy")} == mtimes


def test_a_removed_output_or_a_step_cut_short_is_pending_and_reruns(tmp_path):
    wf = load_workflow(_sets(tmp_path))
    _quiet(wf)
    (wf.out / "either" / "subset.npy").unlink()
    marker = json.loads((wf.out / ".hype" / "steps" / "both.json").read_text())
    (wf.out / ".hype" / "steps" / "both.json").write_text(json.dumps({**marker, "state": "running"}))
    assert [(s.name, st, runs) for s, st, runs in wf.plan()] == [
        ("both", "pending", True),
        ("either", "pending", True),
        ("more", "done", False),
    ]
    assert _quiet(wf)[0] == {"both": "ran", "either": "ran", "more": "done"}


def test_a_failed_step_stops_the_run_and_a_rerun_goes_on_from_it(tmp_path):
    path = _sets(tmp_path)
    (tmp_path / "c.npy").write_bytes(b"not a subset file")
    lines: list[str] = []
    with pytest.raises(StepError, match=r"step 'more' failed: .*c\.npy"):
        load_workflow(path).run(echo=lines.append)
    assert [line.split()[:2] for line in "\n".join(lines).splitlines()[-3:]] == [
        ["both", "ran"],
        ["either", "ran"],
        ["more", "failed"],
    ]
    save_subset(tmp_path / "c.npy", _uids(4, 9))
    assert _quiet(load_workflow(path))[0] == {"both": "done", "either": "done", "more": "ran"}


def test_from_reruns_from_a_step_and_until_stops_after_one(tmp_path):
    path = _sets(tmp_path)
    wf = load_workflow(path)
    assert _quiet(wf, until="either")[0] == {"both": "ran", "either": "ran", "more": "not run"}
    assert not (wf.out / "more").exists()
    assert _quiet(wf, start="either")[0] == {"both": "done", "either": "ran", "more": "ran"}
    assert _quiet(wf, start="more", until="more")[0] == {"both": "done", "either": "done", "more": "ran"}
    with pytest.raises(WorkflowError, match="--until nope: no such step; steps: both, either, more"):
        wf.plan(until="nope")
    with pytest.raises(WorkflowError, match="--from more comes after --until both"):
        wf.plan(start="more", until="both")
    (wf.out / "both" / "subset.npy").unlink()
    with pytest.raises(WorkflowError, match=r"the steps before it are not all done \(both\)"):
        wf.plan(start="more")


def test_fingerprints_ignore_runtime_options_and_the_run_folder_s_place(tmp_path):
    demo = load_workflow("demo", [f"out={tmp_path / 'a'}"])
    moved = load_workflow("demo", [f"out={tmp_path / 'b'}", "steps.score.runtime.executor=local"])
    assert {n: s.fingerprint for n, s in demo.steps.items()} == {
        n: s.fingerprint for n, s in moved.steps.items()
    }
    # Inputs are named by step and resolve to the producing step's output.
    score = demo.command(demo.steps["score"])
    assert score[score.index("--meru") + 1] == str(tmp_path / "a" / "meru" / "model.safetensors")
    assert score[score.index("--class-images") + 1] == str(tmp_path / "a" / "world" / "eval/reference/train")
    assert score[-2:] == ["--executor", "ray"]
    # A variable reaches every step that uses it: they change, and so does every step reading them.
    bigger = load_workflow("demo", [f"out={tmp_path / 'a'}", "subset_samples=999"])
    changed = [n for n in demo.steps if bigger.steps[n].fingerprint != demo.steps[n].fingerprint]
    assert changed == ["train-hype", "eval-hype", "train-clip-score", "eval-clip-score", "train-random",
                       "eval-random", "results"]  # fmt: skip


@pytest.mark.parametrize("name", list_presets("workflows"))
def test_every_bundled_workflow_plans_and_dry_runs(name, tmp_path):
    wf = load_workflow(name, [f"out={tmp_path}"])
    text = wf.dry_run()
    assert text.count(": pending, runs") == len(wf.steps)
    assert all(f"{s.name}: pending" in text for s in wf.steps.values())


def test_hype_run_dry_run_and_bad_input_on_the_command_line(tmp_path):
    path = _sets(tmp_path)
    out = CliRunner().invoke(main, ["run", str(path), "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "[01/3] both: pending, runs" in out.output and "$ (hype run) intersect --subsets" in out.output
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    bad = CliRunner().invoke(main, ["run", str(path), "nope=1"])
    assert bad.exit_code == 2 and "nope=1: unknown key; set out, name, a, b, c, vars.NAME" in bad.output
    ran = CliRunner().invoke(main, ["run", str(path), "--until", "both"])
    assert ran.exit_code == 0, ran.output
    assert "hype run sets: 1 of 3 steps ran" in ran.output


@pytest.mark.parametrize(
    "step, message",
    [
        ({"name": "x", "run": "union", "inputs": {"subsets": ["later"]}}, "'later': no earlier step named"),
        ({"name": "x", "run": "union", "inputs": {"subsets": ["both.pool"]}}, "has no output 'pool'"),
        (
            {"name": "x", "run": "union", "args": {"subsets": ["{nope}"]}},
            "unknown variable {nope}; vars: a, b, c",
        ),
        ({"name": "both", "run": "union"}, "two steps have this name"),
        ({"name": "x", "run": "fly"}, "unknown step kind 'fly'"),
        ({"name": "a/b", "run": "union"}, "use letters, digits"),
        # runtime options stay out of the fingerprint, so one that changes the output would be skipped as
        # done when changed, and a runtime --out (the last one wins) would write outside OUT.
        ({"name": "x", "run": "union", "runtime": {"size": 4000}}, r"x\.runtime\.size: runtime holds only"),
        ({"name": "x", "run": "union", "runtime": {"out": "/tmp/x"}}, r"x\.runtime\.out: hype run writes"),
        ({"name": "x", "run": "union", "args": {"out": "/tmp/x"}}, r"x\.args\.out: hype run writes"),
        ({"name": "x", "run": "table", "args": {"caption": "{a:>3000000000}"}}, "widths and precisions"),
        ({"name": "x", "run": "table", "args": {"caption": "{a:.0%}"}}, r"\{a:\.0%\}: Unknown format code"),
    ],
)
def test_a_bad_workflow_names_the_file_the_step_and_the_fix(tmp_path, step, message):
    path = _sets(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["steps"].append(step)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message) as e:
        load_workflow(path)
    assert str(path) in str(e.value)


def test_hostile_workflow_files_are_refused_before_they_take_memory(tmp_path):
    """A 534-byte YAML alias bomb and a `{size:>3000000000}` spec each asked for gigabytes; both are now
    one-line errors naming the file (checked in a child process whose memory is capped)."""
    from memory_support import run_bounded

    levels = ["a: &a [" + ", ".join(['"lol"'] * 9) + "]"]
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    bomb = "out: o\nvars:\n" + "".join(f"  {line}\n" for line in levels)
    bomb += "steps: [{name: s, run: union, args: {subsets: '{i}'}}]\n"
    spec = "out: o\nvars: {size: 1}\nsteps: [{name: t, run: table, args: {caption: '{size:>3000000000}'}}]\n"
    (tmp_path / "bomb.yaml").write_text(bomb)
    (tmp_path / "spec.yaml").write_text(spec)
    setup = """
        from hype.config import ConfigError
        from hype.workflow import load_workflow
        def error(path):
            try:
                load_workflow(path)
            except ConfigError as e:
                return str(e)
        def errors(*paths):  # raised: run_bounded reports what its call raised
            raise RuntimeError([error(p) for p in paths])
    """
    result = run_bounded(setup, f"errors({str(tmp_path / 'bomb.yaml')!r}, {str(tmp_path / 'spec.yaml')!r})",
                         headroom_mb=256)  # fmt: skip
    assert result["error"].startswith("RuntimeError: ") and result["growth_mb"] < 64, result
    got = ast.literal_eval(result["error"].removeprefix("RuntimeError: "))
    expected = {"bomb": "aliases (*name) are not allowed", "spec": "widths"}
    for error, (name, message) in zip(got, expected.items(), strict=True):
        assert error.startswith(f"{tmp_path / name}.yaml: ") and message in error and "\n" not in error, got


def _plant(folder: Path, *names: str) -> Path:
    """Modules in `folder` that leave `folder/ran-<name>` behind if anything imports them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / f"{name}.py").write_text(f"open({str(folder / f'ran-{name}')!r}, 'w').close()\n")
    return folder


def _select_step(tmp_path: Path, scores: str) -> Path:
    """A one-step workflow whose `hype select` child fails at once on `scores` (no such run)."""
    spec = {"name": "one", "out": str(tmp_path / "run"), "steps": [
        {"name": "sel", "run": "select", "args": {"scores": scores, "frac": 0.2}}]}  # fmt: skip
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_step_never_imports_from_the_folder_hype_run_is_started_in(tmp_path, monkeypatch):
    cwd = _plant(tmp_path / "cwd", "hype", "filters")
    monkeypatch.chdir(cwd)
    wf = load_workflow(_select_step(tmp_path, str(tmp_path / "nope")))
    with pytest.raises(StepError, match="step 'sel' failed"):
        wf.run(echo=lambda _: None, progress=False)
    assert "no such run directory" in (wf.out / "logs" / "01-sel.log").read_text()  # hype's own select ran
    assert not list(cwd.glob("ran-*"))


@contextlib.contextmanager
def _s3_stub():
    """An HTTP endpoint answering 404 to every request; yields (its url, the requests it got)."""
    import http.server
    import threading

    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            seen.append(self.path)
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET  # noqa: N815

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_storage_options_of_hype_run_reach_its_steps_and_no_run_file(tmp_path, monkeypatch):
    from hype.io import storage

    secret = "not-a-real-secret-4711"
    with _s3_stub() as (given, to_given), _s3_stub() as (ambient, to_ambient):
        # Ambient credentials and endpoint (AWS_*): a step without hype run's options would go there.
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "ambient")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "ambient")
        monkeypatch.setenv("AWS_ENDPOINT_URL", ambient)
        monkeypatch.delenv(storage.ENV_OPTIONS, raising=False)
        wf = load_workflow(_select_step(tmp_path, "s3://bucket/run"))
        lines: list[str] = []
        storage.configure({"endpoint_url": given, "key": "k", "secret": secret})  # = hype --storage-options
        try:
            with pytest.raises(StepError, match="no such run directory"):
                wf.run(echo=lines.append, progress=False)
        finally:
            storage.configure(None)
    assert to_given and not to_ambient
    assert storage.ENV_OPTIONS not in os.environ  # the child's environment only
    files = [p for p in wf.out.rglob("*") if p.is_file()]
    assert files and not [p for p in files if secret in p.read_text(errors="replace")]
    assert secret not in "\n".join(lines)


def test_hype_run_and_hype_demo_never_replace_a_folder_they_did_not_make(tmp_path):
    # `serve` steps (the demo's world and pool) start over on every run: their folders were deleted.
    path = _sets(tmp_path, serve={"root": "both", "steps": ["either"]})
    precious = tmp_path / "run" / "either" / "precious.tar"
    precious.parent.mkdir(parents=True)
    precious.write_bytes(b"user data")
    out = CliRunner().invoke(main, ["run", str(path)])
    assert out.exit_code == 2 and f"{precious.parent}: hype run would replace it" in out.output, out.output
    assert "use another out= or remove it yourself" in out.output
    assert precious.read_bytes() == b"user data" and not (tmp_path / "run" / "both").exists()  # nothing ran
    # A step hype run does itself writes its output directly: a file in its place is refused too.
    precious.unlink()
    save_subset(tmp_path / "run" / "both" / "subset.npy", _uids(7))
    assert CliRunner().invoke(main, ["run", str(path)]).exit_code == 2
    assert _ints(tmp_path / "run" / "both" / "subset.npy") == [7]
    # What the workflow made, it replaces: the served step runs again on every run.
    (tmp_path / "run" / "both" / "subset.npy").unlink()
    for _ in range(2):
        assert CliRunner().invoke(main, ["run", str(path)]).exit_code == 0
    assert _ints(tmp_path / "run" / "either" / "subset.npy") == [1, 2, 3, 4, 5, 6]
    # hype demo: a `data/pool/shards/precious.tar` was gone after `--out data`.
    data = tmp_path / "data"
    (data / "pool" / "shards").mkdir(parents=True)
    (data / "pool" / "shards" / "precious.tar").write_bytes(b"user data")
    demo = CliRunner().invoke(main, ["demo", "--out", str(data), "--no-progress"])
    assert demo.exit_code == 2 and f"{data / 'pool'}: hype run would replace it" in demo.output, demo.output
    assert (data / "pool" / "shards" / "precious.tar").read_bytes() == b"user data"
    assert not (data / "world").exists()


# --- the demo workflow, killed in every step -----------------------------------------------------------


@background_run("demo_killed", timeout=900)
def _killed_command(folder: Path) -> list[str]:
    """The demo workflow killed in every step, then finished (tests/demo_killed.py), beside the suite."""
    return [sys.executable, str(Path(__file__).with_name("demo_killed.py")), str(folder)]


@pytest.fixture
def demo_killed(request) -> tuple[Path, subprocess.CompletedProcess]:
    """(its folder, its completed process): waits for the run started with the session."""
    return waited(request, "demo_killed")


def _digests(out: Path) -> dict[str, str]:
    """What the demo delivers: the subsets, the evaluation results and the results table."""
    files = [*sorted(out.glob("select-*/subset.npy")), *sorted(out.glob("eval-*/results.jsonl"))]
    digests = {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    digests["results.md"] = hashlib.sha256((out / "results.md").read_bytes()).hexdigest()
    result = json.loads((out / "results.json").read_text())
    digests["results.json"] = json.dumps({k: v for k, v in result.items() if k != "report"}, sort_keys=True)
    return digests


@pytest.mark.slow
def test_demo_workflow_killed_in_every_step_gives_the_outputs_of_an_uninterrupted_run(demo_run, demo_killed):
    # The uninterrupted run: the session's `hype demo` (Ray scoring, 2 download processes: neither
    # changes an output), made once for tests/test_demo.py too.
    base, whole = demo_run
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    # The interrupted one: `hype run demo` killed in each step in turn, each next run finishing that step
    # and killed in the next one, then run to the end (tests/demo_killed.py, started with the session).
    folder, last = demo_killed
    assert last.returncode == 0, last.stdout[-3000:] + last.stderr[-3000:]
    kills = json.loads((folder / "kills.json").read_text())
    killed, partial, out = kills["killed"], kills["partial"], folder / "killed"
    assert kills["steps"] == list(load_workflow("demo", [f"out={base}", *DEMO_VARS]).steps)

    # A kill landed in every step that runs a command (the table is written at once, atomically).
    assert [s for s in kills["steps"] if s not in killed] in ([], ["results"]), killed
    # The download, a scorer's and a subset's training and the scoring were cut with their outputs begun.
    assert {"pool", "meru", "score", "train-hype"} <= set(partial), partial
    assert (base / "results.md").read_text().count("\n| ") == 4  # the header and three subsets
    assert _digests(out) == _digests(base)
