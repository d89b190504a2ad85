"""Benchmarks that return one JSON-able dict each (wired as ``megaflow bench ...``)."""
