"""Plug-in registries: registration, duplicate names, and discovery through entry points."""

from __future__ import annotations

import sys

import pytest

from hype.plugins import Registry


def test_register_and_look_up():
    reg: Registry[type] = Registry("widgets-a")

    @reg.register
    class Widget:
        name = "w"

    assert reg.get("w") is Widget and "w" in reg and reg.names() == ["w"]
    reg.register(Widget)  # the same class again (a module imported twice) is fine
    with pytest.raises(ValueError, match="two widgets-a named 'w'"):
        reg.register(type("Other", (), {"name": "w"}))
    with pytest.raises(ValueError, match="no name"):
        reg.register(object)


def test_entry_points_are_loaded_on_first_miss(tmp_path, monkeypatch):
    """A package declaring `hype.widgets-b` entry points registers its classes when first needed."""
    pkg = tmp_path / "thirdparty_widgets"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from hype.plugins import Registry\n"
        "import tests_registry_holder as h\n"
        "class Blue:\n    name = 'blue'\n"
        "h.REG.register(Blue)\n"
    )
    holder = tmp_path / "tests_registry_holder.py"
    holder.write_text("from hype.plugins import Registry\nREG = Registry('widgets-b')\n")
    dist = tmp_path / "thirdparty_widgets-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-widgets\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[hype.widgets-b]\nblue = thirdparty_widgets\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import tests_registry_holder as h

    assert "thirdparty_widgets" not in sys.modules
    assert h.REG.get("blue").__name__ == "Blue"
    assert h.REG.names() == ["blue"] and h.REG.get("red") is None


def test_a_broken_plug_in_is_reported_not_fatal(tmp_path, monkeypatch, caplog):
    dist = tmp_path / "broken_widgets-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-widgets\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[hype.widgets-c]\nbad = no_such_module_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[type] = Registry("widgets-c")
    assert reg.get("bad") is None
    assert "could not load widgets-c plug-in bad" in caplog.text


def test_executor_choices_come_from_the_registry():
    """An installed executor is accepted by the score config and offered by every `--executor` option,
    with no list of names kept anywhere else."""
    from click.testing import CliRunner

    from hype.cli import main
    from hype.executor import EXECUTORS
    from hype.scoring.config import ExecutorConfig

    EXECUTORS.register(type("PluggedIn", (), {"name": "plugged-in"}))
    try:
        assert ExecutorConfig(kind="plugged-in").kind == "plugged-in"
        for command in ("score", "run", "demo"):
            res = CliRunner().invoke(main, [command, "--help"])
            assert res.exit_code == 0 and "plugged-in" in res.output, (command, res.output)
    finally:
        EXECUTORS._items.pop("plugged-in")


def test_every_command_shows_its_help_with_the_bundled_rules_and_without_torch():
    """Each command loads the bundled rules (filters/) first. They imported torch through hype.geometry, so
    `hype download --help` took 3.1 s (0.4 s without) and every `hype select` paid it."""
    import subprocess

    code = (
        "import sys, click, hype.cli as c\n"
        "root = click.Context(c.main, info_name='hype')\n"
        "for name in sorted(c.COMMANDS):\n"
        "    cmd = c.main.get_command(root, name)\n"
        "    assert 'Usage: hype ' + name in cmd.get_help(click.Context(cmd, info_name=name, parent=root))\n"
        "from hype.select.rules import RULES\n"
        "assert {'hype', 'negclip', 'normsim', 'dbp', 'combine'} <= set(RULES.names()), RULES.names()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_commands_that_build_no_model_run_without_open_clip(tmp_path):
    """open_clip (with timm, transformers and torchvision) takes ~4 s to import, 6 s on 2 loaded cores.
    `hype download` imported it for `ConfigError` (which is `hype.config`'s) in every download and every
    workflow's pool step: each command here runs its body (up to its first refusal) and imports none of
    it, nor torch."""
    import subprocess

    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from hype.cli import main\n"
        "for args in sys.argv[1:]:\n"
        "    res = CliRunner().invoke(main, args.split())\n"
        "    assert res.exit_code in (1, 2) and 'Error: ' in res.output, (args, res.output)\n"
        "print(sorted(m for m in ('torch', 'open_clip') if m in sys.modules))\n"
    )
    commands = [
        "download --metadata no-meta --out o",
        "select --scores no-run --frac 0.2 --out s.npy",
        "fit --scores no-run --labels l --out w",
        "reshard --pool no-pool --subset s.npy --out r",
        "submit --scale small --subset s.npy --eval-results e --out sub",
    ]
    out = subprocess.run(
        [sys.executable, "-c", code, *commands], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
