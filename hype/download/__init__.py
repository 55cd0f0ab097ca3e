"""`hype download`: a pool's images from its DataComp metadata, with img2dataset and DataComp's settings.

    from hype.download import download
    summary = download("pool/metadata", "pool/shards", allow_private_network=False, progress=True)

Module map: `config` (YAML presets, `configs/download/`), `metadata` (input checks and the shard plan),
`network` (refusing private-network targets), `worker` (what runs in img2dataset's workers), `run`
(orchestration and the summary).
"""

from __future__ import annotations

import importlib
from typing import Any

# Resolved on first use: download workers import `hype.download.worker`, and importing this package
# must not pull the config machinery (torch, open_clip) into every one of them.
_EXPORTS = {
    "DownloadConfig": "hype.download.config",
    "load_download_config": "hype.download.config",
    "DownloadError": "hype.download.metadata",
    "download": "hype.download.run",
    "format_summary": "hype.download.run",
    "run_download": "hype.download.run",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hype.download' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
