"""The inference engine: requests in, streamed text out, many requests sharing one model.

``Engine`` is synchronous: :meth:`Engine.add_request`, :meth:`Engine.step` (one scheduler step:
schedule -> run -> sample -> stop checks -> detokenize), :meth:`Engine.abort`. Whatever goes
wrong with one request while it is prepared, run, sampled or detokenized fails that request alone
(:meth:`Engine.take_failures`); a batched step that raises is retried one sequence at a time so the
others go on. ``AsyncEngine``
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
from baige.runtime.infer.lora import LoRAManager, LoRARequest
from baige.runtime.infer.outputs import CompletionOutput, EngineDeadError, RequestFailed, RequestOutput
from baige.runtime.infer.runner import ModelRunner
from baige.runtime.infer.sampling import Logprobs, SamplerRow, SamplingParams
from baige.runtime.infer.scheduler import ScheduledBatch, Scheduler, Sequence, StepShape
from baige.runtime.infer.spec_decode.factory import build_proposer
from baige.runtime.infer.spec_decode.proposer import assign_drafts
from baige.runtime.infer.spec_decode.stats import SpecDecodeStats
from baige.runtime.infer.stop import StopMatcher
from baige.runtime.infer.structured import GrammarCompiler, engine_error
from baige.runtime.infer.text import SeqText
from baige.runtime.infer.tp_worker import TensorParallelGroup, kv_config, load_engine_model, start_tensor_parallel
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.model.transformer import Transformer
from baige.runtime.settings import settings
from baige.runtime.weights.hub import resolve_model

logger = logging.getLogger("baige.engine")


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
    spec_stats: SpecDecodeStats | None = None


class Engine:
    """Continuous-batching engine over one model.

    Args:
        model: the decoder (eval mode); rank 0's shard under tensor parallelism.
        tokenizer: its tokenizer.
        cfg: engine settings.
        tp: the tensor-parallel group (``tp_worker.TensorParallelGroup``) when ``model`` is a shard;
            the engine sizes the KV cache, tells the workers, and closes the group in :meth:`close`.
    Raises:
        BaigeError: settings that cannot work (a KV budget below one max-length sequence,
        max_num_batched_tokens < max_num_seqs, ...).
    """

    def __init__(
        self, model: Transformer, tokenizer: Tokenizer, cfg: EngineConfig, tp: TensorParallelGroup | None = None
    ):
        mc = model.config
        self.model, self.tokenizer, self.cfg, self.tp = model, tokenizer, cfg, tp
        self.max_model_len = cfg.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise BaigeError(
                f"--max-model-len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings ({mc.max_position_embeddings})"
            )
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise BaigeError(
                f"--max-num-batched-tokens ({cfg.max_num_batched_tokens}) must be >= "
                f"--max-num-seqs ({cfg.max_num_seqs})"
            )
        if cfg.block_size < 1 or cfg.max_num_seqs < 1:
            raise BaigeError("--block-size and --max-num-seqs must be >= 1")
        if isinstance(cfg.kv_cache_memory, str):
            cfg = self.cfg = replace(cfg, kv_cache_memory=parse_size(cfg.kv_cache_memory))
        p = next(model.parameters())
        kernels.backend(p)  # a bad BAIGE_KERNELS fails here, at start-up, not inside the first request
        if p.device.type == "cpu" and settings().cpu_keep_heap:
            kernels.keep_freed_heap()  # prefill temporaries reuse freed memory instead of faulting in new pages
        peak = 0
        kv_cfg = kv_config(model)  # this rank's KV heads
        if cfg.kv_cache_memory is None and tp is None:  # size the cache from what is free after a warm-up step
            peak = profile_activation_peak(
                model,
                min(cfg.max_num_batched_tokens, self.max_model_len),
                min(cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len),
            )
        kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, p.dtype, p.device)
        num_blocks = num_blocks_for(
            kv_cfg, cfg.block_size, kv_dtype, p.device, cfg.kv_cache_memory, self.max_model_len, activation_peak=peak
        )
        self.kv_cache = KVCache(kv_cfg, num_blocks, cfg.block_size, kv_dtype, p.device)
        if tp is not None:
            tp.send_kv_cache(num_blocks, cfg.block_size, kv_dtype)
        self.block_manager = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.proposer = build_proposer(cfg, self.max_model_len, tokenizer, model, num_blocks, kv_dtype)
        self.spec_stats = SpecDecodeStats()
        self.num_speculative_tokens = cfg.speculative_config.num_speculative_tokens if self.proposer else 0
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            self.max_model_len,
            on_release=self.proposer.release if self.proposer else None,
            max_loras=cfg.max_loras if cfg.enable_lora else None,
        )
        self.runner = ModelRunner(
            model,
            self.kv_cache,
            cfg.max_num_seqs,
            self.max_model_len,
            cfg.enforce_eager,
            self.num_speculative_tokens,
            tp,
            batch_invariant=cfg.batch_invariant,
        )
        self.lora: LoRAManager | None = None  # --enable-lora: the adapters (infer/lora.py)
        if cfg.enable_lora:
            self.lora = self.runner.lora = LoRAManager(model, cfg.max_lora_rank)
            for name, path in (cfg.lora_modules or {}).items():
                self.lora.load(LoRARequest(name, len(self.lora.loaded) + 1, str(path)))
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(tokenizer.eos_token_ids or mc.eos_token_id)
        self._eos_only = frozenset(self.eos_token_ids)
        self.generator = torch.Generator(device=p.device).manual_seed(cfg.seed)  # unseeded requests
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self.requests: dict[str, _Request] = {}
        self._failures: list[tuple[str, RequestFailed]] = []
        self.num_generated_tokens = 0
        # a list (set by benchmarks): every step appends the scheduler.StepShape it ran
        self.step_shapes: list[StepShape] | None = None
        self.num_prompt_tokens = 0
        self.num_constrained_requests = 0
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MB, %s)",
            num_blocks,
            cfg.block_size,
            num_blocks * cfg.block_size,
            num_blocks * KVCache.bytes_per_block(kv_cfg, cfg.block_size, kv_dtype) / 1e6,
            str(kv_dtype).removeprefix("torch."),
        )

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "Engine":
        """Resolve and load the model and tokenizer named by ``cfg.model``; with
        ``tensor_parallel_size`` > 1 start the workers first (``tp_worker.start_tensor_parallel``) and
        load rank 0's shard. Raises BaigeError."""
        model_dir = resolve_model(cfg.model)
        tokenizer = Tokenizer.from_dir(model_dir)
        tp = start_tensor_parallel(cfg, model_dir) if cfg.tensor_parallel_size > 1 else None
        try:
            model = load_engine_model(cfg, model_dir, tp.comm if tp is not None else None)
            return cls(model, tokenizer, cfg, tp)
        except BaseException:
            if tp is not None:
                tp.close()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel workers (no-op on one rank). The engine cannot step afterwards."""
        if self.tp is not None:
            self.tp.close()

    # ---- requests --------------------------------------------------------------------------
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
            if params.allowed_token_ids is not None and not bool(first[params.allowed_token_ids].any()):
                raise BaigeError(
                    "allowed_token_ids leave no token that the structured-output constraint allows first",
                    param="allowed_token_ids",
                )
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

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request (``params.n`` sequences), with ``lora_request``'s adapter (loaded from its
        path on first use) or the base model. Raises BaigeError as :meth:`prepare`, for a request id
        already in flight, or for an adapter without ``enable_lora`` or that cannot load
        (``LoRANotFound`` for an unknown name without a path)."""
        if request_id in self.requests:
            raise BaigeError(f"request id {request_id!r} is already in use")
        text, ids, params = self.prepare(prompt, params)
        lora_id = self.resolve_lora(lora_request)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.eos_token_ids)
        )
        matcher = StopMatcher(params.stop) if params.stop else None
        so = params.structured_outputs
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.runner.device).manual_seed(params.seed_for(i))
            elif not params.greedy:
                gen = self.generator
            seq = Sequence(
                list(ids),
                params.max_tokens,
                params.min_tokens,
                stop_ids,
                request_id,
                i,
                payload=SeqText(
                    self.tokenizer, params, gen, matcher, self.grammars().matcher(so) if so is not None else None
                ),
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,  # one scorer per request
                lora_int_id=lora_id,
            )
            seqs.append(seq)
        for seq in seqs:  # queued only once all are built: a failure above leaves nothing behind
            self.scheduler.add(seq)
        self.requests[request_id] = _Request(
            request_id,
            text,
            ids,
            params,
            seqs,
            time.monotonic() if arrival_time is None else arrival_time,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            spec_stats=SpecDecodeStats() if self.proposer is not None else None,
        )
        self.num_prompt_tokens += len(ids)
        self.num_constrained_requests += so is not None

    def resolve_lora(self, lora_request: LoRARequest | None) -> int:
        """The ``lora_int_id`` of a request's adapter (0 = base), loading it on first use. Raises
        BaigeError (LoRA not enabled, or the adapter cannot load) or LoRANotFound."""
        if lora_request is None:
            return 0
        if self.lora is None:
            raise BaigeError(
                f"LoRA adapter {lora_request.lora_name!r} requested, but LoRA is not enabled "
                "(--enable-lora / LLM(enable_lora=True))",
                param="model",
            )
        return self.lora.engine_id(lora_request)

    def unload_lora_adapter(self, lora_name: str) -> None:
        """Unload an adapter (between steps). Raises LoRANotFound for a name not loaded, BaigeError
        while requests that use it are in flight (they finish unharmed; unload it afterwards)."""
        if self.lora is None:
            raise BaigeError("LoRA is not enabled (--enable-lora)")
        self.lora.remove(lora_name, [r.seqs[0].lora_int_id for r in self.requests.values()])

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

    def take_failures(self) -> list[tuple[str, RequestFailed]]:
        """The requests that failed since the last call, ``(request id, error)``; they are gone
        from the engine (their blocks freed) and produce no more outputs."""
        failures, self._failures = self._failures, []
        return failures

    def _fail(self, request_id: str, error: BaseException) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            self.scheduler.finish(seq, "abort")
        if isinstance(error, BaigeError):  # the request's own fields led here: the caller's 400
            logger.info("request %s failed: %s", request_id, error)
            failed = RequestFailed(str(error), 400, error.param)
        else:
            logger.error("request %s failed: %s: %s", request_id, type(error).__name__, error)
            failed = RequestFailed(f"request {request_id} failed: {type(error).__name__}: {error}")
        self._failures.append((request_id, failed))

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduler step. Returns an output for every request that produced a token (or finished)."""
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not len(batch):
            return []
        if self.step_shapes is not None:
            self.step_shapes.append(batch.shape())
        rows = [_sampler_row(s) for s in batch.seqs]
        n_spec = [len(s.spec_token_ids) for s in batch.seqs]
        tokens, logprobs, prompt_lps = self._execute(batch, rows, self._start_masks(batch))
        for i, (first, lps) in prompt_lps.items():
            req = self.requests.get(batch.seqs[i].request_id)
            if req is not None and req.prompt_logprobs is not None and first == len(req.prompt_logprobs):
                req.prompt_logprobs.extend(lps)  # a recompute after preemption scores nothing new
        for seq, k, toks in zip(batch.seqs, n_spec, tokens):
            req = self.requests.get(seq.request_id)
            if k and toks and req is not None:
                self.spec_stats.observe(k, len(toks) - 1)
                req.spec_stats.observe(k, len(toks) - 1)
                seq.spec_budget.update(k, len(toks) - 1)
        got = self.scheduler.postprocess(batch, tokens)
        now = time.monotonic()
        lp_of = {s.seq_id: lp for s, lp in zip(batch.seqs, logprobs)}
        touched: dict[str, _Request] = {}
        for seq in got:
            req = self.requests.get(seq.request_id)
            if req is None:  # failed earlier in this step
                continue
            try:
                self.num_generated_tokens += self._process_tokens(seq, lp_of[seq.seq_id])
            except Exception as e:  # a detokenizer or stop-string problem of this request only
                self._fail(seq.request_id, e)
                touched.pop(seq.request_id, None)
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            touched[req.request_id] = req
        return [self._output(req, now) for req in touched.values()]

    def _propose(self) -> None:
        """Draft tokens for the running sequences that decode next step (:func:`assign_drafts`)."""
        assign_drafts(
            self.proposer,
            self.scheduler.running,
            self.num_speculative_tokens,
            self.max_model_len,
            _sampler_row,
            self.cfg.speculative_config.disable_by_batch_size,
        )

    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this engine's tokenizer and vocabulary."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.vocab_size, self.eos_token_ids)
        return self._grammars

    def _start_masks(self, batch: ScheduledBatch):
        """Start the grammar masks of the constrained sequences that sample this step (on the
        compiler's worker thread, overlapping the forward); returns the callable that waits for
        them, or None."""
        constrained = {
            i: s.payload.grammar
            for i, (s, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))
            if s.payload.grammar is not None and s.num_computed_tokens + n - len(s.spec_token_ids) == len(s.token_ids)
        }
        drafts = {i: batch.seqs[i].spec_token_ids for i in constrained if batch.seqs[i].spec_token_ids}
        return self._grammars.start_masks(constrained, drafts).result if constrained else None

    def _execute(self, batch: ScheduledBatch, rows: list[SamplerRow], masks=None):
        """``runner.execute``; when the batched step raises, each sequence runs alone and the ones
        that still raise fail their requests (K/V slots of a failed step are rewritten on retry)."""
        try:
            return self.runner.execute(batch, rows, masks)
        except EngineDeadError:  # a tensor-parallel rank is gone: nothing can run
            raise
        except Exception as e:
            if len(batch) == 1:
                self._fail(batch.seqs[0].request_id, e)
                return [[]], [[]], {}
            logger.exception("a step of %d sequences failed; running them one at a time", len(batch))
        tokens: list[list[int]] = [[] for _ in batch.seqs]
        logprobs: list[list[Logprobs | None]] = [[] for _ in batch.seqs]
        prompt_lps: dict = {}
        full = masks() if masks is not None else {}
        for i, seq in enumerate(batch.seqs):
            if seq.request_id not in self.requests:
                continue
            one = ScheduledBatch([seq], [batch.num_new_tokens[i]], int(i < batch.num_decodes))
            one_mask = (lambda m=full[i]: {0: m}) if i in full else None
            try:
                (tokens[i],), (logprobs[i],), lps = self.runner.execute(one, [rows[i]], one_mask)
            except EngineDeadError:
                raise
            except Exception as e:
                self._fail(seq.request_id, e)
                continue
            if 0 in lps:
                prompt_lps[i] = lps[0]
        return tokens, logprobs, prompt_lps

    def _process_tokens(self, seq: Sequence, lps: list[Logprobs | None]) -> int:
        """Text, stop strings and grammar for the tokens the last step appended to ``seq``, in order.
        A stop string completed inside an accepted run of drafts ends the sequence there: the tokens
        after it are dropped, as if they had never been generated. Returns the tokens kept."""
        n = seq.num_new_output
        first = len(seq.token_ids) - n
        for j in range(n):
            ended = self._process_token(
                seq, seq.token_ids[first + j], lps[j] if j < len(lps) else None, last=j == n - 1
            )
            if ended and j < n - 1:
                del seq.token_ids[first + j + 1 :]
                return j + 1
        return n

    def _process_token(self, seq: Sequence, token: int, lp: Logprobs | None, last: bool = True) -> bool:
        """One new token's text, stop strings and grammar; ``last``: the last token the step appended
        (only then can the sequence's finish come from the scheduler). Returns whether a stop string
        or the grammar ended the sequence at this token."""
        st: SeqText = seq.payload
        finished = seq.is_finished and last
        is_stop_token = finished and seq.finish_reason == "stop" and seq.stop_reason == token
        stop = st.add(token, is_stop_token, finished, lp)
        if stop is not None:
            if seq.is_finished:
                seq.finish_reason, seq.stop_reason = "stop", stop
            else:
                self.scheduler.finish(seq, "stop", stop)
            return True
        if st.grammar is not None:
            # An error while computing this step's mask (an engine limit: then the mask allowed only
            # EOS), or a refused token (allowed_token_ids left nothing the constraint allows).
            if st.grammar.is_error() or not st.grammar.consume_token(token):
                raise BaigeError(
                    f"structured_outputs: the constraint cannot go on after {len(seq.output_token_ids) - 1} "
                    f"tokens ({engine_error(st.grammar)}); allowed_token_ids, if given, must keep tokens "
                    "the constraint allows",
                    param="structured_outputs",
                )
            if st.grammar.is_stopped() and not seq.is_finished:  # the language is complete: end here
                self.scheduler.finish(seq, "stop")
                return True
        return False

    def _output(self, req: _Request, now: float) -> RequestOutput:
        outs = []
        for seq in req.seqs:
            st: SeqText = seq.payload
            upto = st.emit_upto(seq.is_finished)
            out_ids = seq.output_token_ids
            outs.append(
                CompletionOutput(
                    index=seq.index,
                    text=st.text[:upto],
                    token_ids=list(out_ids),
                    finish_reason=seq.finish_reason,
                    stop_reason=None if seq.stop_reason in self._eos_only else seq.stop_reason,  # EOS: None (vLLM)
                    logprobs=list(st.logprobs) if st.logprobs is not None else None,
                    delta_text=st.text[st.sent : upto],
                    delta_token_ids=out_ids[st.sent_tokens :],
                    delta_logprobs=st.logprobs[st.sent_logprobs :] if st.logprobs is not None else [],
                )
            )
            st.sent, st.sent_tokens = upto, len(out_ids)
            st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
        finished = all(s.is_finished for s in req.seqs)
        out = RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            outs,
            finished,
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            finished_time=now if finished else None,
            spec_decode=replace(req.spec_stats, accepted_per_pos=list(req.spec_stats.accepted_per_pos))
            if req.spec_stats is not None
            else None,
        )
        if finished:
            del self.requests[req.request_id]
            n_out = sum(len(o.token_ids) for o in outs)
            logger.info(
                "request %s: %d prompt tokens, %d output tokens, %.3f s, finish %s",
                req.request_id,
                len(req.prompt_token_ids),
                n_out,
                now - req.arrival_time,
                ",".join(str(o.finish_reason) for o in outs),
            )
        return out

    # ---- offline ---------------------------------------------------------------------------
    def run_to_completion(self, request_ids: Seq[str]) -> list[RequestOutput]:
        """Step until every listed request has finished; their final outputs, in the given order.

        Raises RequestFailed (after the others have finished) when one of them failed.
        """
        final: dict[str, RequestOutput] = {}
        failed: dict[str, RequestFailed] = {}
        wanted = set(request_ids)
        while len(final) + len(failed) < len(request_ids) and self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
            failed.update((rid, e) for rid, e in self.take_failures() if rid in wanted)
        if failed:
            raise next(iter(failed.values()))
        return [final[r] for r in request_ids]


def _sampler_row(s: Sequence) -> SamplerRow:
    st: SeqText = s.payload
    p = st.params
    return SamplerRow(
        p,
        st.generator,
        prompt_ids=s.token_ids[: s.num_prompt_tokens] if p.repetition_penalty != 1 else None,
        output_ids=s.output_token_ids if (p.has_penalties or p.min_tokens) else None,
        stop_ids=list(s.stop_token_ids) if p.min_tokens else None,
    )


def _check_text(text: str, field: str) -> None:
    """Raise BaigeError for text that is not valid Unicode (a lone surrogate from a JSON escape)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BaigeError(f"{field}: not valid Unicode (a lone surrogate at character {e.start})", param=field) from None
