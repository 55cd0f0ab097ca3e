"""`hype download`: img2dataset with DataComp's settings against a loopback server serving a synthetic pool,
with broken urls (404, slow, not an image), resuming, and refusal of private-network targets."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from hype.cli import main
from hype.download import DownloadError, download, load_download_config
from hype.download.metadata import plan_metadata
from hype.download.network import REFUSED, SCHEME_REFUSED, NetworkPolicy, address_kind, guarded_opener
from hype.synth import make_world
from hype.synth.serve import QuietHandler, serve_directory

SLOW_S = 5.0  # the slow path answers after this; downloads use a 2 s timeout (a loaded 404 stays below)
FAST = ["--processes", "1", "--threads", "8", "--no-progress"]


class PoolHandler(QuietHandler):
    """Serves a world's pool; `/slow/`, `/notimage/` and `/redirect?to=URL` are the broken urls. Every
    request path is recorded in the class's `requests` (one subclass per server)."""

    requests: list[str]
    lock = threading.Lock()

    def do_GET(self) -> None:
        with self.lock:
            self.requests.append(self.path)
        path = urlsplit(self.path)
        try:
            if path.path.startswith("/late/"):  # the image at the rest of the path, 0.3 s late
                time.sleep(0.3)
                self.path = self.path[len("/late") :]
                super().do_GET()
            elif path.path.startswith("/slow/"):
                time.sleep(SLOW_S)
                self.send_error(404)
            elif path.path.startswith("/notimage/"):
                body = b"<html>this is not an image</html>"
                self.send_response(200)
                self.send_header("Content-Type", "image/jpeg")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif path.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", parse_qs(path.query)["to"][0])
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                super().do_GET()
        except OSError:
            pass  # the client gave up (timeout)


def counting_handler() -> type[PoolHandler]:
    return type("CountingHandler", (PoolHandler,), {"requests": []})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    handler = counting_handler()
    with serve_directory(root / "world" / "pool", handler=handler) as base_url:
        yield root, base_url, handler


@pytest.fixture(scope="module")
def world(server):
    root, base_url, handler = server
    # The server started before the world exists: the folder is looked up per request.
    make_world(root / "world", size=40, eval_size=10, reference_per_class=1, base_url=base_url, workers=1)
    return root / "world"


def _metadata(world: Path, folder: Path, base_url: str) -> tuple[pa.Table, pa.Table]:
    """meta/a.parquet: the pool (40 rows); meta/b.parquet: 2 x 404, 2 x slow, 2 x not an image, and one
    repeat of the first pool row (a duplicate uid with a valid url)."""
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    a = pq.read_table(src, columns=["uid", "url", "text"])
    broken = []
    for i, kind in enumerate(["404", "404", "slow", "slow", "notimage", "notimage"]):
        uid = f"{0xB0 + i:032x}"
        path = {"404": "images", "slow": "slow", "notimage": "notimage"}[kind]
        broken.append({"uid": uid, "url": f"{base_url}/{path}/{uid}.jpg", "text": f"broken {kind}"})
    first = a.slice(0, 1).to_pylist()[0]
    b = pa.Table.from_pylist([*broken, first], schema=a.schema)
    folder.mkdir()
    pq.write_table(a, folder / "a.parquet")
    pq.write_table(b, folder / "b.parquet")
    return a, b


