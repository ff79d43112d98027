"""Benchmarks: the offline throughput run today; a serving load generator comes with the server."""
