"""Measurements too long for the tests: run each from the repository root as ``python -m benchmarks.<name>``; results in RESULTS.md."""