def _members(tar: Path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(tar) as tf:
        for m in tf.getmembers():
            key, ext = m.name.split(".", 1)
            samples.setdefault(key, {})[ext] = tf.extractfile(m).read()
    return samples


def _shard_files(out: Path, shard: str) -> list[Path]:
    return [out / f"{shard}{suffix}" for suffix in (".tar", ".parquet", "_stats.json")]


@pytest.fixture(scope="module")
def first_run(world, server, tmp_path_factory):
    """One CLI download of the pool plus broken urls: (args, out, summary, a, b, request paths)."""
    _, base_url, handler = server
    tmp = tmp_path_factory.mktemp("first-run")
    a, b = _metadata(world, tmp / "meta", base_url)
    out = tmp / "out"
    args = ["download", "--metadata", str(tmp / "meta"), "--out", str(out), "--allow-private-network"]
    args += [*FAST, "--timeout", "2", "--retries", "1", "--samples-per-shard", "20", "--json"]
    handler.requests.clear()
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return args, out, json.loads(res.output), a, b, list(handler.requests)


@pytest.mark.slow
def test_download_pool_with_broken_urls(first_run):
    _, out, summary, a, b, requests = first_run
    assert summary == json.loads((out / "_hype" / "summary.json").read_text())

    # 40 + 7 rows in 20-sample shards: a.parquet -> 00000000, 00000001; b.parquet -> 00000002
    assert summary["status"] == "complete"
    assert summary["shards"] == {"total": 3, "done": 3, "already_done": 0, "downloaded_now": 3, "failed": []}
    for shard in ("00000000", "00000001", "00000002"):
        assert all(p.is_file() for p in _shard_files(out, shard))
    samples = summary["samples"]
    assert (samples["count"], samples["successes"]) == (47, 41)
    assert (samples["failed_to_download"], samples["failed_to_resize"]) == (4, 2)
    reasons = samples["failures_by_reason"]
    assert sum(n for r, n in reasons.items() if "404" in r) == 2
    assert sum(n for r, n in reasons.items() if "timed out" in r) == 2
    assert samples["refused_private_network"] == 0
    assert summary["input"]["duplicate_uids"] == 1
    assert summary["input"]["duplicate_examples"] == [a["uid"][0].as_py()]
    assert summary["input"]["malformed_uids"] == 0
    # --retries 1: every failing url was asked for twice
    for row in b.to_pylist()[:4]:
        assert requests.count(urlsplit(row["url"]).path) == 2

    # each sample: jpg + txt + json, and the json carries the metadata's uid for that url
    by_url = {r["url"]: r for r in [*a.to_pylist(), *b.to_pylist()]}
    seen = []
    for shard, source in (("00000000", a.slice(0, 20)), ("00000001", a.slice(20)), ("00000002", b)):
        members = _members(out / f"{shard}.tar")
        for key, files in members.items():
            assert set(files) == {"jpg", "txt", "json"} and key.startswith(shard)
            meta = json.loads(files["json"])
            assert meta["uid"] == by_url[meta["url"]]["uid"]
            assert files["txt"].decode() == by_url[meta["url"]]["text"]
            assert meta["url"] in source["url"].to_pylist()
            seen.append(meta["uid"])
    assert sorted(seen) == sorted([*a["uid"].to_pylist(), a["uid"][0].as_py()])


@pytest.mark.slow
def test_resume_redoes_only_missing_shards(first_run, server):
    """Remove one shard's outputs: the rerun fetches only its urls and leaves the other shards alone."""
    args, out, _, a, _, _ = first_run
    handler = server[2]
    kept = {
        p: (p.read_bytes(), p.stat().st_mtime_ns)
        for s in ("00000000", "00000002")
        for p in _shard_files(out, s)
    }
    before = _members(out / "00000001.tar")
    for p in _shard_files(out, "00000001"):
        p.unlink()
    handler.requests.clear()
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    again = json.loads(res.output)
    assert again["shards"] == {"total": 3, "done": 3, "already_done": 2, "downloaded_now": 1, "failed": []}
    assert (again["samples"]["count"], again["samples"]["successes"]) == (47, 41)
    assert sorted(handler.requests) == sorted(urlsplit(u).path for u in a["url"].to_pylist()[20:])
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in kept} == kept
    assert _members(out / "00000001.tar") == before

    # everything done: the download's marker has the same fingerprint, so the rerun reads nothing back
    # and writes nothing, and fetches nothing
    handler.requests.clear()
    summary = out / "_hype" / "summary.json"
    written = summary.stat().st_mtime_ns
    res = CliRunner().invoke(main, [*args, "--processes", "2"], catch_exceptions=False)  # not a setting
    assert res.exit_code == 0 and json.loads(res.output)["shards"]["downloaded_now"] == 0
    assert json.loads(res.output)["skipped"] is True and summary.stat().st_mtime_ns == written
    assert handler.requests == []
    # Changed metadata (its identity: rewritten): not skipped; the finished shards are kept (their ids are
    # positions in the metadata, which `_hype/layout.json` checks), the summary is read back again
    meta = Path(args[args.index("--metadata") + 1]) / "b.parquet"
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 10**9))
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0 and "skipped" not in json.loads(res.output)
    assert summary.stat().st_mtime_ns != written and handler.requests == []


@pytest.mark.slow
def test_workers_refuse_redirects_to_private_addresses(world, server, tmp_path):
    """Through img2dataset's real worker processes: 127.0.0.1 is allowed (allowed_networks), but neither a
    redirect to another loopback server, nor one to the cloud metadata address, nor a direct url to it."""
    _, base_url, handler = server
    other = counting_handler()
    with serve_directory(tmp_path, host="127.0.0.2", handler=other) as other_url:
        (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
        good = pq.read_table(src, columns=["uid", "url", "text"]).slice(0, 4).to_pylist()
        targets = [f"{other_url}/x.jpg", f"{other_url}/y.jpg", "http://169.254.169.254/latest/meta-data"]
        rows = [*good]
        for i, target in enumerate(targets):
            rows.append({"uid": f"{0xC0 + i:032x}", "url": f"{base_url}/redirect?to={target}", "text": "r"})
        rows.append({"uid": f"{0xD0:032x}", "url": f"{other_url}/direct.jpg", "text": "direct"})
        (tmp_path / "meta").mkdir()
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "meta" / "m.parquet")
        cfg = load_download_config(
            None,
            ["allowed_networks=127.0.0.1/32", "img2dataset.processes_count=1", "img2dataset.thread_count=4"]
            + ["img2dataset.retries=0", "img2dataset.timeout=2", "progress=false"],
        )
        handler.requests.clear()
        summary = download(tmp_path / "meta", tmp_path / "out", config=cfg)
    assert other.requests == []  # nothing reached the second server
    assert sum(1 for p in handler.requests if p.startswith("/redirect")) == 3
    assert summary["samples"]["successes"] == 4
    assert summary["samples"]["refused_private_network"] == 4
    assert summary["input"]["refused_by_host"] == {"loopback": 1}
    assert all(REFUSED in r for r in summary["samples"]["failures_by_reason"])


