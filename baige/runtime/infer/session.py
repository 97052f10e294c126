"""``baige generate`` and ``baige chat`` on the :class:`Engine`: one prompt or a multi-turn
conversation, streamed as text deltas. The same engine as ``baige serve``, so every engine feature
(paged KV, prefix caching across chat turns, the native CPU decode step) reaches the terminal too."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from baige.errors import BaigeError
from baige.runtime.config import EngineConfig, GenerateConfig
from baige.runtime.infer.engine import Engine
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.device import resolve_device, resolve_dtype
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.weights.hub import DEFAULT_MODEL, resolve_model


def generation_defaults(tokenizer: Tokenizer) -> dict:
    """Sampling defaults from ``generation_config.json`` (temperature/top_p/top_k when ``do_sample``),
    as the tokenizer read and checked it (:func:`baige.runtime.model.tokenizer.check_generation_config`)."""
    gen = tokenizer.generation_config
    if not gen.get("do_sample", False):
        return {}
    return {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}


@dataclass
class ChatSession:
    """An engine, its sampling settings, and the message history of a multi-turn chat."""

    engine: Engine
    params: SamplingParams
    name: str
    use_chat: bool
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=itertools.count, repr=False)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @classmethod
    def load(cls, cfg: GenerateConfig) -> "ChatSession":
        """Resolve, load and configure. Raises BaigeError for any bad argument or checkpoint.

        The KV cache holds one sequence of the model's whole context (``max_position_embeddings``
        tokens): generation is one request at a time.
        """
        model_dir = resolve_model(cfg.model)
        mc = ModelConfig.from_file(model_dir / "config.json")
        block_size, max_len = 16, mc.max_position_embeddings
        # the whole model's KV bytes: under tensor parallelism a rank's share holds more than one sequence
        kv_bytes = -(-max_len // block_size) * KVCache.bytes_per_block(
            mc, block_size, resolve_dtype(cfg.dtype, mc, resolve_device(cfg.device))
        )
        engine = Engine.from_config(
            EngineConfig(
                model=str(model_dir),
                dtype=cfg.dtype,
                device=cfg.device,
                max_num_seqs=1,
                block_size=block_size,
                kv_cache_memory=kv_bytes,
                speculative_config=cfg.speculative_config,
                tensor_parallel_size=cfg.tensor_parallel_size,
                batch_invariant=cfg.batch_invariant,
            )
        )
        tokenizer = engine.tokenizer
        defaults = generation_defaults(tokenizer)
        params = SamplingParams(
            temperature=cfg.temperature if cfg.temperature is not None else defaults.get("temperature", 1.0),
            top_p=cfg.top_p if cfg.top_p is not None else defaults.get("top_p", 1.0),
            top_k=cfg.top_k if cfg.top_k is not None else defaults.get("top_k", 0),
            min_p=cfg.min_p,
            seed=cfg.seed,
            max_tokens=cfg.max_tokens,
        )
        use_chat = tokenizer.has_chat_template if cfg.chat is None else cfg.chat
        if use_chat and not tokenizer.has_chat_template:
            raise BaigeError(f"{model_dir}: --chat needs a chat template and this tokenizer has none (use --no-chat)")
        if use_chat:
            tokenizer.check_chat_template()
        return cls(engine, params, cfg.model or DEFAULT_MODEL, use_chat, cfg.system)

    def _system(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def stream(self, prompt_ids: list[int]) -> Iterator[tuple[str, int]]:
        """Yield ``(text delta, tokens generated so far)`` until the request finishes (EOS ends it
        and is not printed; ``max_tokens`` is capped to the room left in the context).

        Raises BaigeError for a prompt that leaves no room to generate. Leaving the iterator early
        (Ctrl-C) aborts the request and frees its KV blocks.
        """
        room = self.engine.max_model_len - len(prompt_ids)
        params = self.params
        if params.max_tokens is not None and 0 < room < params.max_tokens:
            params = replace(params, max_tokens=room)
        rid = f"session-{next(self._ids)}"
        self.engine.add_request(rid, prompt_ids, params)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    o = out.outputs[0]
                    done = out.finished
                    if o.delta_text or done:
                        yield o.delta_text, len(o.token_ids)
        finally:
            if not done:
                self.engine.abort(rid)

    def complete(self, prompt: str) -> Iterator[tuple[str, int]]:
        """One prompt: through the chat template (one user turn) when ``use_chat``, else raw text."""
        if self.use_chat:
            ids = self.tokenizer.apply_chat_template(self._system() + [{"role": "user", "content": prompt}])
        else:
            ids = self.tokenizer.encode(prompt)
        return self.stream(ids)

    def chat_turn(self, text: str) -> Iterator[tuple[str, int]]:
        """Add a user turn, stream the reply, and keep both in the history (the turn is dropped on error)."""
        self.messages.append({"role": "user", "content": text})
        reply = []
        try:
            ids = self.tokenizer.apply_chat_template(self._system() + self.messages)
            for delta, n in self.stream(ids):
                reply.append(delta)
                yield delta, n
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": "".join(reply)})

    def reset(self) -> None:
        self.messages.clear()
