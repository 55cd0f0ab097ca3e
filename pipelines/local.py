"""In-process executor: runs a per-shard stage over shards in this process (laptop, one GPU node, tests).

The stage is copied the way Ray would ship it (pickled settings only), set up once (models loaded
once), then run shard by shard; parallelism lives inside the stage (decode threads, torch threads, the
GPU). Skipping finished shards, retries (`retries` extra attempts, then the shard is reported as failed
and the others go on) and stats are `hype.executor.Executor`'s. A crash of the process itself is
survived by rerunning: finished shards are skipped.
"""

from __future__ import annotations

from typing import Any

from hype.executor import EXECUTORS, PoolExecutor


@EXECUTORS.register
class LocalExecutor(PoolExecutor):
    name = "local"
    in_process = True  # started with the driver: no start-up to count, models shared with the driver

    def __init__(self, retries: int = 2):
        super().__init__(workers=1, retries=retries)

    @classmethod
    def from_config(cls, cfg: Any) -> LocalExecutor:
        """From a `hype.scoring.config.ScoreConfig`."""
        return cls(retries=cfg.executor.retries)