def test_refuses_loopback_pool_without_the_flag(world, server, tmp_path):
    _, _, handler = server
    handler.requests.clear()
    out = tmp_path / "out"
    res = CliRunner().invoke(
        main, ["download", "--metadata", str(world / "pool" / "metadata"), "--out", str(out), *FAST]
    )
    assert res.exit_code == 1
    assert "--allow-private-network" in res.output and "every url (40)" in res.output
    assert handler.requests == []
    assert not out.exists()


@pytest.mark.parametrize(
    "address, kind",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("10.1.2.3", "private"),
        ("192.168.0.1", "private"),
        ("fd00::1", "private"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("100.64.0.1", "non-global"),
        ("192.0.0.8", "non-global"),  # IETF protocol assignments; Python 3.11 calls it global
        ("198.18.0.1", "non-global"),
        ("fec0::1", "site-local"),  # Python 3.11 calls it global
        ("::127.0.0.1", "reserved"),  # IPv4-compatible (deprecated)
        # IPv6 forms that lead to an IPv4 address are judged by that address
        ("2002:7f00:1::1", "loopback"),  # 6to4 of 127.0.0.1
        ("2002:a9fe:a9fe::1", "link-local"),  # 6to4 of 169.254.169.254
        ("2002:808:808::1", None),  # 6to4 of 8.8.8.8
        ("64:ff9b::808:808", None),  # NAT64 of 8.8.8.8
        ("64:ff9b::7f00:1", "loopback"),  # NAT64 of 127.0.0.1
        ("64:ff9b::a00:1", "private"),
        ("64:ff9b:1::808:808", "private"),  # local-use NAT64
        ("2001:0:4136:e378:8000:63bf:f7f7:f7f7", None),  # Teredo: server 65.54.227.120, client 8.8.8.8
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", "loopback"),  # Teredo, client 127.0.0.1
        ("2001:0:a00:1:8000:63bf:f7f7:f7f7", "private"),  # Teredo, server 10.0.0.1
        ("2001:db8::1", "non-global"),
        ("8.8.8.8", None),
        ("2001:4860:4860::8888", None),
    ],
)
def test_address_kinds(address, kind):
    import ipaddress

    assert address_kind(ipaddress.ip_address(address)) == kind


def test_policy_allow_lists():
    assert NetworkPolicy().refusal("fe80::1%eth0") == "link-local"
    assert NetworkPolicy(allow_private=True).refusal("127.0.0.1") is None
    allowed = NetworkPolicy(allowed_networks=("10.2.0.0/16",))
    assert allowed.refusal("10.2.3.4") is None and allowed.refusal("10.3.0.1") == "private"
    assert allowed.refusal("::ffff:10.2.0.9") is None
    assert NetworkPolicy().host_refusal("LOCALHOST.") == "loopback"
    assert NetworkPolicy().host_refusal("[::1]") == "loopback"
    assert NetworkPolicy().host_refusal("example.com") is None
    assert allowed.refusal("2002:a02:304::1") is None and allowed.refusal("64:ff9b::a03:1") == "private"
    # schemes other than http(s) are refused whatever the policy allows
    for policy in (NetworkPolicy(), NetworkPolicy(allow_private=True)):
        assert [policy.scheme_refusal(s) for s in ("file", "FTP", "data", "gopher", "http", "HTTPS")] == [
            "file: url", "FTP: url", "data: url", "gopher: url", None, None
        ]  # fmt: skip


def test_guarded_opener_checks_every_connection(server, tmp_path):
    root, base_url, handler = server
    (root / "world").mkdir(exist_ok=True)
    port = urlsplit(base_url).port
    refuse_all = guarded_opener(NetworkPolicy())
    handler.requests.clear()
    for url in (f"{base_url}/x", f"http://localhost:{port}/x", f"http://[::ffff:127.0.0.1]:{port}/x"):
        with pytest.raises(urllib.error.URLError, match=REFUSED):
            refuse_all.open(url, timeout=5)
    for opener in (refuse_all, guarded_opener(NetworkPolicy(allow_private=True))):
        for url in (Path("/etc/hostname").as_uri(), "data:,secret", "ftp://127.0.0.1/x", "gopher://x/"):
            with pytest.raises(urllib.error.URLError, match=SCHEME_REFUSED):
                opener.open(url, timeout=5)
    assert handler.requests == []

    local_only = guarded_opener(NetworkPolicy(allowed_networks=("127.0.0.1/32",)))
    with pytest.raises(urllib.error.HTTPError) as e:  # allowed: the server answers (404)
        local_only.open(f"{base_url}/missing.jpg", timeout=5)
    assert e.value.code == 404
    targets = ["http://127.0.0.2:9/x", "http://169.254.169.254/latest/meta-data", "http://10.0.0.1/"]
    for target in targets:
        with pytest.raises(urllib.error.URLError, match=REFUSED):
            local_only.open(f"{base_url}/redirect?to={target}", timeout=5)
    assert handler.requests == ["/missing.jpg", *(f"/redirect?to={t}" for t in targets)]


