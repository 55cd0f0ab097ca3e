"""Caption-level utilities shared by scoring and filters."""
