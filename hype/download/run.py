"""`download`: a pool's images from its metadata, through img2dataset with DataComp's settings.

img2dataset does the downloading; hype adds what a pool needs around it:
- the settings scoring relies on are fixed (`FIXED`): parquet metadata with uid/url/text, `uid` in each
  sample's json, webdataset output, incremental mode (a rerun skips shards with a `_stats.json`);
- every download worker refuses private-network targets (`hype.download.network`) unless allowed: the
  Downloader img2dataset builds is swapped for `hype.download.worker.GuardedDownloader`, which installs
  the guard in the worker process before fetching, and first checks (here and in each worker) that
  img2dataset's own fetch goes through it: a probe url the guard always refuses must come back refused,
  else nothing is downloaded (fail closed); only http(s) urls are fetched, whatever the flags;
- img2dataset's download processes, and the Ray workers of a download that starts or joins Ray itself,
  cannot import torch (img2dataset pulls it in through webdataset and never uses it): seconds of CPU and
  hundreds of MB per process;
- the metadata is checked up front (files, columns, duplicate uids, urls refused by their host alone);
- img2dataset's own chatter (prints from the driver and every worker) goes to `OUT/_hype/img2dataset.log`
  and a progress bar over samples shows on stderr instead (its logger process, which only prints or
  reports to wandb, is not started unless wandb is on);
- a rerun must use the metadata and output settings of the first run (`OUT/_hype/layout.json`): shard
  ids are positions in the metadata, so anything else would mix two downloads in one folder;
- the outcome is read back from the shards' `_stats.json` into one summary, `OUT/_hype/summary.json`.
  It lives in a sub-folder because img2dataset treats every `OUT/*.json` as a shard's stats file. It is
  the download's completion marker (the run contract, `hype.io.runs`): state `done` once every shard is,
  with the fingerprint of the metadata files' identities and the settings that change a shard; a rerun
  that finds it with the same fingerprint, and every shard's `_stats.json` still there, returns it at once
  (`skipped`), reading no shard's stats.

OUT may be a URL (s3://...): img2dataset writes there itself through fsspec. hype's storage options
become fsspec's defaults in this process for the download's duration, and travel to every worker inside
the pickled downloader (also to Ray workers on other nodes), never through the environment; hype reads
the stats and markers back through `hype.io`, and its log is written locally and uploaded at the end.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from hype.download.config import DownloadConfig, load_download_config
from hype.download.metadata import DownloadError, MetadataPlan, plan_metadata
from hype.download.network import REFUSED, SCHEME_REFUSED, NetworkPolicy, install_guard
from hype.io import AnyPath, read_bytes, storage, write_bytes, write_json
from hype.io.runs import Marker, fingerprint, input_identity

# img2dataset arguments hype depends on: scoring reads webdataset shards with `uid` in each json.
FIXED: dict[str, Any] = {
    "input_format": "parquet",
    "url_col": "url",
    "caption_col": "text",
    "save_additional_columns": ["uid"],
    "output_format": "webdataset",
    "incremental_mode": "incremental",
}
# may change between a run and its resumption: they do not change what a shard holds
RUN_SETTINGS = ("processes_count", "thread_count", "timeout", "retries", "max_shard_retry", "enable_wandb")
RUN_SETTINGS += ("wandb_project", "user_agent_token")
ALLOW_PRIVATE = "pass --allow-private-network to download from private addresses (e.g. a local server)"
HYPE_DIR = "_hype"  # summary, log and the config used; not `OUT/*.json` (see the module docstring)


def stats_path(out: AnyPath, shard: int, digits: int) -> AnyPath:
    return out / f"{shard:0{digits}d}_stats.json"


def done_shards(out: AnyPath, plan: MetadataPlan, digits: int) -> set[int]:
    present = storage.list_sizes(out)  # one listing, also on object storage
    return {s for s, _ in plan.shards if stats_path(out, s, digits).name in present}


def download(
    metadata: str | os.PathLike,
    out: str | os.PathLike,
    *,
    config: DownloadConfig | str | os.PathLike | dict | None = None,
    distributor: str | None = None,
    allow_private_network: bool | None = None,
    progress: bool | None = None,
    ray_address: str | None = None,
) -> dict:
    """Download the images of a metadata folder (or one parquet file) into img2dataset webdataset shards
    in `out`; returns the summary (also written to `out/_hype/summary.json`). `config` is a
    `DownloadConfig`, a preset name, a YAML path or a dict (default: the `datacomp` preset); keyword
    arguments that are not None replace its values. A rerun skips finished shards. Raises
    `DownloadError` for bad input; shards that failed are listed in the summary (status `incomplete`)
    rather than raised."""
    cfg = config if isinstance(config, DownloadConfig) else load_download_config(config)
    changes = {
        "metadata": str(metadata),
        "out": str(out),
        "distributor": distributor,
        "allow_private_network": allow_private_network,
        "progress": progress,
        "ray_address": ray_address,
    }
    cfg = DownloadConfig.from_dict({**cfg.to_dict(), **{k: v for k, v in changes.items() if v is not None}})
    return run_download(cfg)


def run_download(cfg: DownloadConfig) -> dict:
    if cfg.metadata is None or cfg.out is None:
        raise DownloadError("missing --metadata or --out (or set them in the config)")
    i2d = cfg.img2dataset
    policy = NetworkPolicy(cfg.allow_private_network, cfg.networks())
    plan = plan_metadata(cfg.metadata, i2d.number_sample_per_shard, i2d.bbox_col, policy)
    out = storage.location(storage.absolute(cfg.out))
    storage.check_reachable(out)  # a missing bucket or refused credentials: before any download
    if any(_same_folder(out, f.parent) for f in plan.files) and storage.is_dir(cfg.metadata):
        raise DownloadError(
            f"{out}: --out is the metadata folder; shard parquet files would be read as metadata"
        )
    refused_upfront = sum(plan.refused.values())
    if plan.total_rows and refused_upfront == plan.total_rows:
        kinds = ", ".join(f"{n} {k}" for k, n in plan.refused.items())
        schemes = [k.endswith(": url") for k in plan.refused]  # refused whatever the flags
        hints = []
        if not all(schemes):
            hints.append(ALLOW_PRIVATE)
        if any(schemes):
            hints.append("only http(s) urls are downloaded")
        raise DownloadError(
            f"{cfg.metadata}: every url ({plan.total_rows}) is refused ({kinds}), e.g. "
            f"{plan.refused_examples[0]}; {'; '.join(hints)}"
        )
    hype_dir = out / HYPE_DIR
    marker = Marker(hype_dir / "summary.json")
    fp = _fingerprint(cfg, plan)
    digits = i2d.oom_shard_count
    before = done_shards(out, plan, digits)  # one listing
    finished = marker.done(fp)
    if finished is not None and len(before) == len(plan.shards):  # and no shard was removed since
        return _skipped(finished)
    storage.makedirs(hype_dir)
    _check_layout(hype_dir, cfg, plan, resuming=bool(before))
    write_json(hype_dir / "config.json", cfg.to_dict(), sort_keys=False)
    todo = [(s, n) for s, n in plan.shards if s not in before]
    start = time.perf_counter()
    if todo:
        kwargs = {**i2d.kwargs(), **FIXED, "distributor": cfg.distributor}
        kwargs["bbox_col"] = i2d.bbox_col if plan.has_bbox else None
        with (
            _log_file(hype_dir / "img2dataset.log") as log,
            _output_to(log) as terminal,
            _progress(out, todo, digits, cfg.progress, terminal),
        ):
            _run_img2dataset(str(cfg.metadata), out, kwargs, cfg, policy)
    seconds = time.perf_counter() - start
    summary = build_summary(cfg, plan, out, before, seconds)
    return marker.write(fp, "done" if summary["status"] == "complete" else "incomplete", **summary)


def _fingerprint(cfg: DownloadConfig, plan: MetadataPlan) -> str:
    """What the shards depend on: the metadata files (identity: size and mtime, or ETag) and the settings
    that change a shard or which urls are fetched; not those that only change how fast (`RUN_SETTINGS`)."""
    settings = {k: v for k, v in cfg.img2dataset.kwargs().items() if k not in RUN_SETTINGS}
    network = {"allow_private_network": cfg.allow_private_network, "networks": cfg.networks()}
    files = [input_identity(f) for f in plan.files]
    return fingerprint({"metadata": files, "settings": settings, "fixed": FIXED, "network": network})


def _skipped(summary: dict) -> dict:
    """The summary of a finished download, as the result of a rerun that had nothing to do."""
    shards = {**summary["shards"], "already_done": summary["shards"]["done"], "downloaded_now": 0}
    now = {"count": 0, "successes": 0}
    rerun = {"shards": shards, "this_run": now, "seconds": 0.0, "images_per_s": None, "skipped": True}
    return {**summary, **rerun}


def _check_layout(hype_dir: AnyPath, cfg: DownloadConfig, plan: MetadataPlan, resuming: bool) -> None:
    """Shard ids are positions in the metadata and outputs depend on the resize settings: a rerun that
    changed either would mix two downloads in one folder, so it is refused."""
    settings = {k: v for k, v in cfg.img2dataset.kwargs().items() if k not in RUN_SETTINGS}
    layout = {"files": [[f.name, n] for f, n in zip(plan.files, plan.rows, strict=True)], **settings}
    layout = json.loads(json.dumps(layout))  # inf -> Infinity and back, tuples -> lists: compare as stored
    path = hype_dir / "layout.json"
    if resuming and storage.is_file(path):
        stored = json.loads(read_bytes(path))
        changed = sorted(k for k in {*stored, *layout} if stored.get(k) != layout.get(k))
        if changed:
            raise DownloadError(
                f"{hype_dir.parent}: already holds shards downloaded with other {', '.join(changed)}; "
                "use a new --out, or the same metadata and settings to resume"
            )
    write_json(path, layout, sort_keys=False)


def _run_img2dataset(
    url_list: str, out: AnyPath, kwargs: dict, cfg: DownloadConfig, policy: NetworkPolicy
) -> None:
    # albumentations (imported by img2dataset) asks PyPI for a newer version on import, in every worker
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
    import img2dataset
    from tqdm import tqdm

    from hype.download.worker import GuardedDownloader, GuardNotInUse, protocols, verify_guard

    try:  # before any worker starts: each checks again before its first fetch
        with _guarded_here(policy) as opener:
            verify_guard(opener)
    except GuardNotInUse as e:
        raise DownloadError(str(e)) from None

    main = sys.modules["img2dataset.main"]  # the package's `main` attribute is a function of that name
    patches = {
        (main, "Downloader"): functools.partial(
            GuardedDownloader, policy=policy, storage_options=storage.snapshot()
        ),
        # its bar has no total; ours (over samples, with rate and ETA) replaces it
        (sys.modules["img2dataset.distributor"], "tqdm"): functools.partial(tqdm, disable=True),
        # its download processes start without torch (`_TorchlessContext`)
        (sys.modules["img2dataset.distributor"], "get_context"): _torchless_context,
    }
    if not cfg.img2dataset.enable_wandb:
        # its logger process only prints ratios (to the log) unless it reports to wandb; not starting it
        # saves a process that imports img2dataset (torch included) next to the download workers
        patches[(main, "LoggerProcess")] = _NoLogger
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with _patched(patches), _ray(cfg), _fsspec_options(protocols(out, url_list)):
            img2dataset.download(url_list=url_list, output_folder=str(out), **kwargs)
    except SystemExit as e:
        # img2dataset's SIGINT handler exits with status 0; an interrupted download is not a success
        raise KeyboardInterrupt from e
    finally:
        signal.signal(signal.SIGINT, sigint)  # img2dataset leaves its handler installed


@contextlib.contextmanager
def _guarded_here(policy: NetworkPolicy) -> Iterator[urllib.request.OpenerDirector]:
    """The guard installed in this process for the block, then this process's opener as it was."""
    saved = urllib.request._opener
    try:
        yield install_guard(policy)
    finally:
        urllib.request.install_opener(saved)