def test_serve_directory_starts_before_the_folder_exists(tmp_path):
    with serve_directory(tmp_path / "later") as base_url:
        (tmp_path / "later").mkdir()
        (tmp_path / "later" / "a.txt").write_text("hello")
        assert urllib.request.urlopen(f"{base_url}/a.txt", timeout=5).read() == b"hello"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{base_url}/a.txt", timeout=5)


def _write(path: Path, **columns) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)


def test_metadata_plan_and_errors(tmp_path):
    policy = NetworkPolicy()
    uids = [f"{i:032x}" for i in range(32)]
    urls = [f"https://example.com/{i}.jpg" for i in range(30)] + ["http://127.0.0.1/a", "file:///etc/passwd"]
    _write(tmp_path / "m" / "a.parquet", uid=uids[:25], url=urls[:25], text=["t"] * 25)
    _write(tmp_path / "m" / "b.parquet", uid=uids[25:] + uids[:2], url=urls[25:] + urls[:2], text=["t"] * 9)
    plan = plan_metadata(tmp_path / "m", 10, "face_bboxes", policy)
    # img2dataset numbers shards across the sorted files, ceil(rows / 10) per file
    assert plan.shards == [(0, 10), (1, 10), (2, 5), (3, 9)]
    assert plan.duplicate_uids == 2 and sorted(plan.duplicate_examples) == uids[:2]
    assert plan.refused == {"loopback": 1, "file: url": 1} and not plan.has_bbox
    assert plan_metadata(tmp_path / "m" / "a.parquet", 10, None, policy).shards == [(0, 10), (1, 10), (2, 5)]

    (tmp_path / "empty").mkdir()
    with pytest.raises(DownloadError, match="no .parquet files"):
        plan_metadata(tmp_path / "empty", 10, None, policy)
    _write(tmp_path / "bad" / "c.parquet", uid=["a"], link=["https://x/1.jpg"])
    with pytest.raises(DownloadError, match=r"c\.parquet: missing column\(s\) url, text"):
        plan_metadata(tmp_path / "bad", 10, None, policy)
    (tmp_path / "m.csv").write_text("url\n")
    with pytest.raises(DownloadError, match="not a .parquet file"):
        plan_metadata(tmp_path / "m.csv", 10, None, policy)


def test_config_defaults_are_datacomps_and_overridable(tmp_path):
    cfg = load_download_config()
    i2d = cfg.img2dataset
    assert (i2d.image_size, i2d.resize_mode, i2d.resize_only_if_bigger) == (512, "keep_ratio_largest", True)
    assert (i2d.number_sample_per_shard, i2d.oom_shard_count, i2d.retries) == (10_000, 8, 2)
    assert (i2d.encode_format, i2d.enable_wandb, cfg.allow_private_network) == ("jpg", False, False)
    assert i2d.kwargs()["max_aspect_ratio"] == float("inf")
    cfg = load_download_config("datacomp", ["img2dataset.timeout=0.5", "distributor=ray"])
    assert (cfg.img2dataset.timeout, cfg.distributor) == (0.5, "ray")

    res = CliRunner().invoke(
        main, ["download", "--metadata", str(tmp_path), "--out", "o", "img2dataset.tread=1"]
    )
    assert (
        res.exit_code == 2 and "img2dataset.tread: unknown key" in res.output and "thread_count" in res.output
    )
    res = CliRunner().invoke(
        main, ["download", "--metadata", str(tmp_path), "--out", "o", "--resize-mode", "x"]
    )
    assert res.exit_code == 2
    res = CliRunner().invoke(main, ["download", "--metadata", str(tmp_path), "--out", str(tmp_path / "o")])
    assert res.exit_code == 1 and "no .parquet files" in res.output and str(tmp_path) in res.output


@pytest.mark.slow
def test_ray_distributor_downloads_and_guards(world, server, tmp_path, ray_cluster, monkeypatch):
    """Without --ray-address, as a Ray job started by `ray job submit` runs it: Ray joins the cluster that
    RAY_ADDRESS names (here the session's test cluster; starting a local Ray instead took 8.3 s to start
    and 1.7 s to stop on 2 cores, of this test's ~11 s), hype's code path is a local start's. Then
    img2dataset imported in each Ray worker (without torch, which it never uses to download), the network
    guard in each."""
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    monkeypatch.setenv("NO_ALBUMENTATIONS_UPDATE", "1")
    import img2dataset.main  # noqa: F401 - the module whose distributor is wrapped below

    main_module = sys.modules["img2dataset.main"]  # the package's `main` attribute is the function
    real = main_module.ray_distributor
    seen = []

    def probing(*args):  # a task of the download's job, then its downloads
        import ray

        probe = ray.remote(lambda: (__import__("img2dataset"), sys.modules.get("torch", 0) is None)[1])
        seen.extend(ray.get([probe.options(num_cpus=1).remote() for _ in range(2)]))
        return real(*args)

    monkeypatch.setattr(main_module, "ray_distributor", probing)
    _, base_url, handler = server
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    rows = pq.read_table(src, columns=["uid", "url", "text"]).slice(0, 10).to_pylist()
    rows.append({"uid": f"{0xE0:032x}", "url": f"{base_url}/redirect?to=http://10.0.0.1/x.jpg", "text": "r"})
    (tmp_path / "meta").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "meta" / "m.parquet")
    cfg = load_download_config(
        None, ["allowed_networks=127.0.0.1/32", "img2dataset.number_sample_per_shard=6", "progress=false"]
    )
    assert cfg.ray_address is None
    summary = download(tmp_path / "meta", tmp_path / "out", config=cfg, distributor="ray")
    assert summary["shards"]["done"] == 2 and summary["distributor"] == "ray"
    assert summary["samples"]["successes"] == 10
    assert summary["samples"]["refused_private_network"] == 1
    assert seen == [True, True]


