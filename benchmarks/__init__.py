"""Benchmark scripts that print a table (benchmarks/README.md lists each and the question it answers)."""
