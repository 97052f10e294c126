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
from dataclasses import replace

import torch

from baige import kernels
from baige.errors import BaigeError
from baige.runtime.config import EngineConfig, parse_size
from baige.runtime.infer.block_manager import BlockManager
from baige.runtime.infer.engine_structured import EngineStructured
from baige.runtime.infer.engine_weights import EngineWeights
from baige.runtime.infer.input_processor import InputProcessor
from baige.runtime.infer.isolation import execute_isolated
from baige.runtime.infer.kv_cache import allocate_kv_cache
from baige.runtime.infer.kv_offload import attach_kv_offload
from baige.runtime.infer.kv_transfer.manager import KVTransfer
from baige.runtime.infer.lora import LoRAManager, LoRARequest
from baige.runtime.infer.output_processor import OutputProcessor, RequestState
from baige.runtime.infer.outputs import RequestFailed, RequestOutput
from baige.runtime.infer.pooling import PoolerConfig, pooling_runner
from baige.runtime.infer.pooling_engine import EnginePooling
from baige.runtime.infer.runner import ModelRunner
from baige.runtime.infer.sampling import SamplerRow, SamplingParams
from baige.runtime.infer.scheduler import Scheduler, Sequence, StepShape
from baige.runtime.infer.spec_decode.factory import build_proposer
from baige.runtime.infer.spec_decode.proposer import assign_drafts
from baige.runtime.infer.spec_decode.stats import SpecDecodeStats
from baige.runtime.infer.stop import StopMatcher
from baige.runtime.infer.structured import GrammarCompiler
from baige.runtime.infer.text import SeqText
from baige.runtime.infer.tp_worker import TensorParallelGroup, kv_config, load_engine_model, start_tensor_parallel
from baige.runtime.model.tokenizer import Tokenizer
from baige.runtime.model.transformer import Transformer
from baige.runtime.settings import settings
from baige.runtime.weights.hub import resolve_model

logger = logging.getLogger("baige.engine")


def _startup_lora(model: Transformer, cfg: EngineConfig) -> tuple[LoRAManager | None, list]:
    """The LoRA manager of ``--enable-lora`` (None without it) and ``(LoRARequest, adapter)`` for each
    ``--lora-modules`` entry, read and checked now (ids from 1, in order). Raises BaigeError (a bad
    adapter)."""
    if not cfg.enable_lora:
        return None, []
    lora = LoRAManager(model, cfg.max_lora_rank, tuple(cfg.lora_roots))
    adapters = []
    for i, (name, path) in enumerate((cfg.lora_modules or {}).items(), 1):
        request = LoRARequest(name, i, str(path))
        adapters.append((request, lora.read(request)))
    return lora, adapters