def test_resuming_with_other_settings_is_refused(tmp_path):
    """A finished shard is never fetched again; a rerun whose shard layout or resize settings differ
    from the first run's is refused instead of mixing two downloads in one folder."""
    n = 5
    _write(
        tmp_path / "m" / "a.parquet",
        uid=[f"{i:032x}" for i in range(n)],
        url=[f"https://example.com/{i}.jpg" for i in range(n)],
        text=["t"] * n,
    )
    out = tmp_path / "out"
    out.mkdir()
    stats = {"count": n, "successes": 4, "failed_to_download": 1, "failed_to_resize": 0}
    stats["status_dict"] = {"success": 4, "HTTP Error 404: Not Found": 1}
    (out / "00000000_stats.json").write_text(json.dumps(stats))
    cfg = load_download_config(None, ["progress=false"])
    summary = download(tmp_path / "m", out, config=cfg)  # everything done: img2dataset is not started
    assert summary["shards"] == {"total": 1, "done": 1, "already_done": 1, "downloaded_now": 0, "failed": []}
    assert summary["samples"]["failures_by_reason"] == {"HTTP Error 404: Not Found": 1}
    assert not (out / "_hype" / "img2dataset.log").exists()

    again = load_download_config(None, ["progress=false", "img2dataset.timeout=3", "img2dataset.retries=0"])
    assert download(tmp_path / "m", out, config=again)["status"] == "complete"  # run settings may change
    other = load_download_config(None, ["progress=false", "img2dataset.image_size=256"])
    with pytest.raises(DownloadError, match="other image_size; use a new --out"):
        download(tmp_path / "m", out, config=other)


