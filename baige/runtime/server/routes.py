"""The small endpoints: ``/health``, ``/metrics`` (Prometheus), ``/version`` and ``/v1/models`` (the base
model and its loaded LoRA adapters)."""

from __future__ import annotations

from importlib import metadata

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from baige.runtime.server.serving import state_of

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> Response:
    """200 while the engine loop runs, 503 once it has stopped (the process then exits) or the server
    drains after a stop signal (:mod:`.lifecycle`), so load balancers stop routing to it."""
    st = state_of(request)
    return Response(status_code=200 if st.engine.is_alive and not st.draining else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(state_of(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version() -> dict:
    """baige's version (the installed distribution's; vLLM's ``/version`` shape)."""
    return {"version": metadata.version("baige")}


@router.get("/v1/models")
async def models(request: Request) -> dict:
    """The base model, then every loaded LoRA adapter with ``parent`` = the base (vLLM's listing)."""
    st = state_of(request)
    max_len = st.engine.max_model_len
    data = [
        {
            "id": st.served_model_name,
            "object": "model",
            "created": st.created,
            "owned_by": "baige",
            "root": st.served_model_name,
            "parent": None,
            "max_model_len": max_len,
        }
    ]
    for name, lora_request in st.engine.lora_adapters().items():
        data.append(
            {
                "id": name,
                "object": "model",
                "created": st.created,
                "owned_by": "baige",
                "root": lora_request.lora_path,
                "parent": st.served_model_name,
                "max_model_len": max_len,
            }
        )
    return {"object": "list", "data": data}
