"""Layers that only point down: every import in hype/, filters/ and pipelines/, checked against the layering.

    core      hype (the package root), hype.geometry, hype.data, hype.models, hype.io, hype.losses,
              hype.text, hype.config, hype.plugins, hype.executor, hype.ray_driver, hype.checkpoint,
              hype.table (the scores table that scoring writes and every later stage reads)
    stages    hype.synth, hype.download, hype.train, hype.scoring, hype.select, hype.reshard, hype.eval,
              hype.report, hype.submit, hype.convert
    plug-ins  hype.filters (selection rules, the folder filters/), hype.pipelines (executors, pipelines/)
    top       hype.cli, hype.demo, hype.workflow and hype.fit_proxy (they compose the stages; the demo runs
              them as child `hype` processes), and every `__main__` module (a program, not library code)

The rule, for every import statement (module level or inside a function; `importlib.import_module` of a
literal name too):
1. a module imports its own layer or a lower one, never a higher one (so the library never imports a
   plug-in, and nothing but a program imports `hype.cli`);
2. a plug-in package never imports another plug-in package: each registers itself (`hype.plugins`);
3. a stage imports another stage only along an edge listed in `STAGE_EDGES`, each with the reason it is
   there (today: a later stage reading what an earlier one wrote or did: the report redoing the selection
   subset.json records, a submission checked against eval's tasks, the concept audit joining scoring's
   cluster outputs). Anything else two stages share belongs in core (the scores table: `hype.table`);
   an error type that several stages raise lives in the lowest module that raises it
   (`hype.data.errors.SelectError`).
4. inside core, a package imports only packages before it in `CORE_ORDER` (lowest first), except along
   an edge listed in `CORE_EXCEPTIONS`;
5. no two top-level packages import each other, directly or round a longer loop, except a cycle listed
   in `CYCLES` (each with the plan that removes it);
6. no two modules (files) import each other, directly or round a longer loop, with no exception: an
   import inside a function only hides a loop, so what both need moves to a module both import.
Inside one top-level package (`hype.select.*` among themselves) imports are free. A new `hype.*` package
fails the test until it is given a layer here. Every allow-list entry (a layer, an edge, a cycle) must
still be in use: one that no longer is fails the test, so the lists never allow more than is used.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("hype", "filters", "pipelines")  # the repository's top-level code folders
# Their import names (pyproject's package-dir: the folder filters/ installs as hype.filters).
PACKAGE_DIR = {
    folder: name
    for name, folder in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].items()
}
FIRST_PARTY = ("hype",)

CORE, STAGE, PLUGIN, TOP = 0, 1, 2, 3
LAYER_NAMES = {CORE: "core", STAGE: "stage", PLUGIN: "plug-in", TOP: "top"}
LAYERS: dict[str, int] = {
    "hype": CORE,  # hype/__init__.py: __version__
    **{
        f"hype.{name}": CORE
        for name in (
            "geometry",
            "data",
            "models",
            "io",
            "losses",
            "text",
            "config",
            "plugins",
            "executor",
            "ray_driver",
            "table",
        )
    },
    "hype.checkpoint": CORE,
    **{
        f"hype.{name}": STAGE
        for name in (
            "synth",
            "download",
            "train",
            "scoring",
            "select",
            "reshard",
            "eval",
            "report",
            "submit",
            "convert",
        )
    },
    "hype.filters": PLUGIN,
    "hype.pipelines": PLUGIN,
    "hype.cli": TOP,
    "hype.demo": TOP,
    "hype.workflow": TOP,
    "hype.fit_proxy": TOP,
}

# (importing stage, imported module of another stage) -> why the edge is there.
STAGE_EDGES: dict[tuple[str, str], str] = {
    (
        "hype.submit",
        "hype.eval.tasks",
    ): "a submission's results are checked against eval's DataComp task list",
    ("hype.submit", "hype.eval.report"): "a submission records the aggregates hype eval reports",
    ("hype.report", "hype.scoring.decontam"): "the report shows the matches scoring's decontamination wrote",
    ("hype.report", "hype.select.audit"): "the report draws the audits that subset.json records",
    ("hype.report", "hype.select.run"): "the report redoes the selection that subset.json records",
    ("hype.report", "hype.select.explain"): "the report's gallery explains dropped samples as explain does",
    ("hype.select", "hype.scoring.clusters"): "the concept audit joins the run's k-means assignments by uid",
    ("hype.select", "hype.scoring.embed_format"): "the concept audit reads the uids of the embed outputs",
}

# The core packages, lowest first: each may import only those before it.
CORE_ORDER: list[str] = [
    "hype",
    "hype.ray_driver",
    "hype.text",
    "hype.plugins",
    "hype.geometry",
    "hype.io",
    "hype.losses",
    "hype.config",
    "hype.data",
    "hype.table",
    "hype.executor",
    "hype.models",
    "hype.checkpoint",
]
# (importing core module, imported core module) against CORE_ORDER -> why.
CORE_EXCEPTIONS: dict[tuple[str, str], str] = {}
# Import cycles between top-level packages -> the plan that removes each.
CYCLES: dict[frozenset[str], str] = {}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE_DIR.get(parts[0], parts[0]), *parts[1:]])


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for top in FOLDERS for p in sorted((ROOT / top).rglob("*.py"))}


def owner(module: str) -> str:
    """The top-level package a module belongs to: `hype.select.run` -> `hype.select`, `hype.filters.hype`
    -> `hype.filters`."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "hype" and len(parts) > 1 else parts[0]


