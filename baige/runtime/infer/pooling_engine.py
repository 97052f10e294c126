"""The engine's pooling requests (:class:`EnginePooling`, a part of the one
:class:`~baige.runtime.infer.engine.Engine`): queued as prefill-only sequences, finished with their
embedding once their prompt is computed (``pooling.py``)."""

from __future__ import annotations

import time

from baige.errors import BaigeError
from baige.runtime.infer.output_processor import RequestState
from baige.runtime.infer.outputs import EmbeddingOutput, EmbeddingRequestOutput
from baige.runtime.infer.pooling import PoolingParams, PoolingState
from baige.runtime.infer.scheduler import Sequence


class EnginePooling:
    """The engine's pooling requests (a part of :class:`~baige.runtime.infer.engine.Engine`, which
    provides ``pooler``, ``requests``, ``scheduler``, ``input_processor``, ``model`` and ``is_sleeping``)."""

    def add_pooling_request(
        self, request_id: str, prompt: str | list[int], params: PoolingParams, arrival_time: float | None = None
    ) -> None:
        """Queue a pooling request: its prompt is prefilled (chunked and batched with the others) and
        pooled, and it finishes with an :class:`EmbeddingRequestOutput` once its prompt is computed.
        Raises BaigeError: a request id in flight, or as :meth:`prepare_pooling`."""
        if request_id in self.requests:
            raise BaigeError(f"request id {request_id!r} is already in use")
        text, ids = self.prepare_pooling(prompt, params)
        seq = Sequence(list(ids), 1, request_id=request_id, pooling=PoolingState(self.pooler, params, len(ids)))
        self.scheduler.add(seq)
        now = time.monotonic() if arrival_time is None else arrival_time
        self.requests[request_id] = RequestState(request_id, text, ids, params, [seq], now)
        self.num_prompt_tokens += len(ids)

    def prepare_pooling(self, prompt: str | list[int], params: PoolingParams) -> tuple[str | None, list[int]]:
        """Tokenize and validate a pooling prompt (:meth:`InputProcessor.prepare_pooling`) and its
        ``params`` (:meth:`PoolingParams.check`). Raises BaigeError as those do, under the generate
        runner, and while asleep."""
        if self.pooler is None:
            raise BaigeError("this model runs the generate runner; embeddings need --runner pooling", param="model")
        if self.is_sleeping:
            raise BaigeError("the engine is asleep (its KV cache is released); call wake_up() first")
        params.check(self.pooler, self.model.config.hidden_size)
        return self.input_processor.prepare_pooling(prompt)

    def _finish_pooled(self, seq: Sequence, now: float) -> EmbeddingRequestOutput | None:
        """A pooling sequence whose prompt is computed: finish it, its request's output."""
        req = self.requests.get(seq.request_id)
        if req is None or seq.is_finished or seq.num_computed_tokens < len(seq.token_ids):
            return None
        self.scheduler.finish(seq, "stop")
        del self.requests[seq.request_id]
        return EmbeddingRequestOutput(
            req.request_id,
            req.prompt_token_ids,
            EmbeddingOutput(seq.pooling.result()),
            num_cached_tokens=seq.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_scheduled_time=req.scheduled_time,
            finished_time=now,
        )
