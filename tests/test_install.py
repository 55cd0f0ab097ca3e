"""hype as a user installs it: the wheel and the sdist, each in a fresh virtual environment, run from a folder
outside the checkout. The presets ship inside the package (`hype/configs/`), the plug-ins live under hype's
own name (`hype.filters`, `hype.pipelines`), and nothing else is installed at the top level.

No network: the environment reuses this one's installed dependencies through a `.pth` file, and hype itself
is installed with `pip --no-deps --no-index`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("hype", "filters", "pipelines", "configs", "pyproject.toml", "README.md")  # what the build reads
PIP = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
BUILD = ["--no-deps", "--no-build-isolation", "--no-index"]


def _run(args: list[str], cwd: Path, env: dict | None = None) -> str:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(map(str, args))}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _run_together(commands: list[list[str]], cwd: Path, env: dict | None = None) -> None:
    """`_run` of independent commands started at once: each spends seconds importing torch and open_clip
    on one core, so two overlap on a second core. Every one must succeed; none outlives the call."""
    runs: list[tuple[list[str], subprocess.Popen, tempfile._TemporaryFileWrapper]] = []
    try:
        for args in commands:
            log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed below
            runs.append(
                (args, subprocess.Popen(args, cwd=cwd, env=env, stdout=log, stderr=log, text=True), log)
            )
        for args, proc, log in runs:
            proc.wait(timeout=300)
            log.seek(0)
            assert proc.returncode == 0, f"{' '.join(map(str, args))}:\n{log.read()[-6000:]}"
    finally:
        for _, proc, log in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """{"wheel": the wheel built from the source tree, "sdist": the wheel pip builds from the sdist}, both
    made from a copy of the checkout (a build writes build/ and *.egg-info beside its sources)."""
    tmp = tmp_path_factory.mktemp("dists")
    src = tmp / "src"
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        kwargs = {"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}
        copy(ROOT / name, src / name, **kwargs)
    code = "import sys; from setuptools import build_meta as b; b.build_sdist(sys.argv[1])"
    _run([sys.executable, "-c", code, str(tmp / "sdist")], cwd=src)
    (sdist,) = (tmp / "sdist").glob("hype-*.tar.gz")
    _run([*PIP, "wheel", *BUILD, "-w", str(tmp / "wheel"), "."], cwd=src)
    _run([*PIP, "wheel", *BUILD, "-w", str(tmp / "from-sdist"), str(sdist)], cwd=tmp)
    return {"wheel": next((tmp / "wheel").glob("*.whl")), "sdist": next((tmp / "from-sdist").glob("*.whl"))}


def test_the_wheel_holds_every_module_and_preset_under_hype_only(dists):
    """Every module of hype/, filters/ and pipelines/ and every preset of configs/ is in the wheel (and in
    the one built from the sdist), under `hype/`: no top-level `filters` or `pipelines` to collide with."""
    expected = {f"hype/{p.relative_to(ROOT / 'hype').as_posix()}" for p in (ROOT / "hype").rglob("*.py")}
    for folder in ("filters", "pipelines", "configs"):
        for p in (ROOT / folder).rglob("*"):
            if p.suffix in (".py", ".yaml"):
                expected.add(f"hype/{folder}/{p.relative_to(ROOT / folder).as_posix()}")
    names = {kind: set(zipfile.ZipFile(wheel).namelist()) for kind, wheel in dists.items()}
    assert names["wheel"] == names["sdist"]
    assert not expected - names["wheel"], (
        f"missing {sorted(expected - names['wheel'])} (pyproject's packages)"
    )
    tops = {n.split("/")[0] for n in names["wheel"] if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"hype"}, f"top-level names {sorted(tops)}"


@pytest.fixture(scope="module")
def installed(dists, tmp_path_factory):
    """`installed(kind, tmp_path)`: `hype ARGS` (-> its stdout) as installed from `dists[kind]` into a fresh
    environment, run in an empty folder under `tmp_path` outside the checkout without HYPE_CONFIG_DIR; that
    folder; `hype.together(ARGS, ARGS, ...)` runs independent commands at once. Each kind is installed once
    per module: the tests only run it, each in its own folder."""
    envs: dict[str, tuple[str, dict]] = {}

    def run_in(kind: str, tmp_path: Path):
        if kind not in envs:
            envs[kind] = _install(dists[kind], tmp_path_factory.mktemp(f"venv-{kind}"))
        python, env = envs[kind]
        cwd = tmp_path / "elsewhere"
        cwd.mkdir()
        where = _run([python, "-c", "import hype.filters; print(hype.filters.__file__)"], cwd, env)
        assert where.startswith(str(Path(python).parents[1])), where  # the installed copy, not the checkout

        def hype(*args: str) -> str:
            return _run(["hype", *args], cwd, env)

        hype.together = lambda *commands: _run_together([["hype", *args] for args in commands], cwd, env)
        return hype, cwd

    return run_in


def _install(dist: Path, tmp_path: Path) -> tuple[str, dict]:
    """A fresh environment under `tmp_path` with `dist` installed: its python and the variables to run it."""
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    python = str(venv / "bin" / "python")
    _run([*PIP, "--python", python, "install", "--no-deps", "--no-index", str(dist)], cwd=tmp_path)
    # The dependencies: this environment's, appended after the fresh one's own site-packages (added after
    # hype's install, so that pip installs it rather than find this environment's editable hype).
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path)
    (Path(site.strip()) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("HYPE_CONFIG_DIR", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return python, env


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_an_installed_hype_finds_its_presets_from_any_folder(installed, kind, tmp_path):
    hype, _ = installed(kind, tmp_path)
    listed = hype("train", "--list")
    assert "tiny-clip" in listed and "datacomp-small" in listed
    assert "pending, runs" in hype("run", "demo", "--dry-run", "out=d1")


@pytest.mark.slow
def test_an_installed_wheel_runs_synth_train_score_select(installed, tmp_path):
    """The smallest end-to-end chain, as a user who installed the wheel runs it (the sdist's wheel holds the
    same files: test_the_wheel_holds_every_module_and_preset_under_hype_only)."""
    hype, cwd = installed("wheel", tmp_path)
    hype("synth", "--out", "w", "--size", "150", "--shard-size", "50", "--clean-size", "50",
         "--eval-size", "10", "--reference-per-class", "1", "--workers", "1", "--no-progress")  # fmt: skip
    # the two trainings are independent: run at once
    hype.together(*(["train", "--config", model, "--data", "w/clean/shards", "--out", model,
                     "samples_seen=64", "batch_size=32", "--no-progress"]
                    for model in ("tiny-hyperbolic", "tiny-clip")))  # fmt: skip
    hype("score", "--config", "tiny", "--pool", "w/pool/shards", "--meru",
         "tiny-hyperbolic/model.safetensors", "--clip", "tiny-clip/model.safetensors",
         "--class-images", "w/eval/reference/train",
         "--out", "run", "--executor", "local", "--num-clusters", "4", "--no-progress", "batch_size=32",
         "threads=1", "reference.n_top=100", "reference.m=80")  # fmt: skip
    hype("select", "--scores", "run", "--frac", "0.2", "--out", "top.npy", "--no-progress")
    assert (cwd / "top.npy").is_file() and not (cwd / "configs").exists()


def test_listing_the_training_presets_imports_neither_torch_nor_the_models():
    """`hype train --list` reads YAML files only: it took 5-7 s (torch and open_clip imported by the training
    config's module) before its first line."""
    code = (
        "import sys; from hype.cli import main\n"
        "try:\n    main(['train', '--list'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print(sorted(m for m in ('torch', 'open_clip', 'hype.models') if m in sys.modules))"
    )
    listed = _run([sys.executable, "-c", code], ROOT)
    assert "tiny-clip" in listed and "datacomp-small" in listed
    assert listed.splitlines()[-1] == "[]"
