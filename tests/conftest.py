"""Fixtures shared by several test files."""

pytest_plugins = ["s3_support"]  # s3_server (a SeaweedFS S3 server on 127.0.0.1, per session), s3
