"""Next-token training (pre-training and SFT): the packed-window data, the training step (fused CE,
accumulation, clipping), evaluation and the loop; the set-up they share with the other methods is
:class:`~baige.runtime.train.base.TrainerBase`. ``baige train`` builds a :class:`TrainConfig` and calls
:func:`run_training` on every rank.

Loss normalisation: every micro-batch's summed token cross-entropy is divided by the number of valid
target tokens of the whole step (all micro-batches, all data-parallel ranks), so accumulation and
data parallelism give the gradient of one big batch. FSDP averages gradients over data-parallel
(and context-parallel) ranks, so the backward loss is multiplied by their number. Under context
parallelism each rank's micro-batch is its shard of the windows (``context_parallel.py``): its valid
targets and summed loss are those of the shard, so the same sums give the one-process loss.
Mixture-of-Experts models add the router terms of :class:`~baige.runtime.train.moe.MoEBalancer`
(load balancing, z-loss) to each micro-batch's loss under the same factors; the reported ``loss`` stays
the cross-entropy. With ``model.mtp_depth`` the multi-token-prediction loss (``train/mtp.py``) is added the
same way and logged as ``mtp_loss``.
"""

from __future__ import annotations

import time

import torch

from baige.errors import BaigeError
from baige.runtime.model.gemma import lm_head_cross_entropy
from baige.runtime.train import lora
from baige.runtime.train.base import TrainerBase, TrainResult
from baige.runtime.train.config import TrainConfig
from baige.runtime.train.context_parallel import ContextParallel
from baige.runtime.train.data import DataLoader, eval_batches, load_windows
from baige.runtime.train.lifecycle import StopSignal, end_run, inject_fault, step_boundary
from baige.runtime.train.metrics import mfu, peak_flops, peak_memory_bytes
from baige.runtime.train.moe import RouterLogits
from baige.runtime.train.mtp import mtp_loss_sums, num_valid


