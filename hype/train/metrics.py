"""Training metrics: one JSON object per logged step in `OUT/metrics.jsonl`, and the end summary.

On resume the file is cut back to the steps up to the checkpoint being resumed, so every step appears
once and the file reads like one uninterrupted run. Object storage cannot append: for a URL the log is
kept in a local file and uploaded whole at every checkpoint (`sync`) and at the end.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from hype.io import read_bytes, storage, write_bytes, write_text
from hype.io.runs import Marker


class MetricsLog:
    """Append-only JSON-lines log (rank 0 only)."""

    def __init__(self, path: str | os.PathLike, resume_step: int):
        self.path = storage.location(path)
        self._remote = storage.is_url(self.path)
        kept = []
        if resume_step > 0 and storage.is_file(self.path):
            for line in read_bytes(self.path).decode("utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a kill
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= resume_step:
                    kept.append(line)
        text = "".join(line + "\n" for line in kept)
        write_text(self.path, text)
        local = self.path
        if self._remote:
            fd, name = tempfile.mkstemp(prefix=".hype-metrics-", suffix=".jsonl")
            os.close(fd)
            local = Path(name)
            local.write_text(text)
        self._f = open(local, "a", buffering=1)

    def write(self, row: dict[str, Any]) -> None:
        self._f.write(json.dumps(_finite(row), sort_keys=False) + "\n")

    def sync(self) -> None:
        """Make the rows written so far visible at `path` (a URL: one upload of the whole log)."""
        if self._remote and not self._f.closed:
            self._f.flush()
            write_bytes(self.path, Path(self._f.name).read_bytes())

    def close(self) -> None:
        self.sync()
        self._f.close()
        if self._remote:
            Path(self._f.name).unlink(missing_ok=True)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    text = read_bytes(path).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _finite(value: Any) -> Any:
    # JSON has no NaN/inf: write them as strings so the file stays valid JSON for every reader.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_summary(path: str | os.PathLike, summary: dict[str, Any], fp: str, state: str) -> None:
    """The run's summary, which is also its marker (`hype.train.state`): `state` "done" once the final
    model is published, else the run's status."""
    Marker(path).write(fp, state, **_finite(summary))


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def format_summary(s: dict[str, Any]) -> str:
    """The short human summary printed at the end of `hype train`."""
    status = s["status"]
    head = {
        "completed": "training complete",
        "stopped": f"stopped at max_steps={s.get('max_steps')}",
        "interrupted": "interrupted (signal); resume with the same command",
        "diverged": "DIVERGED",
        "already_complete": "nothing to do: the run in this folder is already complete",
    }.get(status, status)
    lines = [f"hype train {s['name']}: {head}"]
    lines.append(
        f"  steps            {s['step']}/{s['total_steps']}   samples seen {s['samples_seen']:,}"
        f"/{s['samples_seen_target']:,}   (global batch {s['batch_size']}, {s['world_size']} process(es))"
    )
    if s.get("resumed_from_step"):
        lines.append(f"  resumed from     step {s['resumed_from_step']}")
    lines.append(
        f"  time             {_fmt_duration(s['train_time_s'])} training this session"
        f"   throughput {s['samples_per_s']:.1f} samples/s (steady state {s['steady_samples_per_s']:.1f})"
    )
    final = s.get("final") or {}
    if final:
        parts = [f"{k} {v:.4g}" for k, v in final.items() if isinstance(v, (int, float)) and v is not None]
        lines.append("  final            " + ", ".join(parts))
    skips = s.get("skipped", {}).get("counts", {})
    if skips:
        lines.append("  skipped          " + ", ".join(f"{k} {v}" for k, v in sorted(skips.items())))
        for reason, msgs in sorted(s["skipped"].get("examples", {}).items()):
            if msgs:
                lines.append(f"    e.g. {reason}: {msgs[0]}")
    if s.get("empty_shards"):
        lines.append(f"  empty shards     {len(s['empty_shards'])} left out, e.g. {s['empty_shards'][0]}")
    if s.get("subset"):
        sub = s["subset"]
        lines.append(f"  subset           {sub['path']} ({sub['subset_uids']:,} uids)")
        if sub.get("sampler"):
            d = sub["sampler"]
            lines.append(
                f"  sampler          {d['kind']} by {d['column']} of {d['scores']}: {d['drawn']:,} draws, "
                f"{d['unique']:,} of {d['candidates']:,} samples, at most {d['max_repeats']} each"
            )
    if s.get("checkpoint"):
        lines.append(f"  checkpoint       {s['checkpoint']}")
    if s.get("model"):
        lines.append(f"  model            {s['model']}")
    lines.append(f"  metrics          {s['metrics']}   summary {s['summary']}")
    if s.get("error"):
        lines.append(f"  error            {s['error']}")
    return "\n".join(lines)