class Engine(EnginePooling, EngineWeights, EngineStructured):
    """Continuous-batching engine over one model.

    Args:
        model: the decoder (eval mode); rank 0's shard under tensor parallelism.
        tokenizer: its tokenizer.
        cfg: engine settings.
        tp: the tensor-parallel group (``tp_worker.TensorParallelGroup``) when ``model`` is a shard;
            the engine sizes the KV cache, tells the workers, and closes the group in :meth:`close`.
        pooler: set: the pooling runner (vLLM's ``--runner pooling``): the engine serves
            :meth:`add_pooling_request` (embeddings) and refuses generation.
    Raises:
        BaigeError: settings that cannot work (a KV budget below one max-length sequence,
        max_num_batched_tokens < max_num_seqs, speculative decoding with the pooling runner, ...).
    """

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        cfg: EngineConfig,
        tp: TensorParallelGroup | None = None,
        pooler: PoolerConfig | None = None,
    ):
        mc = model.config
        self.model, self.tokenizer, self.cfg, self.tp, self.pooler = model, tokenizer, cfg, tp, pooler
        if pooler is not None and cfg.speculative_config is not None:
            raise BaigeError("--speculative-config does not apply to the pooling runner (it never decodes)")
        self.max_model_len = _checked_limits(cfg, mc.max_position_embeddings)
        if isinstance(cfg.kv_cache_memory, str):
            cfg = self.cfg = replace(cfg, kv_cache_memory=parse_size(cfg.kv_cache_memory))
        p = next(model.parameters())
        kernels.backend(p)  # a bad BAIGE_KERNELS fails here, at start-up, not inside the first request
        if p.device.type == "cpu" and settings().cpu_keep_heap:
            kernels.keep_freed_heap()  # prefill temporaries reuse freed memory instead of faulting in new pages
        # --enable-lora: the adapters (infer/lora.py), read and checked before the KV cache is allocated
        self.lora, startup_adapters = _startup_lora(model, cfg)
        # sliding-window layers get a pool of their own (block_manager.py), except where the KV moves as
        # whole blocks of every layer (offload, P/D transfer) or lives on other ranks
        separate = tp is None and cfg.kv_offload_size is None and cfg.kv_transfer_config is None
        kv = self.kv_cache = allocate_kv_cache(model, kv_config(model), cfg, self.max_model_len, tp is None, separate)
        num_blocks, kv_dtype = kv.num_blocks, kv.dtype
        if tp is not None:
            tp.send_kv_cache(num_blocks, cfg.block_size, kv_dtype)
        self.block_manager = BlockManager(
            num_blocks, cfg.block_size, cfg.enable_prefix_caching, kv.sliding_window, kv.num_sliding_blocks
        )
        self.kv_offload = attach_kv_offload(cfg, model, self.kv_cache, self.block_manager)  # a second KV tier
        self.proposer = build_proposer(cfg, self.max_model_len, tokenizer, model, num_blocks, kv_dtype)
        self.kv_transfer = KVTransfer.build(cfg.kv_transfer_config, model, self.kv_cache, self.block_manager)
        self.spec_stats = SpecDecodeStats()
        self.num_speculative_tokens = cfg.speculative_config.num_speculative_tokens if self.proposer else 0
        self.scheduler = Scheduler(
            self.block_manager,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            self.max_model_len,
            on_release=self.proposer.release if self.proposer else None,
            max_loras=cfg.max_loras if cfg.enable_lora else None,
            on_finish=self.kv_transfer.on_finish if self.kv_transfer is not None else None,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            # n > 1 prompts computed once and forked (scheduler.py), except where the copy-on-write of a block
            # cannot reach every copy of the K/V: the sliding layers' own pool (not forked), tensor-parallel
            # workers' shards
            fork=self.block_manager.sliding is None and tp is None and pooler is None,
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
        self.runner.keep_hidden = self.proposer is not None and self.proposer.needs_hidden  # an MTP proposer
        if self.lora is not None:
            self.runner.lora = self.lora
            for request, adapter in startup_adapters:
                self.lora.add(request, adapter)
        self.vocab_size = mc.vocab_size
        self.eos_token_ids = list(tokenizer.eos_token_ids or mc.eos_token_id)
        self.input_processor = InputProcessor(tokenizer, self.vocab_size, self.max_model_len, self.grammars)
        self.output_processor = OutputProcessor(self.scheduler, self.eos_token_ids)
        self.generator = torch.Generator(device=p.device).manual_seed(cfg.seed)  # unseeded requests
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self.requests: dict[str, RequestState] = {}
        self._failures: list[tuple[str, RequestFailed]] = []
        self.num_generated_tokens = 0
        # a list (set by benchmarks): every step appends the scheduler.StepShape it ran
        self.step_shapes: list[StepShape] | None = None
        self.num_prompt_tokens = 0
        self.num_constrained_requests = 0

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> "Engine":
        """Resolve and load the model and tokenizer named by ``cfg.model``; with
        ``tensor_parallel_size`` > 1 start the workers first (``tp_worker.start_tensor_parallel``) and
        load rank 0's shard. Raises BaigeError."""
        model_dir = resolve_model(cfg.model)
        tokenizer = Tokenizer.from_dir(model_dir)
        pooler = pooling_runner(cfg.runner, model_dir)
        tp = start_tensor_parallel(cfg, model_dir) if cfg.tensor_parallel_size > 1 else None
        try:
            model = load_engine_model(cfg, model_dir, tp.comm if tp is not None else None, pooling=pooler is not None)
            return cls(model, tokenizer, cfg, tp, pooler)
        except BaseException:
            if tp is not None:
                tp.close()
            raise

    def close(self) -> None:
        """Stop the KV transport, the KV offload writer and the tensor-parallel workers. The engine cannot
        step afterwards."""
        for part in (self.kv_transfer, self.kv_offload, self.tp):
            if part is not None:
                part.close()

    def kill(self) -> None:
        """SIGKILL the tensor-parallel workers, remove their rendezvous, no waiting (no-op on one rank)."""
        if self.tp is not None:
            self.tp.kill()

    # ---- requests --------------------------------------------------------------------------
    @property
    def max_prompt_chars(self) -> int:
        """:attr:`InputProcessor.max_prompt_chars` (the server's size check of a chat)."""
        return self.input_processor.max_prompt_chars

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """Tokenize and validate a prompt (:meth:`InputProcessor.prepare`). Raises BaigeError as that
        does, while the engine is asleep (:meth:`sleep`), and under the pooling runner."""
        if self.pooler is not None:
            raise BaigeError("this model runs the pooling runner (--runner pooling): it embeds, it does not generate")
        if self.is_sleeping:
            raise BaigeError("the engine is asleep (its KV cache is released); call wake_up() first")
        return self.input_processor.prepare(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict | None = None,
    ) -> None:
        """Queue a request (``params.n`` sequences), with ``lora_request``'s adapter (loaded from its
        path on first use) or the base model; ``kv_transfer_params``: vLLM's P/D fields
        (:meth:`KVTransfer.on_add`). Raises BaigeError as :meth:`prepare`, for a request id already in
        flight, for an adapter without ``enable_lora`` or that cannot load (``LoRANotFound`` for an
        unknown name without a path), or for ``kv_transfer_params`` without ``kv_transfer_config``."""
        if request_id in self.requests:
            raise BaigeError(f"request id {request_id!r} is already in use")
        if kv_transfer_params is not None and self.kv_transfer is None:
            raise BaigeError("kv_transfer_params: this server has no --kv-transfer-config", param="kv_transfer_params")
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
        if len(seqs) > 1:
            for seq in seqs:
                seq.siblings = seqs
        kvt = self.kv_transfer  # queued only once all are built: a failure above leaves nothing behind
        if kvt is None or not kvt.on_add(seqs, kv_transfer_params, self.scheduler):
            for seq in seqs:
                self.scheduler.add(seq)
        self.requests[request_id] = RequestState(
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
        if self.kv_transfer is not None:
            self.kv_transfer.poll(self.scheduler)
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        if not len(batch):
            if self.kv_transfer is not None:  # only pulls in flight: wait for one instead of spinning
                self.kv_transfer.wait(0.05)
            return []
        if self.step_shapes is not None:
            mc = self.model.config  # a model with sliding-window layers: the step's window counts too
            window = mc.sliding_window if any(mc.layer_window(i) for i in range(mc.num_hidden_layers)) else None
            self.step_shapes.append(batch.shape(window))
        now = time.monotonic()
        rows = [_sampler_row(s) for s in batch.sampling_seqs]
        n_spec = [len(s.spec_token_ids) for s in batch.seqs]
        tokens, logprobs, prompt_lps = execute_isolated(
            self.runner, batch, rows, self._start_masks(batch), self.requests.__contains__, self._fail
        )
        for seq in batch.sampling_seqs:
            req = self.requests.get(seq.request_id)
            if req is not None and req.scheduled_time is None:
                req.scheduled_time = now
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
        pooled = [self._finish_pooled(s, now) for s in batch.seqs if s.pooling is not None]
        lp_of = {s.seq_id: lp for s, lp in zip(batch.sampling_seqs, logprobs)}
        touched: dict[str, RequestState] = {}
        for seq in got:
            req = self.requests.get(seq.request_id)
            if req is None:  # failed earlier in this step
                continue
            try:
                self.num_generated_tokens += self.output_processor.process_tokens(seq, lp_of[seq.seq_id])
            except Exception as e:  # a detokenizer or stop-string problem of this request only
                self._fail(seq.request_id, e)
                touched.pop(seq.request_id, None)
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            touched[req.request_id] = req
        return [o for o in pooled if o is not None] + [self._output(req, now) for req in touched.values()]

    def _propose(self) -> None:
        """Draft tokens for the running sequences that decode next step (:func:`assign_drafts`)."""
        if self.runner.keep_hidden:
            hidden, self.runner.last_hidden = self.runner.last_hidden, []
            self.proposer.observe(hidden)
        assign_drafts(
            self.proposer,
            self.scheduler.running,
            self.num_speculative_tokens,
            self.max_model_len,
            _sampler_row,
            self.cfg.speculative_config.disable_by_batch_size,
        )

    def _output(self, req: RequestState, now: float) -> RequestOutput:
        out = self.output_processor.make_output(req, now)
        if out.finished:
            if self.kv_transfer is not None:
                out.kv_transfer_params = self.kv_transfer.take_params(req.request_id)
            del self.requests[req.request_id]
            logger.info(
                "request %s: %d prompt tokens, %d output tokens, %.3f s, finish %s",
                req.request_id,
                len(req.prompt_token_ids),
                sum(len(o.token_ids) for o in out.outputs),
                now - req.arrival_time,
                ",".join(str(o.finish_reason) for o in out.outputs),
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


def _checked_limits(cfg: EngineConfig, max_position_embeddings: int) -> int:
    """The engine's ``max_model_len`` (``cfg``'s, else the model's context). Raises BaigeError for a length
    past the model's context, a token budget below ``max_num_seqs``, or sizes below 1."""
    max_model_len = cfg.max_model_len or max_position_embeddings
    if max_model_len > max_position_embeddings:
        raise BaigeError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings ({max_position_embeddings})"
        )
    if cfg.max_num_batched_tokens < cfg.max_num_seqs:
        raise BaigeError(
            f"--max-num-batched-tokens ({cfg.max_num_batched_tokens}) must be >= --max-num-seqs ({cfg.max_num_seqs})"
        )
    if cfg.block_size < 1 or cfg.max_num_seqs < 1:
        raise BaigeError("--block-size and --max-num-seqs must be >= 1")
    return max_model_len


def _sampler_row(s: Sequence) -> SamplerRow | None:
    if s.pooling is not None:  # prefill only: never samples
        return None
    st: SeqText = s.payload
    p = st.params
    return SamplerRow(
        p,
        st.generator,
        prompt_ids=s.token_ids[: s.num_prompt_tokens] if p.repetition_penalty != 1 else None,
        output_ids=s.output_token_ids if (p.has_penalties or p.min_tokens) else None,
        stop_ids=list(s.stop_token_ids) if p.min_tokens else None,
    )
