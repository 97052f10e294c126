"""The inference engine: requests in, streamed text out, many requests sharing one model.

``Engine`` is synchronous: :meth:`Engine.add_request`, :meth:`Engine.step` (one scheduler step:
schedule -> run -> sample -> stop checks -> detokenize), :meth:`Engine.abort`. ``AsyncEngine``
(``async_engine.py``) drives one from a background thread for the HTTP server; ``LLM``
(``llm.py``) is the offline API.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.config import EngineConfig, parse_size
from baige.runtime.infer.block_manager import BlockManager
from baige.runtime.infer.kv_cache import KVCache, num_blocks_for, profile_activation_peak, resolve_kv_cache_dtype
from baige.runtime.infer.outputs import CompletionOutput, RequestOutput
from baige.runtime.infer.runner import ModelRunner
from baige.runtime.infer.sampling import Logprobs, SamplerRow, SamplingParams
from baige.runtime.infer.scheduler import Scheduler, Sequence
from baige.runtime.model.device import resolve_device
from baige.runtime.model.tokenizer import IncrementalDetokenizer, Tokenizer
from baige.runtime.model.transformer import Transformer
from baige.runtime.weights.hub import resolve_model
from baige.runtime.weights.loader import load_model

logger = logging.getLogger("baige.engine")


class _SeqState:
    """Per-sequence text state: detokenizer, stop strings, what has been streamed."""

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, generator: torch.Generator | None):
        self.params = params
        self.generator = generator
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.text = ""
        self.sent = 0  # characters of text already emitted
        self.max_stop = max((len(s) for s in params.stop), default=0)
        self.logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        self.sent_tokens = 0
        self.sent_logprobs = 0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    prompt_logprobs: list[Logprobs | None] | None = None


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: the decoder (eval mode).
        tokenizer: its tokenizer.
        cfg: engine settings.
    Raises:
        BaigeError: settings that cannot work (a KV budget below one max-length sequence,
        max_num_batched_tokens < max_num_seqs, ...).
    """

    def __init__(self, model: Transformer, tokenizer: Tokenizer, cfg: EngineConfig):
        mc = model.config
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise BaigeError(f"--max-model-len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings ({mc.max_position_embeddings})")
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise BaigeError(f"--max-num-batched-tokens ({cfg.max_num_batched_tokens}) must be >= "
                             f"--max-num-seqs ({cfg.max_num_seqs})")
        if cfg.block_size < 1 or cfg.max_num_seqs < 1:
            raise BaigeError("--block-size and --max-num-seqs must be >= 1")
        if isinstance(cfg.kv_cache_memory, str):
            cfg = self.cfg = replace(cfg, kv_cache_memory=parse_size(cfg.kv_cache_memory))
        p = next(model.parameters())
        kernels.backend(p)  # a bad BAIGE_KERNELS fails here, at start-up, not inside the first request
        peak = 0
        if cfg.kv_cache_memory is None:  # size the cache from what is free after a warm-up step
            peak = profile_activation_peak(model, min(cfg.max_num_batched_tokens, self.max_model_len),
                                           min(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len))
        kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, p.dtype, p.device)
        num_blocks = num_blocks_for(mc, cfg.block_size, kv_dtype, p.device, cfg.kv_cache_memory, self.max_model_len,
                                    activation_peak=peak)
        self.kv_cache = KVCache(mc, num_blocks, cfg.block_size, kv_dtype, p.device)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(model, self.kv_cache, cfg.max_num_seqs, self.max_model_len, cfg.enforce_eager)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(tokenizer.eos_token_ids or mc.eos_token_id)
        self._eos_only = frozenset(self.eos_token_ids)
        self.generator = torch.Generator(device=p.device).manual_seed(cfg.seed)  # unseeded requests
        self.requests: dict[str, _Request] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MB, %s)", num_blocks, cfg.block_size,
                    num_blocks * cfg.block_size,
                    num_blocks * KVCache.bytes_per_block(mc, cfg.block_size, kv_dtype) / 1e6,
                    str(kv_dtype).removeprefix("torch."))

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "Engine":
        """Resolve and load the model and tokenizer named by ``cfg.model``. Raises BaigeError."""
        model_dir = resolve_model(cfg.model)
        tokenizer = Tokenizer.from_dir(model_dir)
        model = load_model(model_dir, cfg.dtype, resolve_device(cfg.device))
        if cfg.quantization:
            from baige.runtime.quant.fp16_weight import apply_quantization

            apply_quantization(model, cfg.quantization)
        return cls(model, tokenizer, cfg)

    # ---- requests --------------------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Tokenize and validate a prompt; fill in ``max_tokens`` (default: the rest of the context).

        Raises:
            BaigeError: empty prompt, token ids outside the vocabulary, or a prompt plus max_tokens
            longer than max_model_len (the message gives both numbers).
        """
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt) if prompt else []
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise BaigeError("the prompt is empty")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise BaigeError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        n = len(ids)
        if n >= self.max_model_len:
            raise BaigeError(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the prompt has {n} tokens, which leaves no room to generate")
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - n)
        elif n + params.max_tokens > self.max_model_len:
            raise BaigeError(f"this model's maximum context length is {self.max_model_len} tokens, but "
                             f"{n + params.max_tokens} were requested ({n} in the prompt, {params.max_tokens} "
                             f"in the completion); reduce the prompt or max_tokens")
        return text, ids, params

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Queue a request (``params.n`` sequences). Raises BaigeError as :meth:`prepare`, or for a
        request id already in flight."""
        if request_id in self.requests:
            raise BaigeError(f"request id {request_id!r} is already in use")
        text, ids, params = self.prepare(prompt, params)
        stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            elif not params.greedy:
                gen = self.generator
            seq = Sequence(list(ids), params.max_tokens, params.min_tokens, stop_ids, request_id, i,
                           payload=_SeqState(self.tokenizer, params, gen),
                           prompt_logprobs=params.prompt_logprobs if i == 0 else None)  # one scorer per request
            seqs.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(request_id, text, ids, params, seqs,
                                             time.monotonic() if arrival_time is None else arrival_time,
                                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.num_prompt_tokens += len(ids)

    def abort(self, request_id: str) -> None:
        """Drop a request and free its KV blocks (no-op for an unknown or finished id)."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        logger.info("request %s aborted after %.3f s", request_id, time.monotonic() - req.arrival_time)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running_requests(self) -> int:
        return len({s.request_id for s in list(self.scheduler.running)})

    @property
    def num_waiting_requests(self) -> int:
        running = {s.request_id for s in list(self.scheduler.running)}
        return len({s.request_id for s in list(self.scheduler.waiting)} - running)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. Returns an output for every request that produced a token (or finished)."""
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        rows = []
        for s in batch.seqs:
            st: _SeqState = s.payload
            p = st.params
            rows.append(SamplerRow(
                p, st.generator,
                prompt_ids=s.token_ids[: s.num_prompt_tokens] if p.repetition_penalty != 1 else None,
                output_ids=s.output_token_ids if (p.has_penalties or p.min_tokens) else None,
                stop_ids=list(s.stop_token_ids) if p.min_tokens else None,
            ))
        tokens, logprobs, prompt_lps = self.runner.execute(batch, rows)
        for i, (first, lps) in prompt_lps.items():
            req = self.requests.get(batch.seqs[i].request_id)
            if req is not None and req.prompt_logprobs is not None and first == len(req.prompt_logprobs):
                req.prompt_logprobs.extend(lps)  # a recompute after preemption scores nothing new
        got = self.scheduler.postprocess(batch, tokens)
        now = time.monotonic()
        lp_of = {s.seq_id: lp for s, lp in zip(batch.seqs, logprobs)}
        touched: dict[str, _Request] = {}
        for seq in got:
            self._process_token(seq, lp_of[seq.seq_id])
            self.num_generated_tokens += 1
            req = self.requests.get(seq.request_id)
            if req is not None:
                if req.first_token_time is None:
                    req.first_token_time = now
                touched[req.request_id] = req
        return [self._output(req, now) for req in touched.values()]

    def _process_token(self, seq: Sequence, lp: Logprobs | None) -> None:
        st: _SeqState = seq.payload
        token = seq.token_ids[-1]
        if st.logprobs is not None and lp is not None:
            st.logprobs.append(lp)
        if not (seq.finish_reason == "stop" and seq.stop_reason == token):  # a stop token adds no text
            st.text += st.detok.add(token)
        if seq.is_finished:
            st.text += st.detok.flush()
        if st.max_stop:
            # emitted text never holds the start of a stop string (see _emit_upto), so search after it
            hits = [(i, s) for s in st.params.stop if (i := st.text.find(s, st.sent)) >= 0]
            if hits:
                i, stop = min(hits)
                st.text = st.text[:i]
                if seq.is_finished:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                else:
                    self.scheduler.finish(seq, "stop", stop)

    def _emit_upto(self, seq: Sequence) -> int:
        """Characters of the text that may be streamed now: all when finished, else all but the
        longest tail that is a prefix of a stop string (it could still become one)."""
        st: _SeqState = seq.payload
        if seq.is_finished or not st.max_stop:
            return len(st.text)
        text = st.text
        for k in range(min(st.max_stop - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in st.params.stop):
                return len(text) - k
        return len(text)

    def _output(self, req: _Request, now: float) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            st: _SeqState = seq.payload
            upto = max(self._emit_upto(seq), st.sent)
            out_ids = seq.output_token_ids
            outs.append(CompletionOutput(
                index=seq.index,
                text=st.text[:upto],
                token_ids=list(out_ids),
                finish_reason=seq.finish_reason,
                stop_reason=None if seq.stop_reason in self._eos_only else seq.stop_reason,  # EOS: None (vLLM)
                logprobs=list(st.logprobs) if st.logprobs is not None else None,
                delta_text=st.text[st.sent:upto],
                delta_token_ids=out_ids[st.sent_tokens:],
                delta_logprobs=st.logprobs[st.sent_logprobs:] if st.logprobs is not None else [],
            ))
            st.sent, st.sent_tokens = upto, len(out_ids)
            st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
        finished = all(s.is_finished for s in req.seqs)
        out = RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, finished,
                            num_cached_tokens=req.seqs[0].num_cached_tokens,
                            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
                            arrival_time=req.arrival_time,
                            first_token_time=req.first_token_time, finished_time=now if finished else None)
        if finished:
            del self.requests[req.request_id]
            n_out = sum(len(o.token_ids) for o in outs)
            logger.info("request %s: %d prompt tokens, %d output tokens, %.3f s, finish %s", req.request_id,
                        len(req.prompt_token_ids), n_out, now - req.arrival_time,
                        ",".join(str(o.finish_reason) for o in outs))
        return out

    # ---- offline ---------------------------------------------------------------------------
    def run_to_completion(self, request_ids: Seq[str]) -> list[RequestOutput]:
        """Step until every listed request has finished; their final outputs, in the given order."""
        final: dict[str, RequestOutput] = {}
        while len(final) < len(request_ids) and self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in request_ids]




