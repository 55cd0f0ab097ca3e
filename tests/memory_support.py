"""Run a piece of code in a child process whose memory is capped, and report its peak growth.

The child imports what `setup` imports, resets its peak RSS (Linux's clear_refs), caps its address
space (RLIMIT_AS) at what it has mapped plus `headroom_mb`, and runs `call`: an allocation that memory
bounds should have prevented fails there (MemoryError or torch's allocator error) instead of exhausting
the machine, and the test sees it.
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
def status(key):
    line = next(x for x in open("/proc/self/status") if x.startswith(key + ":"))
    return int(line.split()[1]) * 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the current RSS: imports' transient peaks do not count
vm, rss = status("VmSize"), status("VmRSS")
resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom} * 2**20, resource.RLIM_INFINITY))
try:
    {call}
    error = None
except BaseException as e:
    error = f"{{type(e).__name__}}: {{e}}"
print(json.dumps({{"error": error, "growth_mb": (status("VmHWM") - rss) / 2**20}}))
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
