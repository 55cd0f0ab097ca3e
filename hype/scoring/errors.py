"""The errors of a `hype score` run (`hype.scoring.runner`): here, below the run context and the stage files
(`hype.scoring.context`, `stage_*.py`), so the driver steps raise them without importing the runner."""

from __future__ import annotations


class ScoreError(RuntimeError):
    """A run that cannot start or finish; the message says what to do."""


class ScoreFailed(RuntimeError):
    """Some shards failed after their retries; `summary` lists them. Rerunning retries them."""

    def __init__(self, message: str, summary: dict):
        super().__init__(message)
        self.summary = summary


__all__ = ["ScoreError", "ScoreFailed"]
