"""Run the tiles of a dense (rows x cols) computation on every CPU core, one whole tile per core at a time.

Why not torch's own intra-op threads: the epilogue after a matmul is a chain of cheap elementwise passes.
With intra-op threading every pass is a fork/join across all cores, so one core delayed by another
process (machines running the scorer are shared) stalls every pass, and a block big enough to amortize
the fork/join no longer fits a core's L2 cache, so every pass goes to DRAM. Here each thread takes a tile
from a shared queue and runs it start to finish with single-threaded torch (torch releases the GIL
inside its ops): the passes stay in that core's cache and a slow core just takes fewer tiles.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

# work(rows, cols, scratch): one tile; `scratch` is a dict private to the thread for reusable buffers.
TileWork = Callable[[slice, slice, dict], None]


def _even(n: int, most: int) -> int:
    """The tile length <= `most` that splits n into the fewest, nearly equal tiles."""
    parts = -(-n // max(most, 1)) if n else 1
    return max(1, -(-n // parts))


def tile_grid(
    rows: int, cols: int, most_rows: int, most_cols: int
) -> tuple[list[tuple[slice, slice]], tuple[int, int]]:
    """Tiles of at most (most_rows, most_cols), nearly equal (a ragged last tile runs the matmul slowly),
    row-major so that consecutive tiles of one thread share their row operand; and the tile shape."""
    tr, tc = _even(rows, most_rows), _even(cols, most_cols)
    tiles = [
        (slice(r, min(r + tr, rows)), slice(c, min(c + tc, cols)))
        for r in range(0, rows, tr)
        for c in range(0, cols, tc)
    ]
    return tiles, (tr, tc)


def run_tiles(tiles: list[tuple[slice, slice]], work: TileWork, *, threads: int | None = None) -> None:
    """Call `work` once per tile on `threads` threads (default: torch's intra-op thread count).

    The calling thread is one of them. torch's thread count is a process-wide setting that new threads
    copy, so it is 1 while the tiles run and restored before returning.
    """
    threads = min(threads or torch.get_num_threads(), len(tiles))
    if threads <= 1:
        scratch: dict = {}
        for r, c in tiles:
            work(r, c, scratch)
        return

    queue = iter(tiles)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def loop() -> None:
        torch.set_num_threads(1)
        scratch: dict = {}
        # Grad mode is per thread (the tiles write into buffers with out=); a context manager, because the
        # calling thread runs this loop too and must get its own mode back.
        with torch.no_grad():
            while not errors:
                with lock:
                    tile = next(queue, None)
                if tile is None:
                    return
                try:
                    work(*tile, scratch)
                except BaseException as e:  # re-raised in the caller; the others stop at their next tile
                    errors.append(e)

    previous = torch.get_num_threads()
    helpers = [threading.Thread(target=loop, name=f"hype-tile-{i}", daemon=True) for i in range(threads - 1)]
    try:
        for t in helpers:
            t.start()
        loop()
    finally:
        for t in helpers:
            t.join()
        torch.set_num_threads(previous)
    if errors:
        raise errors[0]