def layer(module: str) -> int | None:
    if module.split(".")[-1] == "__main__":
        return TOP
    return LAYERS.get(owner(module))


def imports(module: str, path: Path, known: set[str]) -> set[str]:
    """First-party modules `module` imports anywhere in its source (`from a.b import c` names `a.b.c` when
    that is a module, else `a.b`)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                package = module.split(".")[: len(module.split(".")) - (node.level - is_package)]
                base = ".".join([*package, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            targets = [node.args[0].value]
        found.update(t for t in targets if t.split(".")[0] in FIRST_PARTY)
    return found


def edges() -> set[tuple[str, str]]:
    modules = all_modules()
    known = set(modules)
    return {(m, target) for m, path in modules.items() for target in imports(m, path, known)}


def violation(src: str, dst: str) -> str | None:
    """Why the import `src` -> `dst` breaks the layering, or None."""
    a, b = layer(src), layer(dst)
    if a is None or b is None:
        return f"{owner(src if a is None else dst)} has no layer: add it to LAYERS in tests/test_layers.py"
    if b > a:
        return f"upward: {LAYER_NAMES[a]} imports {LAYER_NAMES[b]}"
    if a == b == PLUGIN and owner(src) != owner(dst):
        return "one plug-in package imports another"
    if a == b == STAGE and owner(src) != owner(dst) and (owner(src), dst) not in STAGE_EDGES:
        return "a stage imports another stage (move what they share down to core, or list it in STAGE_EDGES)"
    return None


def test_the_walk_sees_every_kind_of_import():
    """The checker itself: absolute, relative, function-level and importlib imports are all found."""
    modules = all_modules()
    known = set(modules)
    assert "hype.select.rules" in imports("hype.filters.hype", modules["hype.filters.hype"], known)
    assert "hype.cli.train" in imports("hype.train.__main__", modules["hype.train.__main__"], known)
    assert "hype.filters" in imports("hype.cli", modules["hype.cli"], known)  # importlib.import_module(...)
    assert "hype.data.uids" in imports("hype.submit", modules["hype.submit"], known)  # inside a function
    assert violation("hype.select.run", "hype.filters.hype") == "upward: stage imports plug-in"
    assert violation("hype.filters.hype", "hype.cli") == "upward: plug-in imports top"
    assert violation("hype.data.uids", "hype.select.errors") == "upward: core imports stage"
    assert violation("hype.filters.hype", "hype.pipelines.local") == "one plug-in package imports another"
    assert violation("hype.reshard.run", "hype.select.errors").startswith("a stage imports another stage")
    assert violation("hype.cli.select", "hype.filters") is None
    assert violation("hype.filters.hype", "hype.select") is None


def test_relative_imports_are_resolved(tmp_path):
    (tmp_path / "__init__.py").write_text("from . import rules\nfrom .table import Batch\n")
    (tmp_path / "run.py").write_text("from ..data import uids\nfrom .rules import Rule\n")
    known = {"hype.select.rules", "hype.data.uids"}
    package, run = tmp_path / "__init__.py", tmp_path / "run.py"
    assert imports("hype.select", package, known) == {"hype.select.rules", "hype.select.table"}
    assert imports("hype.select.run", run, known) == {"hype.data.uids", "hype.select.rules"}


def test_layers_only_point_down():
    found = edges()
    bad = sorted(f"{src} -> {dst}: {why}" for src, dst in found if (why := violation(src, dst)) is not None)
    assert not bad, "imports that break the layering (see tests/test_layers.py):\n" + "\n".join(bad)


def test_allowlists_hold_only_live_edges():
    """An allowed edge that no longer occurs leaves the lists, so they never allow more than is used."""
    found = edges()
    stage_edges = {(owner(src), dst) for src, dst in found}
    assert not [e for e in STAGE_EDGES if e not in stage_edges], "STAGE_EDGES lists an edge no module uses"


def test_layers_name_only_packages_that_exist():
    owners = {owner(m) for m in all_modules()}
    assert not [p for p in LAYERS if p not in owners], "LAYERS names a package that no longer exists"
    assert sorted(CORE_ORDER) == sorted(p for p, n in LAYERS.items() if n == CORE), "CORE_ORDER != core"


def test_core_packages_import_only_lower_ones():
    found = edges()
    core = [(s, d) for s, d in found if owner(s) != owner(d) and layer(s) == layer(d) == CORE]
    rank = {p: i for i, p in enumerate(CORE_ORDER)}
    bad = [(s, d) for s, d in core if rank[owner(d)] > rank[owner(s)] and (s, d) not in CORE_EXCEPTIONS]
    assert not bad, "core imports against CORE_ORDER (tests/test_layers.py): " + str(sorted(bad))
    assert not [e for e in CORE_EXCEPTIONS if e not in found], "CORE_EXCEPTIONS lists an edge no module uses"


def package_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node, packages or modules (Tarjan's algorithm,
    iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_package_cycles_finds_loops():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert package_cycles(graph) == [frozenset("abc")]


def test_no_import_cycles_between_packages():
    graph: dict[str, set[str]] = {}
    for src, dst in edges():
        if owner(src) != owner(dst) and not src.endswith("__main__"):  # a program, not its package's code
            graph.setdefault(owner(src), set()).add(owner(dst))
    cycles = package_cycles(graph)
    assert not [sorted(c) for c in cycles if c not in CYCLES], "import cycles between packages"
    assert not [sorted(c) for c in CYCLES if c not in cycles], "CYCLES lists a cycle that no longer exists"


def test_no_import_cycles_between_modules():
    """No file imports itself round a loop, not even through an import inside a function (such an import
    only postpones the loop to run time): what two modules share lives in a module both import."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges():
        if src != dst:
            graph.setdefault(src, set()).add(dst)
    loops = [
        "; ".join(f"{m} imports {', '.join(sorted(graph[m] & c))}" for m in sorted(c))
        for c in package_cycles(graph)
    ]
    assert not loops, "import cycles between modules (move what they share down):\n" + "\n".join(
        sorted(loops)
    )


# What hype.io may import besides the standard library and itself (docs/DESIGN.md §9), per module.
IO_IMPORTS = {"numpy", "pyarrow", "fsspec", "upath"}
IO_TORCH = {"hype.io.weights", "hype.io.torchscript"}  # torch, safetensors: imported by name only


def test_io_imports_only_what_design_says():
    import sys

    bad = []
    for module, path in all_modules().items():
        if owner(module) != "hype.io":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for top in {n.split(".")[0] for n in names}:
                torch = {"torch", "safetensors"} if module in IO_TORCH else set()
                allowed = IO_IMPORTS | {"hype", "__future__"} | torch
                if top not in sys.stdlib_module_names and top not in allowed:
                    bad.append(f"{module} imports {top}")
        if module in IO_TORCH:
            assert module not in imports("hype.io", all_modules()["hype.io"], set(all_modules()))
    assert not bad, bad
