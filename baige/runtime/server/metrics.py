"""Prometheus metrics of one server (vLLM's names with a ``baige:`` prefix), in its own registry; the
P/D histogram under vLLM's own name (``vllm:request_prefill_kv_computed_tokens``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baige.runtime.infer.async_engine import AsyncEngine
from baige.runtime.infer.kv_transfer.manager import KVTransferStats
from baige.runtime.infer.outputs import RequestOutput
from baige.runtime.infer.spec_decode.stats import SpecDecodeStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine core per server (vLLM's data-parallel rank label)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_value:
                return out
            out.append(v)
        exponent += 1


class Metrics:
    """Prometheus metrics of one server (vLLM's names with a ``baige:`` prefix), in its own registry."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine))
        self.prompt_tokens = Counter("baige:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("baige:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter(
            "baige:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "baige:time_to_first_token_seconds",
            "Time to first token (TTFT), seconds.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "baige:time_per_output_token_seconds",
            "Time per output token after the first (TPOT), seconds.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "baige:e2e_request_latency_seconds",
            "End-to-end request latency, seconds.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_kv_computed = Histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Prefill tokens computed (prompt minus prefix-cache hits and tokens whose KV was transferred).",
            VLLM_LABELS,
            buckets=build_1_2_5_buckets(engine.max_model_len),
            registry=r,
        ).labels(model_name, ENGINE_INDEX)

    def on_output(self, out: RequestOutput) -> None:
        """Called by the engine thread with every output."""
        self.generation_tokens.inc(sum(len(o.delta_token_ids) for o in out.outputs))
        if not out.finished:
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.prefill_kv_computed.observe(len(out.prompt_token_ids) - out.num_cached_tokens)
        for o in out.outputs:
            self.requests.labels(o.finish_reason or "unknown").inc()
        if out.first_token_time is not None:
            self.ttft.observe(out.first_token_time - out.arrival_time)
            n = max(len(o.token_ids) for o in out.outputs)
            if n > 1 and out.finished_time is not None:
                self.tpot.observe((out.finished_time - out.first_token_time) / (n - 1))
        if out.finished_time is not None:
            self.e2e.observe(out.finished_time - out.arrival_time)


# (name, help, EngineStats field): the engine's gauges, read from one snapshot per scrape
_GAUGES = (
    ("baige:num_requests_running", "Requests with sequences in the running queue.", "num_requests_running"),
    ("baige:num_requests_waiting", "Requests waiting to be scheduled.", "num_requests_waiting"),
    ("baige:kv_cache_blocks_used", "KV-cache blocks referenced by a sequence.", "kv_cache_blocks_used"),
    ("baige:kv_cache_blocks_total", "KV-cache blocks in the pool.", "kv_cache_blocks_total"),
    (
        "baige:prefix_cache_hit_rate",
        "Prompt tokens found in the prefix cache / prompt tokens looked up.",
        "prefix_cache_hit_rate",
    ),
    ("baige:num_preemptions", "Sequences preempted (recompute) so far.", "num_preemptions"),
    (
        "baige:structured_output_requests",
        "Requests with a structured-output constraint so far.",
        "num_structured_output_requests",
    ),
)
# (name, help, key of EngineStats.grammar): structured outputs' compiles, their time, mask time
_GRAMMAR_GAUGES = (
    ("baige:grammar_compiles", "Constraints compiled (cache misses).", "compiles"),
    ("baige:grammar_compile_seconds", "Seconds spent compiling constraints, in all.", "compile_seconds"),
    ("baige:structured_mask_seconds", "Seconds spent computing token masks, in all.", "mask_seconds"),
    ("baige:structured_masked_tokens", "Tokens sampled under a grammar mask.", "masked_tokens"),
)


class _EngineCollector:
    """The engine's state at scrape time (:meth:`AsyncEngine.stats`, one snapshot per scrape): queue
    lengths, KV-cache use, preemptions, structured outputs; with a proposer, speculative decoding's
    counters under vLLM's names (``vllm:spec_decode_*`` -> ``baige:``): drafts, draft tokens, accepted
    tokens, accepted tokens per draft position, and the acceptance rate and mean acceptance length."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        for name, doc, field in _GAUGES:
            yield GaugeMetricFamily(name, doc, value=getattr(stats, field))
        yield GaugeMetricFamily(
            "baige:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0-1).",
            value=stats.kv_cache_blocks_used / stats.kv_cache_blocks_total,
        )
        for name, doc, key in _GRAMMAR_GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats.grammar.get(key, 0))
        if stats.spec_decode is not None:
            yield from _spec_decode_families(stats.spec_decode)
        if stats.kv_transfer is not None:
            yield from _kv_transfer_families(stats.kv_transfer)


def _kv_transfer_families(st: KVTransferStats):
    """P/D disaggregation's counters (``--kv-transfer-config``): blocks and bytes sent (producer) and
    received (consumer), pulls, fallbacks to computing the prompt, pins expired unpulled."""
    for name, doc, sent, received in (
        ("baige:kv_transfer_blocks", "KV blocks transferred, by direction.", st.blocks_sent, st.blocks_received),
        ("baige:kv_transfer_bytes", "KV bytes transferred, by direction.", st.bytes_sent, st.bytes_received),
    ):
        family = CounterMetricFamily(name, doc, labels=["direction"])
        family.add_metric(["sent"], sent)
        family.add_metric(["received"], received)
        yield family
    yield CounterMetricFamily("baige:kv_transfer_pulls", "Pulls that delivered every block.", value=st.pulls)
    yield CounterMetricFamily(
        "baige:kv_transfer_failures",
        "Requests whose KV pull failed, timed out or did not match (they computed their prompt).",
        value=st.pull_failures,
    )
    yield CounterMetricFamily(
        "baige:kv_transfer_expired",
        "Pinned prefills released without a pull (abort_request_timeout).",
        value=st.expired,
    )
    yield GaugeMetricFamily("baige:kv_transfer_pinned", "Prefills pinned for a consumer now.", value=st.pinned)
    yield GaugeMetricFamily(
        "baige:kv_transfer_block_bytes", "Bytes of one KV block (all layers, K and V).", value=st.block_bytes
    )


def _spec_decode_families(st: SpecDecodeStats):
    """Speculative decoding's counters and the two gauges they give."""
    yield CounterMetricFamily(
        "baige:spec_decode_num_drafts", "Verify steps with at least one draft token.", value=st.num_drafts
    )
    yield CounterMetricFamily(
        "baige:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.", value=st.num_draft_tokens
    )
    yield CounterMetricFamily(
        "baige:spec_decode_num_accepted_tokens", "Draft tokens accepted.", value=st.num_accepted_tokens
    )
    per_pos = CounterMetricFamily(
        "baige:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position (0-based).",
        labels=["position"],
    )
    for pos, n in enumerate(st.accepted_per_pos):
        per_pos.add_metric([str(pos)], n)
    yield per_pos
    yield GaugeMetricFamily(
        "baige:spec_decode_acceptance_rate", "Accepted / draft tokens so far (0-1).", value=st.acceptance_rate
    )
    yield GaugeMetricFamily(
        "baige:spec_decode_mean_acceptance_length",
        "Tokens emitted per verify step, the target's own included (1 + accepted / drafts).",
        value=st.mean_acceptance_length,
    )
