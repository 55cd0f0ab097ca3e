"""In-process executor: runs a per-shard stage over shards in this process (laptop, one GPU node, tests).

The stage is copied the way Ray would ship it (pickled settings only), set up once (models loaded
once), then run shard by shard; parallelism lives inside the stage (decode threads, torch threads, the
GPU). A shard whose run raises is retried up to `retries` times, then reported as failed; the other
shards go on. A crash of the process itself is survived by rerunning: finished shards are skipped.
"""

from __future__ import annotations

import copy
import logging
import traceback
from collections.abc import Callable

from hype.scoring.stagebase import StageSetupError

log = logging.getLogger(__name__)


class LocalExecutor:
    name = "local"

    def __init__(self, retries: int = 2):
        self.retries = retries

    def __enter__(self) -> LocalExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def map(self, stage, tasks: list, on_result: Callable[[object, dict], None]) -> list[dict]:
        """Run `stage` on every task; call `on_result(task, stats)` as each finishes; return failures
        `[{"shard", "shard_id", "attempts", "error"}]`."""
        if not tasks:
            return []
        # A copy through the object's own reduce protocol, as Ray ships it: setup() state stays off `stage`.
        worker = copy.deepcopy(stage)
        try:
            worker.setup()
        except Exception as e:  # noqa: BLE001 - every shard would fail the same way
            raise StageSetupError(f"{stage.name} setup failed: {type(e).__name__}: {e}") from e
        failures = []
        try:
            for task in tasks:
                for attempt in range(1, self.retries + 2):
                    try:
                        stats = worker.run(task)
                    except Exception as e:  # noqa: BLE001 - one shard's failure must not stop the others
                        error = f"{type(e).__name__}: {e}"
                        log.warning("%s: %s failed (attempt %d): %s", task.path, stage.name, attempt, error)
                        log.debug("%s", traceback.format_exc())
                        if attempt > self.retries:
                            failures.append(
                                {
                                    "shard": task.path,
                                    "shard_id": task.shard_id,
                                    "attempts": attempt,
                                    "error": error,
                                }
                            )
                        continue
                    stats = dict(stats, attempts=attempt)
                    on_result(task, stats)
                    break
        finally:
            teardown = getattr(worker, "teardown", None)
            if teardown is not None:
                teardown()
            del worker
        return failures
