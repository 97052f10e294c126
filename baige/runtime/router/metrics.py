"""The router's own Prometheus metrics (``baige:router_*``), in its own registry: requests by backend
and status, retries, requests refused for want of a backend, streams broken mid-way, requests past
their deadline, pd requests
whose producer sent no ``kv_transfer_params``, and each backend's health and in-flight requests."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from baige.runtime.router.backends import BackendPool


class RouterMetrics:
    def __init__(self, pool: BackendPool):
        self.registry = r = CollectorRegistry()
        r.register(_PoolCollector(pool))
        self.requests = Counter(
            "baige:router_requests",
            "Requests answered through a backend, by backend, role and HTTP status of its answer.",
            ["backend", "role", "status"],
            registry=r,
        )
        self.retries = Counter(
            "baige:router_retries",
            "Tries that failed before anything was sent to the client (then the next backend is tried).",
            ["backend", "role"],
            registry=r,
        )
        self.no_backend = Counter(
            "baige:router_no_backend", "Requests answered 503: no healthy backend could take them.", registry=r
        )
        self.stream_errors = Counter(
            "baige:router_stream_errors",
            "Streams whose backend failed after streaming began (the client got an error event).",
            ["backend", "role"],
            registry=r,
        )
        self.timeouts = Counter(
            "baige:router_request_timeouts",
            "Requests that passed --request-timeout-secs at a backend (a 504 or an error event).",
            ["backend", "role"],
            registry=r,
        )
        self.pd_without_kv_params = Counter(
            "baige:router_pd_without_kv_transfer_params",
            "pd requests whose producer answered without kv_transfer_params (the consumer computes the prefill).",
            registry=r,
        )


class _PoolCollector:
    """Each backend's health (1 up, 0 down) and in-flight requests at scrape time."""

    def __init__(self, pool: BackendPool):
        self.pool = pool

    def collect(self):
        up = GaugeMetricFamily(
            "baige:router_backend_up", "1 while a backend takes requests.", labels=["backend", "role"]
        )
        busy = GaugeMetricFamily(
            "baige:router_backend_in_flight", "Requests this router has open at a backend.", labels=["backend", "role"]
        )
        for b in self.pool.backends:
            up.add_metric([b.url, b.role], 1.0 if b.healthy else 0.0)
            busy.add_metric([b.url, b.role], float(b.in_flight))
        yield up
        yield busy
