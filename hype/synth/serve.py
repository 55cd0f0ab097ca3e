"""A loopback HTTP server for a synthetic world's images, so that `hype download` runs offline.

    with serve_directory(world / "pool") as base_url:   # e.g. http://127.0.0.1:40123
        make_world(world, size=200, base_url=base_url)  # metadata urls now resolve
        download(world / "pool" / "metadata", out, allow_private_network=True)

The folder is looked up on every request, so the server may start before the folder exists (the demo
binds port 0 first, then writes the world with the actual port in its urls). Tests pass their own
handler class to add failure paths (404, slow responses, bytes that are not an image).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from os import PathLike
from pathlib import Path


class QuietHandler(SimpleHTTPRequestHandler):
    """Serves files under `directory`; no access log (it would interleave with progress bars)."""

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's signature
        pass


@contextmanager
def serve_directory(
    root: str | PathLike,
    host: str = "127.0.0.1",
    port: int = 0,
    handler: type[SimpleHTTPRequestHandler] = QuietHandler,
) -> Iterator[str]:
    """Serve `root` over HTTP on `host:port` (port 0: a free one) in a daemon thread; yields the base url
    (no trailing slash) and shuts the server down on exit."""
    factory = functools.partial(handler, directory=str(Path(root).resolve()))
    server = ThreadingHTTPServer((host, port), factory)
    server.daemon_threads = True  # a client that hangs up mid-response must not block shutdown
    thread = threading.Thread(target=server.serve_forever, name="hype-serve", daemon=True)
    thread.start()
    bound_host, bound_port = server.server_address[:2]
    try:
        yield f"http://{bound_host}:{bound_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
