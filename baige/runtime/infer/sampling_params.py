"""Per-request sampling parameters (:class:`SamplingParams`, vLLM's ``sampling_params``) and the limits the
server's protocol shares: every field checked when the params are made (BaigeError naming it), token ids
against a vocabulary by :meth:`SamplingParams.check_vocab`. The sampler that applies them is
:mod:`baige.runtime.infer.sampling`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from baige.errors import BaigeError
from baige.runtime.infer.structured import StructuredOutputsParams

MAX_LOGPROBS = 20  # most top logprobs a request may ask for (OpenAI's top_logprobs cap)
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_LEN = 512  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
SAMPLING_EPS = 1e-5  # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)


@dataclass
class SamplingParams:
    """Per-request sampling settings (vLLM's names and meanings).

    Attributes:
        n: sequences to generate per prompt.
        temperature: 0 = greedy; logits are divided by it.
        top_p, top_k, min_p: filters, applied in that order (see the module docstring).
        presence_penalty, frequency_penalty: subtracted from the logits of tokens already generated,
            once / once per occurrence (OpenAI's definition), in [-2, 2].
        repetition_penalty: tokens of the prompt or the output get their logit divided by it when
            positive, multiplied when negative (Keskar et al. 2019, arXiv:1909.05858); 1 = off.
        seed: per-request RNG seed (sequence ``i`` of ``n`` uses ``seed + i``, wrapped to 64 bits).
        max_tokens: most tokens to generate (None: up to the context limit).
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens are generated.
        stop: strings that end generation; not included in the output text.
        stop_token_ids: ids that end generation besides EOS.
        ignore_eos: keep going past EOS.
        logprobs: return the log-probability of each generated token and this many top alternatives
            (0: the sampled token only), from the model's raw distribution (before penalties and
            temperature, as vLLM). None: off.
        prompt_logprobs: also return, for every prompt token after the first, its log-probability
            given the tokens before it and the ``k`` most likely alternatives (vLLM's name; needed by
            ``echo`` + ``logprobs`` completions, e.g. lm-eval's loglikelihood). The request then skips
            the prefix cache (its whole prompt must be computed). None: off.
        skip_special_tokens: leave special tokens out of the text.
        logit_bias: token id -> bias added to its logit before sampling (OpenAI's field), in [-100, 100].
        allowed_token_ids: when set, only these tokens can be sampled (vLLM's field).
        structured_outputs: a JSON schema / JSON object / regex / choice / grammar constraint on the
            output (:mod:`baige.runtime.infer.structured`).
        reasoning_end_token_id: with ``structured_outputs``, the constraint engages only after the
            sequence has generated this token (the end of its reasoning, e.g. ``</think>``: vLLM's
            behaviour with a reasoning parser); the tokens up to it are free. None: from the first token.
        reasoning_start_token_id: with ``reasoning_end_token_id``, the output reasons only if its first
            token is this one (e.g. ``<think>``): the first step allows it besides what the constraint
            allows, and any other first token starts the constrained answer at once. None: the output
            reasons from its first token.

    Raises:
        BaigeError: a value out of its range (one line naming the field). Token ids are checked
        against the vocabulary by ``Engine.prepare``, which knows it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise BaigeError(f"{name} must be a finite number, got {value!r}", param=name)
        for name in ("top_k", "n", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise BaigeError(f"{name} must be an integer, got {getattr(self, name)!r}", param=name)
        if self.temperature < 0:
            raise BaigeError(f"temperature must be >= 0, got {self.temperature}", param="temperature")
        if not 0 < self.top_p <= 1:
            raise BaigeError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.top_k < -1:
            raise BaigeError(f"top_k must be >= 0 (or -1 for off), got {self.top_k}", param="top_k")
        if not 0 <= self.min_p <= 1:
            raise BaigeError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise BaigeError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if self.n < 1:
            raise BaigeError(f"n must be >= 1, got {self.n}", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise BaigeError(f"{name} must be in [-2, 2], got {getattr(self, name)}", param=name)
        if self.repetition_penalty <= 0:
            raise BaigeError(
                f"repetition_penalty must be > 0, got {self.repetition_penalty}", param="repetition_penalty"
            )
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise BaigeError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}", param="min_tokens")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BaigeError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", param="logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise BaigeError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}", param="prompt_logprobs"
            )
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise BaigeError(f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {self.seed!r}", param="seed")
        self._check_stops()
        self._check_token_fields()

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise BaigeError(f"stop: at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}", param="stop")
        for s in self.stop:
            if not isinstance(s, str) or len(s) > MAX_STOP_LEN:
                raise BaigeError(
                    f"stop: each entry must be a string of at most {MAX_STOP_LEN} characters", param="stop"
                )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise BaigeError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}",
                param="stop_token_ids",
            )

    def _check_token_fields(self) -> None:
        ids = list(self.stop_token_ids) + list(self.allowed_token_ids or []) + list(self.logit_bias or {})
        bad = next((t for t in ids if not _is_int(t) or t < 0), None)
        if bad is not None:
            raise BaigeError(f"token id {bad!r} is not a non-negative integer")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise BaigeError("allowed_token_ids must not be empty", param="allowed_token_ids")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise BaigeError(
                    f"logit_bias: at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}", param="logit_bias"
                )
            for t, b in self.logit_bias.items():
                if not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
                    raise BaigeError(f"logit_bias[{t}] must be a number in [-100, 100], got {b!r}", param="logit_bias")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise BaigeError for a token id (stop_token_ids, logit_bias, allowed_token_ids) or a
        top_k outside a vocabulary of ``vocab_size`` tokens."""
        if self.top_k > vocab_size:
            raise BaigeError(
                f"top_k must be at most the vocabulary size {vocab_size} (or -1/0 for off), got {self.top_k}",
                param="top_k",
            )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logit_bias", list(self.logit_bias or {})),
            ("reasoning_end_token_id", [] if self.reasoning_end_token_id is None else [self.reasoning_end_token_id]),
            (
                "reasoning_start_token_id",
                [] if self.reasoning_start_token_id is None else [self.reasoning_start_token_id],
            ),
        ):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise BaigeError(f"{name}: token id {bad} is outside the vocabulary [0, {vocab_size})", param=name)

    def seed_for(self, index: int) -> int:
        """The RNG seed of sequence ``index`` of the request (``seed + index`` wrapped to 64 bits)."""
        return (self.seed + index) % 2**64

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
