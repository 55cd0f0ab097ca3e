"""Resharding: DataComp-compatible training shards for a subset (see `hype.reshard.run`)."""

from hype.reshard.run import reshard

__all__ = ["reshard"]