def _torchless_context(method: str) -> _TorchlessContext:
    """`multiprocessing.get_context` for img2dataset's process pool (its multiprocessing distributor)."""
    import multiprocessing

    return _TorchlessContext(multiprocessing.get_context(method))


class _TorchlessContext:
    """A multiprocessing context whose pools' processes cannot import torch: img2dataset imports it only
    through webdataset, which falls back to stand-ins without it, and never uses it to download. Importing
    it cost each download process ~1.5 s of CPU (half its start) and hundreds of MB of memory, again every
    `maxtasksperchild` (5) shards."""

    def __init__(self, ctx):
        self._ctx = ctx

    def Pool(self, processes=None, initializer=None, initargs=(), maxtasksperchild=None):  # noqa: N802
        return self._ctx.Pool(processes, _without_torch, (initializer, initargs), maxtasksperchild)

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)


def _without_torch(initializer: Callable | None, initargs: tuple) -> None:
    """A pool process's initializer (before its first task is unpickled, which imports img2dataset)."""
    block_torch()
    if initializer is not None:
        initializer(*initargs)


def block_torch() -> None:
    """Make `import torch` raise ModuleNotFoundError in this process, unless it is imported already: in
    img2dataset's download processes and in the Ray workers of a download this starts (its job's
    `worker_process_setup_hook`), which run nothing else."""
    sys.modules.setdefault("torch", None)


