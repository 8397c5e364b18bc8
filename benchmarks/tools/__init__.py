"""Tools beside the benchmarks: step traces of a running server."""
