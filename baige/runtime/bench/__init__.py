"""Benchmarks: latency, throughput, serving load, kernels, training, peer comparison, roofline."""
