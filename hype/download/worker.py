"""What runs inside img2dataset's download workers (processes or Ray tasks), importable by name so that
pickles of it load there."""

from __future__ import annotations

from img2dataset.downloader import Downloader

from hype.download.network import NetworkPolicy, install_guard


class GuardedDownloader(Downloader):
    """img2dataset's Downloader that obeys a `NetworkPolicy` in whichever process runs it: img2dataset
    pickles the downloader into every worker, and the guard is installed there before the first fetch."""

    def __init__(self, *args, policy: NetworkPolicy, **kwargs):
        super().__init__(*args, **kwargs)
        self.policy = policy

    def __call__(self, row):
        install_guard(self.policy)
        return super().__call__(row)
