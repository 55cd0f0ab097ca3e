"""Fixtures shared by several test files."""

# s3_server / s3: a SeaweedFS S3 server on 127.0.0.1 (per session); ray_cluster: a two-node Ray cluster.
pytest_plugins = ["s3_support", "ray_support"]