class Trainer(TrainerBase):
    """One next-token training run on this rank. Collective: every rank builds one with the same config."""

    def __init__(self, cfg: TrainConfig):
        super().__init__(cfg)
        self.cp = self._context_parallel()
        self.mtp_loss: float | None = None  # the last step's mean MTP loss over depths (model.mtp_depth)
        self.flops_per_token = lora.flops_per_token(self.model, self.lora_params, cfg.training.seq_len)
        self.peak_flops, self.peak_source = peak_flops(self.device, self.param_dtype, cfg.metrics.peak_tflops)

    def _build_data(self) -> None:
        """Token windows of the train (and eval) files and the data loader; local rank 0 tokenizes
        into the cache first.

        Raises:
            BaigeError: the data holds a token id outside the model's vocabulary.
        """
        from baige.runtime.weights.hub import cache_dir

        cfg, t = self.cfg, self.cfg.training
        cache = cache_dir() / "tokens"
        if self.dist.local_rank != 0:
            self._barrier()
        self.train_windows = load_windows(cfg.data.train, self.tokenizer, self.tokenizer_dir, cache, t.seq_len)
        self.eval_windows = (
            load_windows(cfg.data.eval, self.tokenizer, self.tokenizer_dir, cache, t.seq_len) if cfg.data.eval else None
        )
        if self.dist.local_rank == 0:
            self._barrier()
        for w in (self.train_windows, self.eval_windows):
            if w is not None and w.max_id >= self.model_config.vocab_size:
                raise BaigeError(
                    f"the data holds token id {w.max_id} but the model's vocab_size is "
                    f"{self.model_config.vocab_size}: tokenizer and model do not match"
                )
        self.loader = DataLoader(
            self.train_windows,
            t.batch_size,
            t.grad_accum,
            self.dims.dp_size,
            self.dp_rank,
            t.seed,
            cfg.data.shuffle,
            documents=t.attn_mask_type == "block_causal",
        )

    def _context_parallel(self) -> ContextParallel | None:
        """The CP handle (``--cp``, or document masking on one rank); None: plain causal attention.

        Raises:
            BaigeError: CP on a Mixture-of-Experts model, on a dynamic-NTK RoPE model whose scaling
                would differ between shards (the window longer than ``max_position_embeddings``), or
                Ulysses with (per-TP-rank) head counts not divisible by the CP degree.
        """
        p, t, mc = self.cfg.parallelism, self.cfg.training, self.model_config
        if self.dims.cp > 1:
            if self.moe is not None:
                raise BaigeError("context parallel (--cp) does not support Mixture-of-Experts models yet")
            rope = (mc.rope_scaling or {}).get("rope_type")
            if rope == "dynamic" and t.seq_len > mc.max_position_embeddings:
                raise BaigeError(
                    f"context parallel (--cp) with dynamic NTK RoPE needs training.seq_len <= "
                    f"max_position_embeddings {mc.max_position_embeddings} (each shard would scale differently)"
                )
            for name in ("num_attention_heads", "num_key_value_heads"):
                per_rank = getattr(mc, name) // self.dims.tp
                if p.context_parallel_method == "ulysses" and per_rank % self.dims.cp:
                    raise BaigeError(
                        f"context_parallel_method=ulysses needs {name} per TP rank ({per_rank}) divisible by "
                        f"context_parallel_degree {self.dims.cp}; use context_parallel_method=ring"
                    )
            return ContextParallel.from_mesh(self.mesh, p.context_parallel_method)
        if t.attn_mask_type == "block_causal":
            return ContextParallel(None, 1, 0)
        return None

    def _shard(self, batch: tuple[torch.Tensor, ...]) -> tuple:
        """A loader micro-batch ``(input_ids, labels[, starts])`` (B, T) -> this rank's
        ``(input_ids, labels, positions, attn_metadata)`` on the device: the CP shard with global positions,
        or the whole windows with positions 0..T-1 and ``attn_metadata`` None (plain causal)."""
        input_ids, labels = batch[0].to(self.device), batch[1].to(self.device)
        if self.cp is None:
            return input_ids, labels, torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids), None
        return self.cp.shard(input_ids, labels, batch[2] if len(batch) > 2 else None)

    def _loss_sum(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata,
        normalizer: float,
        mtp_normalizers: list[float] | None = None,
    ) -> tuple[torch.Tensor, RouterLogits | None, list[torch.Tensor]]:
        """Summed token cross-entropy of one (sharded) micro-batch / ``normalizer``: :meth:`_shard`'s output,
        (B, T) int64 on the device. With gradients on an MoE model, also each sparse layer's (B*T, E) router
        logits. With ``mtp_normalizers`` (per MTP depth its step's valid targets), per depth the summed
        depth-k cross-entropy / its normalizer (:func:`~baige.runtime.train.mtp.mtp_loss_sums`), else []."""
        router_logits = RouterLogits() if self.moe is not None and torch.is_grad_enabled() else None
        mtp = [] if mtp_normalizers is not None else None
        with torch.autocast(self.device.type, dtype=self.param_dtype, enabled=self.autocast):
            # (B, T, hidden)
            hidden = self.model(input_ids, positions, attn_metadata, router_logits=router_logits, mtp_hidden=mtp)
            # FSDP keeps the root's parameters (lm_head) unsharded after forward, so this is the full weight
            # (in param_dtype under FSDP's MixedPrecisionPolicy).
            weight = self.model.lm_head.weight
            if self.autocast:  # the head's matmuls in the compute dtype too; the fp32 weight is cast inside
                hidden = hidden.to(self.param_dtype)  # the op, whose fp32 weight gradient needs no cast back
            loss = lm_head_cross_entropy(self.model_config, hidden, weight, labels, normalizer)  # Gemma: capped
            if mtp:
                mtp = [h.to(weight.dtype) for h in mtp]
                return loss, router_logits, mtp_loss_sums(mtp, weight, labels, mtp_normalizers)
        return loss, router_logits, []

    # ---- checkpoint state -------------------------------------------------------------------------

    def _extra_state(self) -> dict:
        moe = self.moe.state_dict() if self.moe is not None else {}
        return {"data": self.loader.state_dict(), **({"moe": moe} if moe else {})}

    def _load_extra_state(self, state: dict) -> None:
        self.loader.load_state_dict(state["data"])
        if "moe" in state:
            self.moe.load_state_dict(state["moe"])

    # ---- the loop ---------------------------------------------------------------------------------

    def train_step(self) -> tuple[float, float, float]:
        """One optimizer step over ``grad_accum`` micro-batches. Returns (loss, grad_norm, lr) of the step.

        Raises:
            BaigeError: a non-finite loss or gradient norm (before the parameters change).
        """
        micro = self.loader.next_step()
        if self.pipeline is None:
            micro = [self._shard(batch) for batch in micro]
        local_valid = sum(int((batch[1] != -100).sum()) for batch in micro)
        # Every rank of a TP x PP group holds the same data: divide the world sum by that degree.
        n_valid = self._all_reduce_sum([float(local_valid)])[0] / self.dims.model_parallel_size
        if n_valid == 0:
            raise BaigeError(f"step {self.step + 1}: no target token carries loss in the whole batch")
        depth, mtp_norms = self.model_config.mtp_depth, None
        if depth:  # per depth the valid targets of the whole step, as n_valid
            counts = [sum(num_valid(batch[1], depth)[k] for batch in micro) for k in range(depth)]
            mtp_norms = [v / self.dims.model_parallel_size for v in self._all_reduce_sum([float(c) for c in counts])]
        local_loss = local_mtp = 0.0  # loss on the last pipeline stage only; the world sum / TP is the step's loss
        if self.pipeline is not None:
            local_loss = self.pipeline.step(micro, n_valid, self.dims.dp_size)
            for logits in self.pipeline.router_logits if self.moe is not None else ():
                self.moe.observe_stages(logits)  # the expert load and router metrics; no router loss
        for batch in micro if self.pipeline is None else ():
            loss, router_logits, mtp_sums = self._loss_sum(*batch, n_valid, mtp_norms)
            total = loss if router_logits is None else loss + self.moe.micro_batch_loss(router_logits)
            if mtp_sums:  # DeepSeek-V3's lambda / D * sum_k L_k
                total = total + self.cfg.model.mtp_loss_scaling_factor / depth * sum(mtp_sums)
                local_mtp += sum(m.item() for m in mtp_sums) / depth
            (total * self.dims.dp_cp_size).backward()
            local_loss += loss.item()
        moe_values = self.moe.step_values() if self.moe is not None else []
        sums = self._all_reduce_sum([local_loss, local_mtp] + moe_values)
        loss_value = sums[0] / self.dims.tp
        self.mtp_loss = sums[1] / self.dims.tp if depth else None
        self.moe_losses = dict(zip(("aux_loss", "z_loss"), (v / self.dims.tp for v in sums[2:])))
        grad_norm, lr = self._clip_and_step(loss_value)
        if self.moe is not None:
            self.moe.end_step()
        self.step += 1
        return loss_value, grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over the eval data (``training.eval_batches`` rounds, 0 = all), nats/token."""
        t = self.cfg.training
        total, count = 0.0, 0.0
        documents = t.attn_mask_type == "block_causal"
        for batch in eval_batches(
            self.eval_windows, t.batch_size, self.dims.dp_size, self.dp_rank, t.eval_batches, documents
        ):
            if self.pipeline is not None:
                total += self.pipeline.eval_loss(*batch)
            else:
                batch = self._shard(batch)
                total += self._loss_sum(*batch, 1.0)[0].item()
            count += float((batch[1] != -100).sum())
        total, count = self._all_reduce_sum([total, count])
        total, count = total / self.dims.tp, count / self.dims.model_parallel_size
        loss = total / count if count else float("nan")
        self.log.log({"split": "eval", "step": self.step, "loss": loss, "tokens": int(count)})
        return loss

    def _log_train_step(self, loss: float, grad_norm: float, lr: float, tokens: float, t0: float) -> None:
        """The ``train`` record of this step: ``tokens`` per device trained since ``t0`` (perf_counter s)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - t0
        tps = tokens / elapsed
        self.log.log(
            {
                "split": "train",
                "step": self.step,
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_second_per_device": tps,
                "mfu": mfu(tps, self.flops_per_token, self.peak_flops),
                "peak_memory_gib": peak_memory_bytes(self.device) / 2**30,
                "seconds": elapsed,
                "trainable_params": self.lora_params or self.model_config.num_params(),
                **(dict(self.moe_losses, **self.moe.metrics()) if self.moe is not None else {}),
                **({"mtp_loss": self.mtp_loss} if self.mtp_loss is not None else {}),
                **(self.pipeline.metrics() if self.pipeline is not None else {}),
            }
        )

    def train(self) -> TrainResult:
        """Resume if asked, train to ``training.steps``, evaluate, checkpoint, export. Collective."""
        cfg, t = self.cfg, self.cfg.training
        result = TrainResult()
        self._start_run()
        result.start_step = self.step
        self.log.print(
            f"{self._describe_model()} | {self.train_windows.num_tokens} training tokens | global batch "
            f"{self.loader.global_batch} x {t.seq_len} tokens | peak {self.peak_flops / 1e12:.2f} TFLOP/s per "
            f"device ({self.peak_source})"
        )
        if self.pipeline is not None:
            self.log.print(self.pipeline.description)
        if self.eval_windows is not None and self.step == 0:
            result.eval_losses[0] = self.evaluate()
        tokens_per_step_per_device = self.loader.global_batch * t.seq_len / self.dist.world_size
        window_t0, window_steps = time.perf_counter(), 0
        with StopSignal() as stop:
            while self.step < t.steps and not result.stopped:
                inject_fault(self.step + 1, self.dist.rank)
                loss, grad_norm, lr = self.train_step()
                result.losses[self.step] = loss
                window_steps += 1
                if self.step % cfg.metrics.log_every == 0 or self.step == t.steps:
                    self._log_train_step(loss, grad_norm, lr, window_steps * tokens_per_step_per_device, window_t0)
                    window_t0, window_steps = time.perf_counter(), 0
                evaluated = False
                if self.eval_windows is not None and (
                    (t.eval_every and self.step % t.eval_every == 0) or self.step == t.steps
                ):
                    result.eval_losses[self.step] = self.evaluate()
                    evaluated = True
                if step_boundary(self, result, stop) or evaluated:
                    window_t0 = time.perf_counter()  # evaluation and saving are not training throughput
            end_run(self, result, stop)
        if cfg.checkpoint.export_hf and not result.stopped:
            result.export = self.export()
        self.log.close()
        return result


def run_training(cfg: TrainConfig) -> TrainResult:
    """Build the trainer of ``cfg.method`` and run it (every rank calls this). Collective."""
    if cfg.method == "grpo":
        from baige.runtime.train.rl.grpo import GRPOTrainer

        return GRPOTrainer(cfg).train()
    return Trainer(cfg).train()
