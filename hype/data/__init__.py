"""Data formats: uids and subset files, shards, metadata."""
