"""From a prompt and its sampling parameters to what the engine queues (vLLM v1's input processor):
tokenization and every check a request must pass before it takes any engine state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from baige.errors import BaigeError
from baige.runtime.infer.sampling import SamplingParams
from baige.runtime.infer.structured import GrammarCompiler
from baige.runtime.model.tokenizer import Tokenizer


class InputProcessor:
    """Validates and tokenizes prompts for one model.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the model's vocabulary size (token ids must be below it).
        max_model_len: the engine's context limit in tokens (prompt + completion).
        grammars: returns the engine's structured-output compiler (built on first use).
    """

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, grammars: Callable[[], GrammarCompiler]
    ):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.grammars = grammars

    @property
    def max_prompt_chars(self) -> int:
        """Characters beyond which a text cannot fit the context whatever it tokenizes to, so it is
        refused without tokenizing: ``max_model_len`` tokens of at most ``max_token_chars`` each,
        with a 4x margin for normalizers that drop characters."""
        return 4 * self.max_model_len * self.tokenizer.max_token_chars

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Tokenize and validate a prompt; fill in ``max_tokens`` (default: the rest of the context).

        Raises:
            BaigeError: empty prompt or not valid Unicode, token ids (prompt, stop_token_ids,
            logit_bias, allowed_token_ids) or top_k outside the vocabulary, or a prompt plus
            max_tokens longer than max_model_len (the message gives both numbers).
        """
        params.check_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            first = self.grammars().first_mask(params.structured_outputs)  # compiles (cached) or raises now
            first_free = params.reasoning_end_token_id is not None  # the constraint starts later
            if (
                params.allowed_token_ids is not None
                and not first_free
                and not bool(first[params.allowed_token_ids].any())
            ):
                raise BaigeError(
                    "allowed_token_ids leave no token that the structured-output constraint allows first",
                    param="allowed_token_ids",
                )
        text, ids = self._tokens(prompt)
        n = len(ids)
        if n >= self.max_model_len:
            raise BaigeError(
                f"this model's maximum context length is {self.max_model_len} tokens; "
                f"the prompt has {n} tokens, which leaves no room to generate"
            )
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - n)
        elif n + params.max_tokens > self.max_model_len:
            raise BaigeError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{n + params.max_tokens} were requested ({n} in the prompt, {params.max_tokens} "
                f"in the completion); reduce the prompt or max_tokens"
            )
        return text, ids, params

    def _tokens(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and ids. Raises BaigeError: empty, not valid Unicode,
        far longer than the context, or ids outside the vocabulary."""
        if isinstance(prompt, str):
            _check_text(prompt, "prompt")
            if len(prompt) > self.max_prompt_chars:
                raise BaigeError(
                    f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                    f"has {len(prompt)} characters, far more than that many tokens can hold"
                )
            text, ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise BaigeError("the prompt is empty")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise BaigeError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return text, ids

    def prepare_pooling(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """Tokenize and validate a pooling request's prompt (at most ``max_model_len`` tokens: nothing is
        generated after it). Raises BaigeError as :meth:`prepare` for the prompt itself."""
        text, ids = self._tokens(prompt)
        if len(ids) > self.max_model_len:
            raise BaigeError(
                f"this model's maximum context length is {self.max_model_len} tokens; the input has {len(ids)} tokens"
            )
        return text, ids


def _check_text(text: str, field: str) -> None:
    """Raise BaigeError for text that is not valid Unicode (a lone surrogate from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BaigeError(f"{field}: not valid Unicode (a lone surrogate at character {e.start})", param=field) from None