class _NoLogger:
    """Stands in for img2dataset's LoggerProcess (same calls, nothing done)."""

    def __init__(self, *args, **kwargs):
        self.done_shards: set[int] = set()

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        pass


@contextlib.contextmanager
def _patched(patches: dict) -> Iterator[None]:
    saved = {key: getattr(*key) for key in patches}
    for (module, name), value in patches.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)


def _same_folder(a: AnyPath, b: AnyPath) -> bool:
    if storage.is_url(a) or storage.is_url(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return Path(a).resolve() == Path(b).resolve()


@contextlib.contextmanager
def _fsspec_options(protocols: list[str]) -> Iterator[None]:
    """hype's storage options as fsspec's defaults for `protocols` (OUT's, the metadata's), for
    img2dataset's own fsspec calls in this process, for the download's duration (the workers get them
    from the downloader: `hype.download.worker.configure_fsspec`). Never written to a file."""
    import fsspec.config

    saved = {protocol: fsspec.config.conf.get(protocol) for protocol in protocols}
    for protocol in protocols:
        fsspec.config.conf[protocol] = storage.options_for(protocol)
    try:
        yield
    finally:
        for protocol, conf in saved.items():
            if conf is None:
                fsspec.config.conf.pop(protocol, None)
            else:
                fsspec.config.conf[protocol] = conf


@contextlib.contextmanager
def _log_file(log: AnyPath) -> Iterator[Path]:
    """A local file to append img2dataset's output to: `log` itself, or for a URL a local copy uploaded
    (the earlier runs' lines first) when the download ends."""
    if not storage.is_url(log):
        yield log
        return
    import tempfile

    fd, name = tempfile.mkstemp(prefix=".hype-img2dataset-", suffix=".log")
    os.close(fd)
    local = Path(name)
    try:
        yield local
    finally:
        before = read_bytes(log) if storage.is_file(log) else b""
        write_bytes(log, before + local.read_bytes())
        local.unlink(missing_ok=True)


@contextlib.contextmanager
def _ray(cfg: DownloadConfig) -> Iterator[None]:
    if cfg.distributor != "ray":
        yield
        return
    import logging

    import ray

    from hype.ray_driver import init_ray

    started = not ray.is_initialized()
    if started:
        try:
            init_ray(
                address=cfg.ray_address,
                include_dashboard=False,
                logging_level=logging.WARNING,
                # the job's workers run only img2dataset's downloads: no torch there (`_TorchlessContext`)
                runtime_env={"worker_process_setup_hook": "hype.download.run.block_torch"},
            )
        except ConnectionError as e:
            raise DownloadError(f"--ray-address {cfg.ray_address}: no Ray cluster reachable ({e})") from None
    try:
        yield
    finally:
        if started:
            ray.shutdown()


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[IO[str]]:
    """Send this process's output and that of the workers it starts (fds 1 and 2, inherited) to `log`;
    yields a stream on the original stderr for the progress bar."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    terminal = os.fdopen(os.dup(saved[2]), "w", buffering=1)
    with open(log, "a", buffering=1) as f:
        f.write(f"--- hype download {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        for fd in (1, 2):
            os.dup2(f.fileno(), fd)
        try:
            # sys.stdout may not be fd 1 (click's test runner, notebooks): redirect it as well
            with contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                yield terminal
        finally:
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            terminal.close()


@contextlib.contextmanager
def _progress(out: AnyPath, todo: list[tuple[int, int]], digits: int, enabled: bool, stream: IO[str]):
    """A bar over the samples of the shards to download, advanced as their `_stats.json` appear."""
    from tqdm import tqdm

    bar = tqdm(
        total=sum(n for _, n in todo),
        unit="img",
        desc="download",
        file=stream,
        disable=not enabled,
        dynamic_ncols=True,
    )
    pending = dict(todo)
    ok = 0
    stop = threading.Event()

    def poll() -> None:
        nonlocal ok
        present = storage.list_sizes(out)
        for shard in [s for s in pending if stats_path(out, s, digits).name in present]:
            stats = _read_stats(stats_path(out, shard, digits))
            if stats is None:
                continue  # being written; next poll
            ok += int(stats.get("successes", 0))
            n = pending.pop(shard)
            bar.set_postfix(ok=ok, shards_left=len(pending), refresh=False)
            bar.update(n)

    def loop(step: Callable[[], None]) -> None:
        while not stop.wait(2.0 if storage.is_url(out) else 0.25):  # a listing per poll on object storage
            step()

    thread = threading.Thread(target=loop, args=(poll,), daemon=True)
    if enabled:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if enabled:
            thread.join()
            poll()
        bar.close()


def _read_stats(path: AnyPath) -> dict | None:
    try:
        return json.loads(read_bytes(path))
    except (OSError, ValueError):
        return None


def build_summary(
    cfg: DownloadConfig, plan: MetadataPlan, out: AnyPath, before: set[int], seconds: float
) -> dict:
    digits = cfg.img2dataset.oom_shard_count
    totals = {"count": 0, "successes": 0, "failed_to_download": 0, "failed_to_resize": 0}
    now = {"count": 0, "successes": 0}
    reasons: dict[str, int] = {}
    failed: list[str] = []
    for shard, _ in plan.shards:
        stats = _read_stats(stats_path(out, shard, digits))
        if stats is None:
            failed.append(f"{shard:0{digits}d}")
            continue
        for key in totals:
            totals[key] += int(stats.get(key, 0))
        if shard not in before:
            now["count"] += int(stats.get("count", 0))
            now["successes"] += int(stats.get("successes", 0))
        for reason, n in (stats.get("status_dict") or {}).items():
            if reason != "success":
                reasons[reason] = reasons.get(reason, 0) + int(n)
    refused = sum(n for r, n in reasons.items() if REFUSED in r)
    refused_scheme = sum(n for r, n in reasons.items() if SCHEME_REFUSED in r)
    done = len(plan.shards) - len(failed)
    return {
        "status": "complete" if not failed else "incomplete",
        "metadata": str(cfg.metadata),
        "out": str(out),
        "config": cfg.name or None,
        "distributor": cfg.distributor,
        "allow_private_network": cfg.allow_private_network,
        "input": {
            "files": len(plan.files),
            "rows": plan.total_rows,
            "duplicate_uids": plan.duplicate_uids,
            "duplicate_examples": plan.duplicate_examples,
            "malformed_uids": plan.malformed_uids,  # no 32-hex uid: downloaded, but scoring skips them
            "malformed_examples": plan.malformed_examples,
            "refused_by_host": plan.refused,  # counted before downloading, from the urls alone
            "refused_examples": plan.refused_examples,
            "face_blurring": plan.has_bbox,
        },
        "shards": {
            "total": len(plan.shards),
            "done": done,
            "already_done": len(before),
            "downloaded_now": done - len(before),
            "failed": failed,  # no _stats.json: rerun the same command to retry them
        },
        "samples": {
            **totals,
            "failures_by_reason": dict(sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
            "refused_private_network": refused,
            "refused_scheme": refused_scheme,  # not http(s): file:, ftp:, data:, ... (after redirects too)
        },
        "this_run": now,
        "seconds": round(seconds, 3),
        "images_per_s": round(now["successes"] / seconds, 1) if seconds > 0 and now["successes"] else None,
        "log": str(out / HYPE_DIR / "img2dataset.log"),
        "summary_file": str(out / HYPE_DIR / "summary.json"),
    }


def format_summary(s: dict, top: int = 8) -> str:
    sh, sa, inp = s["shards"], s["samples"], s["input"]
    lines = [
        f"hype download: {sh['done']}/{sh['total']} shards in {s['out']} "
        f"({sh['downloaded_now']} downloaded now, {sh['already_done']} already done, "
        f"{len(sh['failed'])} failed)",
        f"  samples: {sa['count']} -> {sa['successes']} ok, {sa['failed_to_download']} failed to download, "
        f"{sa['failed_to_resize']} failed to resize",
    ]
    reasons = list(sa["failures_by_reason"].items())
    for reason, n in reasons[:top]:
        lines.append(f"    {n:>8}  {reason}")
    if len(reasons) > top:
        rest = sum(n for _, n in reasons[top:])
        lines.append(f"    {rest:>8}  ({len(reasons) - top} other reasons; see {s['summary_file']})")
    if sa["refused_private_network"] or sa.get("refused_scheme") or inp["refused_by_host"]:
        kinds = ", ".join(f"{n} {k}" for k, n in inp["refused_by_host"].items()) or "-"
        lines.append(
            f"  refused private network targets: {sa['refused_private_network']} samples, other schemes than "
            f"http(s): {sa.get('refused_scheme', 0)} (by url alone: {kinds}); --allow-private-network "
            "downloads from private addresses"
        )
    if inp["duplicate_uids"]:
        examples = ", ".join(inp["duplicate_examples"][:3])
        lines.append(
            f"  duplicate uids in the metadata: {inp['duplicate_uids']} repeated rows (e.g. {examples})"
        )
    if inp.get("malformed_uids"):
        examples = ", ".join(inp["malformed_examples"][:3])
        lines.append(
            f"  rows without a 32-hex uid: {inp['malformed_uids']} (e.g. {examples}); scoring, training and "
            "reshard skip them (README 'uids and subset files')"
        )
    rate = f", {s['images_per_s']} images/s" if s["images_per_s"] else ""
    lines.append(f"  time: {s['seconds']:.1f} s{rate}; summary: {s['summary_file']}")
    if sh["failed"]:
        lines.append(
            f"  failed shards: {', '.join(sh['failed'][:10])}{' ...' if len(sh['failed']) > 10 else ''} "
            f"(see {s['log']}); rerun the same command to retry them"
        )
    return "\n".join(lines)
