"""Fixtures of the benchmark tests."""

import pytest

from baige.runtime import roofline


@pytest.fixture(autouse=True)
def _quick_limits(monkeypatch):
    """In-process benchmark runs measure the machine's limits (before and after their timed runs) with a
    32 MiB copy and a 512 x 512 matmul without a minimum time instead of 256 MiB and 2048 x 2048 for at
    least 2 s: the tests check what the reports do with the limits, not their values (the measurements
    themselves are tested with explicit sizes, which pass through)."""
    bandwidth, matmul_peak = roofline.measure_bandwidth, roofline.measure_matmul_peak

    def quick_bandwidth(device, nbytes=None, iters=3):
        return bandwidth(device, nbytes or 32 << 20, iters)

    def quick_matmul_peak(device, dtype, n=None, iters=2, min_seconds=0.0):
        return matmul_peak(device, dtype, n or 512, iters, min_seconds)

    monkeypatch.setattr(roofline, "measure_bandwidth", quick_bandwidth)
    monkeypatch.setattr(roofline, "measure_matmul_peak", quick_matmul_peak)
