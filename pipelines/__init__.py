"""Executor-facing jobs (local and Ray) that run the stage code of `hype` over shards.

The stages themselves live in the `hype` library and do not know which executor runs them.
"""
