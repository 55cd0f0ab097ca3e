"""Executors that run the stages of `hype` (local, Ray), as plug-ins of `hype.executor.EXECUTORS`.

Importing a module registers its executor; `hype` finds them through the `hype.executors` entry points
(`pyproject.toml`) and never imports this package (only `hype.cli`, which composes the layers, does).
The stages live in the library and do not know which executor runs them.
"""

from hype.pipelines import local, ray_executor  # noqa: F401 - importing them registers the executors
