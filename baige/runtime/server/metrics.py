"""Prometheus metrics of one server, in its own registry: baige's own (``baige:`` prefix) and, beside
them, vLLM's (``vllm:`` prefix, the names, types, label names and bucket edges of vLLM v1's
``vllm/v1/metrics/loggers.py``, documented in vLLM's ``docs/usage/metrics.md``; labels ``model_name``
and ``engine``), so vLLM's Grafana dashboard and autoscalers read a baige server unchanged."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from baige.runtime.infer.async_engine import AsyncEngine, EngineStats
from baige.runtime.infer.kv_offload import KVOffloadStats
from baige.runtime.infer.kv_transfer.manager import KVTransferStats
from baige.runtime.infer.outputs import EmbeddingRequestOutput, RequestOutput
from baige.runtime.infer.spec_decode.stats import SpecDecodeStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5)


class Metrics:
    """Prometheus metrics of one server (vLLM's names with a ``baige:`` prefix), in its own registry."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = r = CollectorRegistry()
        r.register(_EngineCollector(engine))
        r.register(_VllmEngineCollector(engine, model_name))
        self.vllm = VllmMetrics(r, model_name, engine.max_model_len)
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

    def on_output(self, out: RequestOutput | EmbeddingRequestOutput) -> None:
        """Called by the engine thread with every output."""
        self.vllm.on_output(out)
        if isinstance(out, EmbeddingRequestOutput):
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.requests.labels("stop").inc()
            return
        self.generation_tokens.inc(sum(len(o.delta_token_ids) for o in out.outputs))
        if not out.finished:
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
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
    lengths, KV-cache use, prefix-cache queries and hits (tokens), preemptions, structured outputs;
    with a proposer, speculative decoding's counters under vLLM's names (``vllm:spec_decode_*`` ->
    ``baige:``): drafts, draft tokens, accepted tokens, accepted tokens per draft position, and the
    acceptance rate and mean acceptance length."""

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
        yield CounterMetricFamily(
            "baige:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            value=stats.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "baige:prefix_cache_hits", "Prompt tokens found in the prefix cache.", value=stats.prefix_cache_hits
        )
        for name, doc, key in _GRAMMAR_GAUGES:
            yield GaugeMetricFamily(name, doc, value=stats.grammar.get(key, 0))
        if stats.spec_decode is not None:
            yield from _spec_decode_families(stats.spec_decode)
        if stats.kv_offload is not None:
            yield from _kv_offload_families(stats.kv_offload)
        if stats.kv_transfer is not None:
            yield from _kv_transfer_families(stats.kv_transfer)


def _kv_offload_families(st: KVOffloadStats):
    """The second KV tier's counters (``--kv-offload-size``): hits (blocks, tokens), stores, LRU
    evictions, bytes by direction, records refused as corrupted, stores dropped; its size now."""
    for name, doc, value in (
        ("baige:kv_offload_hit_blocks", "KV blocks loaded from the second tier instead of computed.", st.hit_blocks),
        ("baige:kv_offload_hit_tokens", "Prompt tokens whose KV was loaded from the second tier.", st.hit_tokens),
        ("baige:kv_offload_stores", "KV blocks evicted from the pool and written to the second tier.", st.stores),
        ("baige:kv_offload_evictions", "KV blocks dropped from the second tier (LRU, size bound).", st.evictions),
        (
            "baige:kv_offload_corrupted",
            "Second-tier blocks that failed their checks (checksum, fingerprint) and were recomputed.",
            st.corrupted,
        ),
        ("baige:kv_offload_dropped", "Evicted blocks not stored (writer behind, or a write failed).", st.dropped),
    ):
        yield CounterMetricFamily(name, doc, value=value)
    moved = CounterMetricFamily("baige:kv_offload_bytes", "KV bytes moved by the second tier.", labels=["direction"])
    moved.add_metric(["load"], st.load_bytes)
    moved.add_metric(["store"], st.store_bytes)
    yield moved
    yield GaugeMetricFamily("baige:kv_offload_usage_bytes", "Bytes held in the second KV tier.", value=st.used_bytes)
    yield GaugeMetricFamily(
        "baige:kv_offload_capacity_bytes",
        "Size bound of the second KV tier (--kv-offload-size).",
        value=st.capacity_bytes,
    )


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


# ---- vLLM's metrics -----------------------------------------------------------------------------
VLLM_LABELS = ("model_name", "engine")
ENGINE_INDEX = "0"  # one engine core per server (vLLM's data-parallel rank label)
# bucket edges of vLLM v1 (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
TTFT_BUCKETS += (40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
REQUEST_BUCKETS += (480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


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


class VllmMetrics:
    """vLLM's per-request metrics (histograms and counters observed as requests produce and finish).

    Times are the engine's monotonic stamps (``RequestOutput``): queue = first scheduled - arrival,
    prefill = first token - first scheduled, decode = finished - first token, inference = finished -
    first scheduled, TTFT = first token - arrival, inter-token latency = the time between two steps that
    gave a request tokens (``token_interval``; also exported under the older
    ``time_per_output_token_seconds``), request TPOT = decode / (tokens - 1). A pooling request counts as
    finished with reason ``stop``, its prefill ending when it finishes.
    """

    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int):
        self.labels = (model_name, ENGINE_INDEX)
        tokens = build_1_2_5_buckets(max_model_len)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()):
            return Counter(name, doc, [*VLLM_LABELS, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, VLLM_LABELS, buckets=buckets, registry=registry).labels(*self.labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*self.labels)
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.").labels(
            *self.labels
        )
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.", ("finished_reason",)
        )
        self.h = {
            name: histogram(f"vllm:{name}", doc, buckets)
            for name, doc, buckets in (
                ("request_prompt_tokens", "Number of prefill tokens processed.", tokens),
                ("request_generation_tokens", "Number of generation tokens processed.", tokens),
                ("request_max_num_generation_tokens", "Maximum number of requested generation tokens.", tokens),
                ("request_params_n", "The n request parameter.", N_BUCKETS),
                ("request_params_max_tokens", "The max_tokens request parameter.", tokens),
                (
                    "request_prefill_kv_computed_tokens",
                    "Prefill tokens computed (prompt minus prefix-cache hits and tokens whose KV was transferred).",
                    tokens,
                ),
                ("time_to_first_token_seconds", "Time to first token (TTFT) in seconds.", TTFT_BUCKETS),
                ("inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS),
                ("time_per_output_token_seconds", "Inter-token latency in seconds (older name).", ITL_BUCKETS),
                ("request_time_per_output_token_seconds", "Time per output token (TPOT) per request.", ITL_BUCKETS),
                ("e2e_request_latency_seconds", "End-to-end request latency in seconds.", REQUEST_BUCKETS),
                ("request_queue_time_seconds", "Time spent in the WAITING phase.", REQUEST_BUCKETS),
                ("request_inference_time_seconds", "Time spent in the RUNNING phase.", REQUEST_BUCKETS),
                ("request_prefill_time_seconds", "Time spent in the PREFILL phase.", REQUEST_BUCKETS),
                ("request_decode_time_seconds", "Time spent in the DECODE phase.", REQUEST_BUCKETS),
            )
        }

    def on_output(self, out: RequestOutput | EmbeddingRequestOutput) -> None:
        """Observe one engine output (engine thread)."""
        if isinstance(out, EmbeddingRequestOutput):
            self._finished_common(out, out.finished_time)
            self.request_success.labels(*self.labels, "stop").inc()
            if out.first_scheduled_time is not None:
                self.h["request_prefill_time_seconds"].observe(out.finished_time - out.first_scheduled_time)
            return
        new = sum(len(o.delta_token_ids) for o in out.outputs)
        self.generation_tokens.inc(new)
        if new and out.token_interval is not None:
            self.h["inter_token_latency_seconds"].observe(out.token_interval)
            self.h["time_per_output_token_seconds"].observe(out.token_interval)
        if out.finished:
            self._finished(out)

    def _finished_common(self, out, finished: float) -> None:
        """What generation and pooling requests both observe when they finish."""
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.h["request_prompt_tokens"].observe(len(out.prompt_token_ids))
        self.h["request_prefill_kv_computed_tokens"].observe(len(out.prompt_token_ids) - out.num_cached_tokens)
        self.h["e2e_request_latency_seconds"].observe(finished - out.arrival_time)
        if out.first_scheduled_time is not None:
            self.h["request_queue_time_seconds"].observe(out.first_scheduled_time - out.arrival_time)
            self.h["request_inference_time_seconds"].observe(finished - out.first_scheduled_time)

    def _finished(self, out: RequestOutput) -> None:
        finished = out.finished_time
        self._finished_common(out, finished)
        for o in out.outputs:
            self.request_success.labels(*self.labels, o.finish_reason or "abort").inc()
        n_gen = [len(o.token_ids) for o in out.outputs]
        self.h["request_generation_tokens"].observe(sum(n_gen))
        self.h["request_params_n"].observe(out.n)
        if out.max_tokens is not None:
            self.h["request_max_num_generation_tokens"].observe(out.max_tokens)
            self.h["request_params_max_tokens"].observe(out.max_tokens)
        first = out.first_token_time
        if first is None:
            return
        self.h["time_to_first_token_seconds"].observe(first - out.arrival_time)
        self.h["request_decode_time_seconds"].observe(finished - first)
        if out.first_scheduled_time is not None:
            self.h["request_prefill_time_seconds"].observe(first - out.first_scheduled_time)
        if max(n_gen) > 1:
            self.h["request_time_per_output_token_seconds"].observe((finished - first) / (max(n_gen) - 1))


class _VllmEngineCollector:
    """vLLM's engine gauges and counters, read from one :meth:`AsyncEngine.stats` snapshot per scrape."""

    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.labels = engine, [model_name, ENGINE_INDEX]

    def collect(self):
        st: EngineStats = self.engine.stats()
        for kind, name, doc, value in (
            (
                GaugeMetricFamily,
                "num_requests_running",
                "Number of requests in model execution batches.",
                st.num_requests_running,
            ),
            (
                GaugeMetricFamily,
                "num_requests_waiting",
                "Number of requests waiting to be processed.",
                st.num_requests_waiting,
            ),
            (
                GaugeMetricFamily,
                "kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                st.kv_cache_blocks_used / st.kv_cache_blocks_total,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                st.prefix_cache_queries,
            ),
            (
                CounterMetricFamily,
                "prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                st.prefix_cache_hits,
            ),
            (
                CounterMetricFamily,
                "num_preemptions",
                "Cumulative number of preemption from the engine.",
                st.num_preemptions,
            ),
        ):
            family = kind(f"vllm:{name}", doc, labels=VLLM_LABELS)
            family.add_metric(self.labels, value)
            yield family
