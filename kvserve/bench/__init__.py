"""Benchmarks: offline engine throughput, and the serving load generator (bench serve / compare)."""
