"""Run a piece of code in a child process whose memory is capped, and report its peak growth.

The child imports what `setup` imports, then caps its address space (RLIMIT_AS) at what it has mapped
plus `headroom_mb`, and runs `call`: an allocation that memory bounds should have prevented fails there
(MemoryError or torch's allocator error) instead of exhausting the machine, and the test sees it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

_CHILD = """
import json, resource
{setup}
import torch
torch.set_num_threads(1)
page = resource.getpagesize()
vm, rss = (int(x) * page for x in open("/proc/self/statm").read().split()[:2])
resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom} * 2**20, resource.RLIM_INFINITY))
try:
    {call}
    error = None
except BaseException as e:
    error = f"{{type(e).__name__}}: {{e}}"
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({{"error": error, "growth_mb": (peak - rss) / 2**20}}))
"""


def run_bounded(setup: str, call: str, *, headroom_mb: int = 1024, timeout: float = 120) -> dict:
    """{"error": "Type: message" or None, "growth_mb": peak RSS growth while `call` ran}."""
    code = _CHILD.format(setup=textwrap.dedent(setup), call=call, headroom=headroom_mb)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
