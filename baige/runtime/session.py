"""A loaded model + tokenizer that turns text into streamed text: what ``generate`` and ``chat`` run."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from baige.errors import BaigeError
from baige.runtime.config import GenerateConfig
from baige.runtime.generate import generate_tokens
from baige.runtime.loader import load_model, resolve_device, resolve_model
from baige.runtime.model import Transformer
from baige.runtime.sampling import SamplingParams
from baige.runtime.tokenizer import IncrementalDetokenizer, Tokenizer


def generation_defaults(model_dir: Path) -> dict:
    """Sampling defaults from ``generation_config.json`` (temperature/top_p/top_k when ``do_sample``)."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    gen = json.loads(path.read_text())
    if not gen.get("do_sample", False):
        return {}
    return {k: gen[k] for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None}


@dataclass
class ChatSession:
    """Model, tokenizer and sampling settings; keeps the message history for multi-turn chat."""

    model: Transformer
    tokenizer: Tokenizer
    params: SamplingParams
    name: str
    use_chat: bool
    system: str | None = None
    messages: list[dict] = field(default_factory=list)

    @classmethod
    def load(cls, cfg: GenerateConfig) -> "ChatSession":
        """Resolve, load and configure. Raises BaigeError for any bad argument or checkpoint."""
        model_dir = resolve_model(cfg.model)
        tokenizer = Tokenizer.from_dir(model_dir)
        model = load_model(model_dir, cfg.dtype, resolve_device(cfg.device))
        defaults = generation_defaults(model_dir)
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
        name = cfg.model or "smollm2-135m-instruct"
        return cls(model, tokenizer, params, name, use_chat, cfg.system)

    def _system(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def stream(self, prompt_ids: list[int]) -> Iterator[tuple[str, int]]:
        """Yield ``(text delta, tokens generated so far)``; EOS ends generation and is not printed."""
        detok = IncrementalDetokenizer(self.tokenizer)
        eos = set(self.tokenizer.eos_token_ids)
        n = 0
        for n, token in enumerate(
            generate_tokens(self.model, prompt_ids, self.params, self.tokenizer.eos_token_ids), start=1
        ):
            if token in eos:
                break
            delta = detok.add(token)
            if delta:
                yield delta, n
        tail = detok.flush()
        yield tail, n

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
