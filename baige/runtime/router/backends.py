"""The router's backends: each one's health and load, and the loop that checks them.

A backend is *up* once ``GET /health`` answers 200 and *down* after a health check fails or a
request to it breaks at the transport level (connection refused or reset, a stream cut off); a down
backend gets no requests until a later health check answers 200 again (re-admission). The load the
``least_load`` and ``prefix`` policies read is the larger of the requests this router has in flight
there now and the running + waiting requests the backend last reported in its ``/metrics`` (baige's
``baige:num_requests_running`` / ``baige:num_requests_waiting``, or vLLM's ``vllm:`` names): the first
counts this router's requests at once, the second every router's, one health interval late.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import httpx

logger = logging.getLogger("baige.router")

ROLES = ("backend", "prefill", "decode")
_LOAD_METRICS = ("num_requests_running", "num_requests_waiting")
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


def parse_load(text: str) -> float | None:
    """Running + waiting requests from a Prometheus text exposition: for each of the two gauges, the
    sum of its samples (one per label set) under vLLM's ``vllm:`` name, else baige's ``baige:``
    name. None when neither name is present (the backend exports no load)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        prefix, _, metric = m["name"].partition(":")
        if metric in _LOAD_METRICS and prefix in ("vllm", "baige"):
            try:
                value = float(m["value"])
            except ValueError:
                continue
            key = f"{prefix}:{metric}"
            found[key] = found.get(key, 0.0) + value
    if not found:
        return None
    total = 0.0
    for metric in _LOAD_METRICS:
        total += found.get(f"vllm:{metric}", found.get(f"baige:{metric}", 0.0))
    return total


@dataclass
class Backend:
    """One backend's state (mutated on the router's event loop only).

    Attributes:
        url: base URL, ``http://HOST:PORT``.
        role: ``backend``, or ``prefill`` / ``decode`` under the pd policy.
        healthy: up (gets requests) or down.
        in_flight: requests this router has open there now.
        reported_load: running + waiting requests from its last ``/metrics`` (0 before one).
        last_error: why it last went down (None while it never has).
        down_since: ``time.monotonic()`` when it went down, None while up.
    """

    url: str
    role: str = "backend"
    healthy: bool = False
    in_flight: int = 0
    reported_load: float = 0.0
    last_error: str | None = None
    down_since: float | None = None

    @property
    def load(self) -> float:
        return max(float(self.in_flight), self.reported_load)

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role, "healthy": self.healthy, "in_flight": self.in_flight}


class BackendPool:
    """The backends of one router and their health checks (``interval`` s apart, each request
    ``timeout`` s at most); ``scrape_load``: also read each backend's ``/metrics`` for its load."""

    def __init__(self, backends: list[Backend], interval: float, timeout: float, scrape_load: bool):
        self.backends = backends
        self.interval, self.timeout, self.scrape_load = interval, timeout, scrape_load

    def healthy(self, role: str = "backend") -> list[Backend]:
        return [b for b in self.backends if b.role == role and b.healthy]

    def by_url(self, role: str = "backend") -> dict[str, Backend]:
        return {b.url: b for b in self.backends if b.role == role}

    def roles(self) -> list[str]:
        return [r for r in ROLES if any(b.role == r for b in self.backends)]

    def mark_down(self, backend: Backend, why: str) -> None:
        """Take ``backend`` out of rotation until a health check re-admits it."""
        if backend.healthy:
            logger.warning("backend %s (%s) is down: %s", backend.url, backend.role, why)
        backend.healthy, backend.last_error = False, why
        backend.down_since = backend.down_since or time.monotonic()

    def _mark_up(self, backend: Backend) -> None:
        if not backend.healthy:
            logger.info("backend %s (%s) is up", backend.url, backend.role)
        backend.healthy, backend.down_since = True, None

    async def check(self, client: httpx.AsyncClient, backend: Backend) -> None:
        """One health check: ``GET /health`` (200: up, anything else: down) and, when loads are
        scraped, ``GET /metrics`` (a backend without load gauges keeps load = its in-flight count)."""
        try:
            r = await client.get(f"{backend.url}/health", timeout=self.timeout)
            if r.status_code != 200:
                return self.mark_down(backend, f"/health answered {r.status_code}")
            if self.scrape_load:
                m = await client.get(f"{backend.url}/metrics", timeout=self.timeout)
                load = parse_load(m.text) if m.status_code == 200 else None
                backend.reported_load = load or 0.0
        except httpx.HTTPError as e:
            return self.mark_down(backend, f"health check failed ({type(e).__name__}: {e})")
        self._mark_up(backend)

    async def check_all(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self.check(client, b) for b in self.backends))

    async def run(self, client: httpx.AsyncClient) -> None:
        """Check every backend every ``interval`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            await self.check_all(client)