def test_behind_a_proxy_the_target_is_checked_not_the_proxy(server, monkeypatch):
    """A proxy on a private address (here the loopback test server) stays usable; private targets are
    still refused before anything is sent to the proxy."""
    _, base_url, handler = server
    for var in ("no_proxy", "NO_PROXY", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("http_proxy", base_url)
    opener = guarded_opener(NetworkPolicy())
    handler.requests.clear()
    for url in ("http://127.0.0.3/x", "http://10.0.0.1/x", "http://localhost/x"):
        with pytest.raises(urllib.error.URLError, match=REFUSED):
            opener.open(url, timeout=5)
    assert handler.requests == []
    with pytest.raises(urllib.error.HTTPError):  # the proxy (our server) gets the request and answers 404
        opener.open("http://203.0.114.1/x.jpg", timeout=5)
    assert handler.requests == ["http://203.0.114.1/x.jpg"]


# The bucket tests' download settings (with the bucket's --storage-options), and their local reference.
POOL_ARGS = ["download", "--allow-private-network", *FAST, "--samples-per-shard", "20", "--json"]


@pytest.fixture(scope="module")
def pool_download(world, server, s3_server, tmp_path_factory):
    """The pool's metadata (uid, url, text) in a folder of its own, downloaded to local disk with the
    bucket tests' settings, once for both of them: (the metadata folder, its download, the summary)."""
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    tmp = tmp_path_factory.mktemp("pool-download")
    (tmp / "meta").mkdir()
    pq.write_table(pq.read_table(src, columns=["uid", "url", "text"]), tmp / "meta" / "a.parquet")
    options = ["--storage-options", json.dumps(s3_server.options)]
    args = [*options, *POOL_ARGS, "--metadata", str(tmp / "meta"), "--out", str(tmp / "out")]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return tmp / "meta", tmp / "out", json.loads(res.output)


@pytest.mark.slow
def test_download_to_object_storage_holds_the_local_shards(pool_download, tmp_path, s3):
    """--out on S3 (credentials only in --storage-options, so img2dataset's worker gets them from hype):
    the same samples, parquet rows and stats as a local --out; a rerun skips the finished shards."""
    from hype.io import read_bytes, read_parquet, storage

    meta, local_out, local = pool_download
    root = f"s3://{s3.bucket()}"
    args = ["--storage-options", json.dumps(s3.options), *POOL_ARGS, "--metadata", str(meta)]
    res = CliRunner().invoke(main, [*args, "--out", f"{root}/out"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    remote = json.loads(res.output)
    assert remote["shards"] == local["shards"] == {
        "total": 2, "done": 2, "already_done": 0, "downloaded_now": 2, "failed": []
    }  # fmt: skip
    assert remote["samples"] == local["samples"] and local["samples"]["successes"] == 40
    assert json.loads(read_bytes(f"{root}/out/_hype/summary.json")) == remote
    assert read_bytes(f"{root}/out/_hype/layout.json") == (local_out / "_hype" / "layout.json").read_bytes()
    assert b"--- hype download" in read_bytes(f"{root}/out/_hype/img2dataset.log")
    for shard in ("00000000", "00000001"):
        tar = tmp_path / "remote.tar"
        storage.download(storage.location(f"{root}/out/{shard}.tar"), tar)
        assert _members(tar) == _members(local_out / f"{shard}.tar")
        # Rows in the order the downloads finished: compared by key.
        ours = pq.read_table(local_out / f"{shard}.parquet").sort_by("key")
        assert read_parquet(f"{root}/out/{shard}.parquet").sort_by("key").equals(ours)
    res = CliRunner().invoke(main, [*args, "--out", f"{root}/out"], catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(res.output)["shards"]["already_done"] == 2


def test_metadata_in_a_bucket_downloads_the_same_pool(pool_download, tmp_path, s3):
    """--metadata on S3 (a folder and one file): read by hype's plan and by img2dataset's reader with
    hype's storage options; the same shards as from the local metadata. A wrong URL and --out equal to
    the metadata folder are refused with the URL named."""
    from hype.io import storage

    meta, local_out, local = pool_download
    root = f"s3://{s3.bucket()}"
    storage.upload(meta / "a.parquet", storage.location(f"{root}/meta/a.parquet"))
    options = ["--storage-options", json.dumps(s3.options)]
    base = POOL_ARGS
    summaries = {}
    for name, meta_url in (("folder", f"{root}/meta"), ("file", f"{root}/meta/a.parquet")):
        args = [*options, *base, "--metadata", meta_url, "--out", str(tmp_path / name)]
        res = CliRunner().invoke(main, args, catch_exceptions=False)
        assert res.exit_code == 0, res.output
        summaries[name] = json.loads(res.output)
    for name in ("folder", "file"):
        assert summaries[name]["shards"] == local["shards"]
        assert summaries[name]["samples"] == local["samples"]
        assert summaries[name]["samples"]["successes"] == 40
        for shard in ("00000000", "00000001"):
            assert _members(tmp_path / name / f"{shard}.tar") == _members(local_out / f"{shard}.tar")

    res = CliRunner().invoke(
        main, [*options, *base, "--metadata", f"{root}/nope", "--out", str(tmp_path / "x")]
    )
    assert res.exit_code != 0 and f"{root}/nope: no such file or folder" in res.output
    res = CliRunner().invoke(main, [*options, *base, "--metadata", f"{root}/meta", "--out", f"{root}/meta"])
    assert res.exit_code != 0 and "--out is the metadata folder" in res.output


def test_a_missing_bucket_is_named(world, tmp_path, s3):
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    args = ["download", "--metadata", str(src), "--out", "s3://no-such-bucket-hype/out", *FAST]
    res = CliRunner().invoke(main, [*args, "--allow-private-network"])
    assert res.exit_code == 1 and "s3://no-such-bucket-hype/out: the bucket does not exist" in res.output


def test_metadata_uids_are_read_as_scoring_reads_them(tmp_path):
    """Duplicates are counted on canonical uids (`normalize_uid`: case and surrounding whitespace do not
    make another uid); rows without a uid are counted apart, with examples."""
    b = "b" * 32
    uids = [b, "B" * 32, f" {b}\n", f"{1:032x}", "0x" + b[2:], None, "12ab"]
    _write(
        tmp_path / "m" / "a.parquet",
        uid=uids,
        url=[f"https://example.com/{i}" for i in range(7)],
        text=["t"] * 7,
    )
    plan = plan_metadata(tmp_path / "m", 10, None, NetworkPolicy())
    assert plan.duplicate_uids == 2 and plan.duplicate_examples == [b]
    assert plan.malformed_uids == 3 and plan.malformed_examples == [repr("0x" + b[2:]), "None", "'12ab'"]


def test_a_shard_is_on_disk_before_its_marker_says_done(world, server, tmp_path, monkeypatch):
    """img2dataset writes a shard's tar and parquet, then its `_stats.json` (what counts a shard as done,
    for hype and for img2dataset's resume), and syncs none of them. Through the real img2dataset run with
    hype's worker (placed in this process so that os.fsync can be watched): the tar and parquet are synced
    before the marker exists, the marker after, then the folder holding all three."""
    monkeypatch.setenv("NO_ALBUMENTATIONS_UPDATE", "1")  # no question to PyPI when img2dataset is imported
    import img2dataset.main  # noqa: F401 - the module whose distributor is replaced below

    out = tmp_path / "out"
    events: list[tuple[str, bool]] = []
    real_fsync = os.fsync

    def fsync(fd):
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        events.append((name, (out / "00000000_stats.json").exists()))
        return real_fsync(fd)

    def in_this_process(processes_count, downloader, reader, _, max_shard_retry):
        for row in reader:
            assert downloader(row)[0]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(sys.modules["img2dataset.main"], "multiprocessing_distributor", in_this_process)
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    (tmp_path / "meta").mkdir()
    rows = pq.read_table(src, columns=["uid", "url", "text"]).slice(0, 3)
    pq.write_table(rows, tmp_path / "meta" / "m.parquet")
    cfg = load_download_config(None, ["allowed_networks=127.0.0.1/32", "progress=false"])
    summary = download(tmp_path / "meta", out, config=cfg)
    assert summary["samples"]["successes"] == 3
    shard = [e for e in events if e[0].startswith("00000000") or e[0] == "out"]
    shard = shard[next(i for i, e in enumerate(shard) if e[0] != "out") :]  # after the reorder's renames
    assert shard[:2] in ([("00000000.parquet", False), ("00000000.tar", False)],
                         [("00000000.tar", False), ("00000000.parquet", False)])  # fmt: skip
    assert shard[2:] == [("out", False), ("00000000_stats.json", True), ("out", True)]


def test_download_processes_start_without_torch(world, server, tmp_path, monkeypatch):
    """img2dataset imports torch (through webdataset, which has stand-ins without it) and never uses it to
    download: each download process paid ~1.5 s of CPU and hundreds of MB for it, again every 5 shards.
    Here img2dataset's distributor, during a real download, starts a process from the context it gets
    (hype's) and has it load hype's downloader there: no torch; then runs the shards in this process."""
    monkeypatch.setenv("NO_ALBUMENTATIONS_UPDATE", "1")
    import img2dataset.main  # noqa: F401 - the module whose distributor is replaced below

    distributor = sys.modules["img2dataset.distributor"]
    probe = "(__import__('hype.download.worker'), __import__('sys').modules.get('torch') is None)[1]"
    seen = []

    def probing(processes_count, downloader, reader, _, max_shard_retry):
        with distributor.get_context("spawn").Pool(1, maxtasksperchild=5) as pool:
            seen.append(pool.apply(eval, (probe,)))
        for row in reader:
            assert downloader(row)[0]

    monkeypatch.setattr(sys.modules["img2dataset.main"], "multiprocessing_distributor", probing)
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    (tmp_path / "meta").mkdir()
    pq.write_table(
        pq.read_table(src, columns=["uid", "url", "text"]).slice(0, 2), tmp_path / "meta" / "m.parquet"
    )
    cfg = load_download_config(None, ["allowed_networks=127.0.0.1/32", "progress=false"])
    assert download(tmp_path / "meta", tmp_path / "out", config=cfg)["samples"]["successes"] == 2
    assert seen == [True]
    assert sys.modules.get("torch", "never imported") is not None  # this process's imports are untouched


def test_local_files_are_refused_even_with_allow_private_network(world, server, tmp_path):
    """--allow-private-network opens private addresses, never other schemes: a `file://` url of an image on
    this machine (read by urllib if asked), directly or behind a redirect, ends up in no shard."""
    _, base_url, _ = server
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    good = pq.read_table(src, columns=["uid", "url", "text"]).slice(0, 3).to_pylist()
    image = next((world / "pool" / "images").glob("*.jpg")).as_uri()
    secret = [
        {"uid": f"{0xF0:032x}", "url": image, "text": "a local file"},
        {"uid": f"{0xF1:032x}", "url": f"{base_url}/redirect?to={image}", "text": "redirected there"},
    ]
    (tmp_path / "meta").mkdir()
    pq.write_table(pa.Table.from_pylist([*good, *secret]), tmp_path / "meta" / "m.parquet")
    args = ["download", "--metadata", str(tmp_path / "meta"), "--out", str(tmp_path / "out")]
    res = CliRunner().invoke(main, [*args, "--allow-private-network", *FAST, "--timeout", "5", "--json"])
    summary = json.loads(res.output)
    assert summary["samples"]["successes"] == 3 and summary["samples"]["refused_scheme"] == 1
    assert summary["input"]["refused_by_host"] == {"file: url": 1}
    uids = {json.loads(s["json"])["uid"] for s in _members(tmp_path / "out" / "00000000.tar").values()}
    assert uids == {r["uid"] for r in good}
    # the redirect: urllib refuses a redirect to file: itself ("redirection ... not allowed")
    assert any("redirect" in r.lower() for r in summary["samples"]["failures_by_reason"])


def test_a_download_stops_when_img2dataset_fetches_around_the_guard(tmp_path, monkeypatch):
    """The guard works only if img2dataset fetches with urllib's installed opener: a version that opened
    urls another way (here: its own opener) is detected before anything is fetched, and refused."""
    monkeypatch.setenv("NO_ALBUMENTATIONS_UPDATE", "1")
    monkeypatch.setattr(urllib.request, "_opener", urllib.request._opener)  # this process's, restored after
    from img2dataset import downloader

    real = downloader.download_image

    def around_the_guard(row, timeout, *args):
        key, url = row
        try:
            return key, io.BytesIO(urllib.request.build_opener().open(url, timeout=timeout).read()), None
        except Exception as e:  # noqa: BLE001 - as img2dataset reports errors
            return key, None, str(e)

    n = 3
    _write(tmp_path / "m" / "a.parquet", uid=[f"{i:032x}" for i in range(n)],
           url=[f"https://example.com/{i}.jpg" for i in range(n)], text=["t"] * n)  # fmt: skip
    monkeypatch.setattr(downloader, "download_image", around_the_guard)
    with pytest.raises(DownloadError, match="img2dataset does not fetch through hype's network guard"):
        download(tmp_path / "m", tmp_path / "out", config=load_download_config(None, ["progress=false"]))
    assert not (tmp_path / "out" / "00000000.tar").exists()
    monkeypatch.setattr(downloader, "download_image", real)
    from hype.download.network import install_guard
    from hype.download.worker import verify_guard

    verify_guard(install_guard(NetworkPolicy(allow_private=True)))  # the real one passes, in both modes
    verify_guard(install_guard(NetworkPolicy()))


@pytest.mark.slow
def test_ray_workers_on_a_cluster_write_to_the_bucket_with_the_storage_options(
    world, server, tmp_path, s3, ray_cluster
):
    """`--distributor ray` on a running cluster whose nodes were started without any credentials: the
    workers get the bucket's endpoint and keys from hype (with the task), not from their environment."""
    from hype.io import read_bytes, storage

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "FSSPEC_S3"):
        assert name not in os.environ  # nothing a worker could have inherited
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    (tmp_path / "meta").mkdir()
    pq.write_table(
        pq.read_table(src, columns=["uid", "url", "text"]).slice(0, 10), tmp_path / "meta" / "m.parquet"
    )
    out = f"s3://{s3.bucket()}/ray-out"
    args = ["--storage-options", json.dumps(s3.options), "download", "--metadata", str(tmp_path / "meta")]
    args += ["--out", out, "--distributor", "ray", "--ray-address", ray_cluster, "--allow-private-network"]
    res = CliRunner().invoke(main, [*args, "--samples-per-shard", "5", "--no-progress", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output)
    assert summary["shards"]["done"] == 2 and summary["samples"]["successes"] == 10
    for shard in ("00000000", "00000001"):
        assert json.loads(read_bytes(f"{out}/{shard}_stats.json"))["successes"] == 5
        assert storage.exists(f"{out}/{shard}.tar")
    assert s3.options["secret"] not in res.output


def test_rows_without_a_valid_uid_are_reported(first_run):
    """The plan's count of rows whose uid scoring would skip reaches the summary and its text."""
    from hype.download.run import format_summary

    summary = json.loads(json.dumps(first_run[2]))
    summary["input"] |= {"malformed_uids": 2, "malformed_examples": ["'0x12'", "None"]}
    text = format_summary(summary)
    assert "rows without a 32-hex uid: 2 (e.g. '0x12', None)" in text
    assert "without a 32-hex uid" not in format_summary(first_run[2])


def test_shards_hold_metadata_order_whatever_the_thread_count(world, server, tmp_path):
    """img2dataset writes samples as their downloads finish: with 8 threads the first rows (served late)
    came last. Each shard is rewritten in key (metadata) order with a fixed mtime, so 1 and 8 threads give
    byte-identical tars and parquets; webdataset still reads them, and the stats still count them."""
    import webdataset as wds

    _, base_url, _ = server
    (src,) = sorted((world / "pool" / "metadata").glob("*.parquet"))
    rows = pq.read_table(src, columns=["uid", "url", "text"]).slice(0, 24).to_pylist()
    for row in rows[:3]:
        row["url"] = row["url"].replace(base_url, base_url + "/late")
    (tmp_path / "meta").mkdir()
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "meta" / "a.parquet")
    outs = {}
    for threads in ("1", "8"):
        outs[threads] = out = tmp_path / f"out{threads}"
        args = ["download", "--metadata", str(tmp_path / "meta"), "--out", str(out)]
        args += ["--allow-private-network", "--processes", "1", "--threads", threads, "--no-progress"]
        args += ["--samples-per-shard", "12"]
        res = CliRunner().invoke(main, args, catch_exceptions=False)
        assert res.exit_code == 0, res.output
    for shard in ("00000000", "00000001"):
        for suffix in (".tar", ".parquet"):
            name = f"{shard}{suffix}"
            assert (outs["1"] / name).read_bytes() == (outs["8"] / name).read_bytes()
    tars = str(outs["8"] / "{00000000..00000001}.tar")
    uids = [json.loads(s["json"])["uid"] for s in wds.WebDataset(tars, shardshuffle=False)]
    assert uids == [r["uid"] for r in rows]
    parquet = pa.concat_tables([pq.read_table(outs["8"] / f"0000000{i}.parquet") for i in (0, 1)])
    assert parquet.column("uid").to_pylist() == uids
    stats = json.loads((outs["8"] / "00000000_stats.json").read_text())
    assert stats["successes"] == 12 and not [p for p in outs["8"].iterdir() if p.name.startswith(".")]
