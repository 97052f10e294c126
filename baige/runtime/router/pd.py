"""The ``pd`` policy's request flow: prefill on a producer, then decode on a consumer (vLLM's
NIXL-connector flow, as its disaggregated-serving proxy runs it).

1. The producer gets the request with ``kv_transfer_params = {"do_remote_decode": true, ...}``,
   ``max_tokens: 1`` (and ``max_completion_tokens: 1`` when given), ``stream: false`` and no
   ``stream_options``: it computes the prompt's KV blocks, keeps them for a consumer to pull, and
   answers with ``kv_transfer_params`` saying where they are (engine, host, port, block ids).
2. The consumer gets the client's original request with those ``kv_transfer_params`` added; it pulls
   the blocks instead of computing the prompt, and its answer (a stream or not) is the client's.

Both carry the same ``X-Request-Id``. Producers are ordered by the prefix policy (their prefix caches
hold prompts' KV), consumers by least load; each step fails over as :func:`.proxy.forward` does. A
producer answer without ``kv_transfer_params`` (a backend without a KV connector) is counted and the
consumer gets the plain request: it computes the prompt itself.
"""

from __future__ import annotations

import json
import logging

from fastapi.responses import Response, StreamingResponse

from baige.runtime.router.proxy import RouterState, deadline_after, error_response, forward

logger = logging.getLogger("baige.router")

# what vLLM's proxy sends a producer (vllm/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py)
PRODUCER_KV_TRANSFER_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def producer_request(body: dict) -> dict:
    """The producer's copy of a request: one output token, no stream, the remote-decode params."""
    out = dict(body, kv_transfer_params=dict(PRODUCER_KV_TRANSFER_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


async def _prefill(
    state: RouterState, path: str, body: dict, headers: dict, key: bytes, deadline: float
) -> tuple[dict | None, Response | None]:
    """Run the prefill on a producer: ``(its kv_transfer_params or None, None)``, or ``(None, the
    response to give the client)`` when no producer answered 200 (its 4xx, or 503)."""
    content = json.dumps(producer_request(body)).encode()
    resp = await forward(state, "prefill", "POST", path, content, headers, key, deadline)
    if isinstance(resp, StreamingResponse):  # asked for no stream, got one: drain it (frees the backend)
        async for _ in resp.body_iterator:
            pass
        return None, error_response("the producer answered a stream=false request with a stream", 502, "bad_producer")
    if resp.status_code != 200:
        return None, resp
    try:
        answer = json.loads(resp.body)
    except ValueError:
        return None, error_response("the producer's answer is not JSON", 502, "bad_producer")
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    return (params if isinstance(params, dict) and params else None), None


async def forward_pd(state: RouterState, path: str, body: dict, headers: dict, key: bytes) -> Response:
    """The pd flow for one completion or chat request (``body`` parsed); the consumer's answer."""
    deadline = deadline_after(state)  # the two phases share the client's --request-timeout-secs
    params, refused = await _prefill(state, path, body, headers, key, deadline)
    if refused is not None:
        return refused
    decode = dict(body)
    if params is None:
        state.metrics.pd_without_kv_params.inc()
        logger.info(
            "request %s: the producer sent no kv_transfer_params; the consumer computes the prompt",
            headers["x-request-id"],
        )
        decode.pop("kv_transfer_params", None)
    else:
        decode["kv_transfer_params"] = params
    return await forward(state, "decode", "POST", path, json.dumps(decode).encode(), headers, key, deadline)
