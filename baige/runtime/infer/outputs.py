"""What the engine returns per request and per sequence (vLLM's ``RequestOutput`` / ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from baige.runtime.infer.sampling import Logprobs
from baige.runtime.infer.spec_decode.stats import SpecDecodeStats


class RequestFailed(RuntimeError):
    """A request failed inside the engine; the other requests go on.

    ``status`` is 400 when the request itself led there (a structured-output constraint that the
    generation can no longer follow, ``param`` naming the field), 500 otherwise.
    """

    def __init__(self, message: str, status: int = 500, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class RequestAborted(RequestFailed):
    """The server aborted the request before it finished: it is shutting down and the request was
    still running when ``--shutdown-timeout`` passed (:meth:`AsyncEngine.abort_all`). A 503."""

    def __init__(self, message: str):
        super().__init__(message, status=503)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped: no request can be served until the process is restarted."""


@dataclass
class CompletionOutput:
    """One sequence of a request. Cumulative fields plus the delta of the step that produced it."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[Logprobs] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What a request has produced so far.

    Times are ``time.monotonic()`` seconds: ``arrival_time`` (added), ``first_scheduled_time`` (first
    in a step: queue time = first_scheduled_time - arrival_time), ``first_token_time`` (TTFT =
    first_token_time - arrival_time), ``finished_time``; ``token_interval``: seconds between the step
    that produced this output's tokens and the previous one that produced tokens for this request
    (vLLM's inter-token latency; None for the first). ``n`` and ``max_tokens``: the request's.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then one Logprobs per token
    # (filled as prefill chunks run; complete once the first output token exists)
    prompt_logprobs: list[Logprobs | None] | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    # speculative decoding on: this request's drafts, draft tokens and accepted tokens so far
    spec_decode: SpecDecodeStats | None = None
    first_scheduled_time: float | None = None
    token_interval: float | None = None
    n: int = 1
    max_tokens: int | None = None
    # a KV producer's finished request: where a consumer pulls its prompt's blocks (vLLM's fields)
    kv_transfer_params: dict | None = None


@dataclass
class EmbeddingOutput:
    """A pooling request's result (vLLM's ``EmbeddingOutput``): the embedding, a list of floats."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """A finished pooling request (vLLM's ``EmbeddingRequestOutput``; what ``LLM.embed`` returns).

    Times as :class:`RequestOutput`'s; ``num_cached_tokens``: prompt tokens found in the prefix cache.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    finished_time: float | None = None
