"""Benchmarks: `pagedllm bench throughput|latency|serve`, each a table on stdout and JSON on request."""
