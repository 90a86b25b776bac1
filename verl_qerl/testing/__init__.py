"""Helpers for tests, examples and benchmarks: tiny local models, no hub downloads."""
