"""``baige train --method grpo``: GRPO with rollouts from baige's own engine in the same process.

One step (``training.steps`` of them):

1. rollout: this rank's share of ``rl.prompts_per_step`` prompts, ``rl.group_size`` samples each, from
   the rank's :class:`~baige.runtime.infer.llm.LLM` (:mod:`.rollout`);
2. rewards (:mod:`.rewards`), weighted and summed per sample; group-normalised advantages (:mod:`.loss`);
3. the engine sleeps (KV cache released); ``rl.epochs_per_step`` optimizer steps over the samples in
   micro-batches of ``training.batch_size`` sequences: the clipped surrogate with the old logprobs of the
   first pass, the k3 KL to the frozen initial policy (``rl.kl_coef`` > 0), truncated importance
   sampling against the engine's logprobs (``rl.tis_cap`` > 0), aggregated by ``rl.loss_agg_mode`` over
   the whole step (every micro-batch and rank);
4. weight sync: the engine wakes up and takes the new weights in place (``weight_sync_s``).

The set-up, FSDP2, LoRA, the optimizer and its clipping, the schedule (over ``steps x
epochs_per_step`` optimizer steps), DCP checkpoints and the HF export are the shared ones
(:class:`~baige.runtime.train.base.TrainerBase`). Resume is exact: a step's prompts and sampling seeds
depend only on the step (:mod:`.prompts`), and the engine takes the resumed weights before the first
rollout. A LoRA run serves its adapter on the engine (multi-LoRA serving) and syncs only the
adapter. Not supported: tensor / pipeline / expert parallelism, Mixture-of-Experts models (the router
losses are not part of this loss).
"""

from __future__ import annotations

import copy
import math
import time

import torch
import torch.distributed as dist

from baige.errors import BaigeError
from baige.runtime.model.transformer import Transformer
from baige.runtime.train.base import TrainerBase, TrainResult
from baige.runtime.train.config import TrainConfig
from baige.runtime.train.lifecycle import StopSignal, end_run, inject_fault, step_boundary
from baige.runtime.train.metrics import peak_memory_bytes
from baige.runtime.train.rl import loss as L
from baige.runtime.train.rl.batch import MicroBatch, micro_batches, policy_logprobs
from baige.runtime.train.rl.prompts import read_prompts, sampling_seed, step_prompts, tokenize_prompt
from baige.runtime.train.rl.rewards import load_rewards, score
from baige.runtime.train.rl.rollout import (
    Sample,
    build_engine,
    generate,
    remove_adapter,
    sync_weights,
    write_adapter,
)


class GRPOTrainer(TrainerBase):
    """One GRPO run on this rank. Collective: every rank builds one with the same config."""

    def __init__(self, cfg: TrainConfig):
        self.rewards = load_rewards(cfg.rl)  # before the expensive set-up: a bad module:function fails now
        needs = ("answer",) if any(r.name == "exact_answer" for r in self.rewards) else ()
        self.records = read_prompts(cfg.data.train, needs, any(r.name == "json_schema" for r in self.rewards))
        self.reference: Transformer | None = None
        super().__init__(cfg)
        if cfg.rl.batch_invariant and self.autocast:  # bf16 autocast over fp32 weights rounds unlike bf16 weights
            raise BaigeError(
                f"--batch-invariant needs the trainer to compute in the engine's dtype; autocast to "
                f"{str(self.param_dtype).removeprefix('torch.')} over fp32 weights rounds differently: "
                "leave parallelism.mixed_precision_param at auto (float32 on the CPU) or set it to float32"
            )
        adapter = write_adapter(self.model, cfg.lora) if self.lora_params else None
        try:
            self.llm = build_engine(
                str(self.model_dir),
                self.model_config,
                cfg.rl,
                self.device,
                self.param_dtype,
                max(map(len, self.prompt_ids)),
                self.local_prompts,
                cfg.training.seed,
                adapter,
                cfg.lora.rank or 1,
            )
        finally:
            if adapter is not None:  # loaded (or failed): the engine does not read it again
                remove_adapter(adapter)

    @property
    def num_optimizer_steps(self) -> int:
        return self.cfg.training.steps * self.cfg.rl.epochs_per_step

    def _resolve_compile(self) -> bool:
        """``training.compile``; ``auto`` is off here: every micro-batch has another length (recompiles)."""
        return self.cfg.training.compile is True and super()._resolve_compile()

    def _auto_compute_dtype(self) -> torch.dtype:
        """``mixed_precision_param = auto``: bf16 on CUDA, fp32 on every CPU (bf16 CPUs included, unlike
        next-token training): GRPO's engine-vs-trainer logprob checks (``--batch-invariant``: bitwise) are
        tested in fp32 on the CPU; ``parallelism.mixed_precision_param = bfloat16`` asks for bf16."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32

    def _on_base_model(self, model: Transformer) -> None:
        """Refuse what GRPO does not support; keep the frozen reference policy when ``rl.kl_coef`` > 0."""
        if model.config.moe is not None:
            raise BaigeError("--method grpo does not train Mixture-of-Experts models yet (no router losses)")
        if self.cfg.rl.kl_coef > 0:
            self.reference = copy.deepcopy(model).requires_grad_(False).eval().to(self.device)

    def _build_data(self) -> None:
        """Tokenize every prompt; this rank's share of a step. Raises BaigeError (indivisible share, token
        ids outside the vocabulary, a prompt too long for the context with rl.max_tokens: naming its line)."""
        dp, per_step = self.dims.dp_size, self.cfg.rl.prompts_per_step
        if per_step % dp:
            raise BaigeError(f"rl.prompts_per_step {per_step} must be divisible by the data-parallel size {dp}")
        self.local_prompts = per_step // dp
        self.prompt_ids = [tokenize_prompt(self.tokenizer, r) for r in self.records]
        context, max_tokens = self.model_config.max_position_embeddings, self.cfg.rl.max_tokens
        for ids, r in zip(self.prompt_ids, self.records):
            if not ids or max(ids) >= self.model_config.vocab_size:
                raise BaigeError(f"{r.where}: the prompt tokenizes to nothing or to ids outside the model's vocabulary")
            if len(ids) + max_tokens > context:
                raise BaigeError(
                    f"{r.where}: the prompt ({len(ids)} tokens) plus rl.max_tokens ({max_tokens}) exceeds the "
                    f"model's context of {context} tokens"
                )

    # ---- one step ---------------------------------------------------------------------------------

    def _rollout(self) -> tuple[list[Sample], list[int]]:
        """This rank's samples of the current step and the record index of each of its prompts."""
        t, rl = self.cfg.training, self.cfg.rl
        picks = step_prompts(
            len(self.records), self.step, rl.prompts_per_step, self.dims.dp_size, self.dp_rank, t.seed,
            self.cfg.data.shuffle,
        )  # fmt: skip
        seeds = [sampling_seed(t.seed, position, rl.group_size) for position, _ in picks]
        samples = generate(self.llm, [self.prompt_ids[i] for _, i in picks], seeds, rl, bool(self.lora_params))
        return samples, [i for _, i in picks]

    def _score(self, samples: list[Sample], records: list[int]) -> dict[str, list[float]]:
        """Each reward's values on the samples (:func:`score`); the records' extra fields become lists."""
        recs = [self.records[records[s.group]] for s in samples]
        names = sorted({k for r in recs for k in r.fields})
        fields = {k: [r.fields.get(k) for r in recs] for k in names}
        fields["completion_ids"] = [s.completion_ids for s in samples]
        return score(self.rewards, [r.prompt for r in recs], [s.text for s in samples], fields)

    def _advantages(self, values: dict[str, list[float]], num_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted total reward per sample and its group advantage, both (P * G,) fp32.

        Raises:
            BaigeError: a total beyond fp32's range (it would make the advantages and the loss NaN).
        """
        total = sum(torch.tensor(values[r.name], dtype=torch.float64) * r.weight for r in self.rewards)
        big = total.abs() > torch.finfo(torch.float32).max
        if big.any():
            raise BaigeError(
                f"a sample's weighted reward is {float(total[big][0]):g}, beyond float32's range "
                f"({torch.finfo(torch.float32).max:.3g}): scale the rewards or their weights down"
            )
        total = total.float()
        adv = L.group_advantages(total.view(num_groups, -1), self.cfg.rl.norm_adv_by_std_in_grpo)
        return total, adv.reshape(-1)

    def _micro_loss(
        self, mb: MicroBatch, k: int, first: bool, counts: tuple[float, float], sums: dict[str, float]
    ) -> torch.Tensor:
        """One micro-batch's share of the step's loss (backward not taken). The first pass stores the
        old (and reference) logprobs and adds the first-pass metrics to ``sums``."""
        rl = self.cfg.rl
        with torch.autocast(self.device.type, dtype=self.param_dtype, enabled=self.autocast):
            lp, entropy = policy_logprobs(self.model, mb, rl.batch_invariant, entropy=first)
            if first:
                self._old.append(lp.detach())
                if self.reference is not None:
                    with torch.no_grad():
                        self._ref.append(policy_logprobs(self.reference, mb, rl.batch_invariant)[0])
        old, mask = self._old[k], mb.mask
        weights = L.tis_weights(old, mb.engine_logprobs, rl.tis_cap) if rl.tis_cap > 0 else None
        per_token, clipped = L.policy_loss(lp, old, mb.advantages, rl.clip_low, rl.clip_high, weights)
        if self.reference is not None:
            kl = L.kl_k3(lp, self._ref[k])
            per_token = per_token + rl.kl_coef * kl
        if first:
            diff = mb.engine_logprobs - old  # log(engine / trainer) on the sampled tokens
            sums["entropy"] += float((entropy * mask).sum())
            sums["mismatch"] += float((diff.abs() * mask).sum())
            # fp64: for the tiny differences of a matched engine, fp32's exp() rounding would swamp the estimate
            sums["engine_kl"] += float((L.kl_k3(mb.engine_logprobs.double(), old.double()) * mask).sum())
            if self.reference is not None:
                sums["kl"] += float((kl.detach() * mask).sum())
        sums["clipped"] += float((clipped.float() * mask).sum())
        return L.aggregate(per_token, mask, rl.loss_agg_mode, *counts, rl.max_tokens)

    def _update(self, batches: list[MicroBatch]) -> dict[str, float]:
        """``rl.epochs_per_step`` optimizer steps over the micro-batches. Returns this rank's metric sums
        and the step's (all-rank) loss and grad norm, each averaged over the epochs."""
        tokens = sum(float(mb.mask.sum()) for mb in batches)
        seqs = sum(float(mb.num_seqs) for mb in batches)
        counts = tuple(self._all_reduce_sum([tokens, seqs]))
        sums = dict.fromkeys(("entropy", "mismatch", "engine_kl", "kl", "clipped"), 0.0)
        self._old, self._ref = [], []
        epochs, loss_total, norm_total, lr = self.cfg.rl.epochs_per_step, 0.0, 0.0, 0.0
        for epoch in range(epochs):
            local = 0.0
            for k, mb in enumerate(batches):
                loss = self._micro_loss(mb, k, epoch == 0, counts, sums)
                (loss * self.dims.dp_size).backward()  # FSDP averages over the data-parallel ranks
                local += loss.item()
            loss_value = self._all_reduce_sum([local])[0]
            grad_norm, lr = self._clip_and_step(loss_value)
            loss_total, norm_total = loss_total + loss_value, norm_total + grad_norm
        self._old, self._ref = [], []
        return dict(sums, loss=loss_total / epochs, grad_norm=norm_total / epochs, lr=lr)

    def train_step(self) -> dict:
        """One GRPO step (rollout, rewards, update, weight sync). Returns the step's metrics record.

        Raises:
            BaigeError: a reward that fails, a non-finite loss or gradient norm.
        """
        t0 = time.perf_counter()
        samples, records = self._rollout()
        rollout_s = time.perf_counter() - t0
        values = self._score(samples, records)
        total, adv = self._advantages(values, len(records))
        self.llm.sleep(level=1)
        t1 = time.perf_counter()
        batches = micro_batches(samples, adv.tolist(), self.cfg.training.batch_size, self.device)
        update = self._update(batches)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        train_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        sync_weights(self.llm, self.model, bool(self.lora_params), self.param_dtype)
        sync_s = time.perf_counter() - t2
        self.step += 1
        trained = sum(mb.forward_tokens(self.cfg.rl.batch_invariant) for mb in batches) * self.cfg.rl.epochs_per_step
        step_s = time.perf_counter() - t0
        times = {"rollout_s": rollout_s, "train_s": train_s, "weight_sync_s": sync_s, "step_time_s": step_s}
        return self._record(samples, values, total, update, trained, times)

    # ---- metrics and the loop ---------------------------------------------------------------------

    def _all_reduce_max(self, values: list[float]) -> list[float]:
        if not dist.is_initialized():
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def _record(
        self,
        samples: list[Sample],
        values: dict[str, list[float]],
        total: torch.Tensor,
        update: dict[str, float],
        trained_tokens: int,
        times: dict[str, float],
    ) -> dict:
        """The step's metrics over every rank: per-sample values averaged over all samples, per-token
        ones over all response tokens, times the slowest rank's (seconds)."""
        total = total.double()
        local = [len(samples), float(total.sum()), float((total**2).sum())]
        local += [sum(len(s.completion_ids) for s in samples), trained_tokens]
        local += [update[k] for k in ("entropy", "mismatch", "engine_kl", "kl", "clipped")]
        for r in self.rewards:
            v = torch.tensor(values[r.name], dtype=torch.float64)
            local += [float(v.sum()), float((v**2).sum()), float(((v != 0) & (v != 1)).sum())]
        g = self._all_reduce_sum(local)
        keys = ("rollout_s", "train_s", "weight_sync_s", "step_time_s")
        rollout_s, train_s, sync_s, step_s = self._all_reduce_max([times[k] for k in keys])
        n, tokens = g[0], g[3]

        def mean_std(s: float, sq: float) -> tuple[float, float]:
            return s / n, math.sqrt(max(0.0, sq / n - (s / n) ** 2))

        record = {"split": "train", "step": self.step}
        record["reward"], record["reward_std"] = mean_std(g[1], g[2])
        for j, r in enumerate(self.rewards):
            s, sq, non_binary = g[10 + 3 * j : 13 + 3 * j]
            record[f"reward/{r.name}"], record[f"reward/{r.name}/std"] = mean_std(s, sq)
            if r.binary or non_binary == 0:
                record[f"accuracy/{r.name}"] = s / n
        entropy, mismatch, engine_kl, kl, clipped = g[5:10]
        return record | {
            "kl": kl / tokens if self.reference is not None else None,
            "logprob_mismatch": mismatch / tokens,
            "engine_trainer_kl": engine_kl / tokens,
            "clip_fraction": clipped / (tokens * self.cfg.rl.epochs_per_step),
            "entropy": entropy / tokens,
            "response_length": tokens / n,
            "loss": update["loss"],
            "grad_norm": update["grad_norm"],
            "lr": update["lr"],
            "rollout_tokens_per_s": tokens / rollout_s,
            "train_tokens_per_s": g[4] / train_s,
            "weight_sync_s": sync_s,
            "step_time_s": step_s,
            "rollout_s": rollout_s,
            "train_s": train_s,
            "peak_memory_gib": peak_memory_bytes(self.device) / 2**30,
        }

    def train(self) -> TrainResult:
        """Resume if asked, run GRPO to ``training.steps``, checkpoint, export. Collective."""
        cfg, rl = self.cfg, self.cfg.rl
        result = TrainResult()
        self._start_run()
        result.start_step = self.step
        if self.step:  # resumed: the engine still holds the weights it loaded from disk
            sync_weights(self.llm, self.model, bool(self.lora_params), self.param_dtype)
        rewards = ", ".join(f"{r.name} x {r.weight:g}" for r in self.rewards)
        self.log.print(
            f"{self._describe_model()} | {len(self.records)} prompts | per step {rl.prompts_per_step} prompts x "
            f"{rl.group_size} samples of <= {rl.max_tokens} tokens | rewards {rewards}"
        )
        with StopSignal() as stop:
            while self.step < cfg.training.steps and not result.stopped:
                inject_fault(self.step + 1, self.dist.rank)
                record = self.train_step()
                result.losses[self.step] = record["loss"]
                self.log.log(record)
                step_boundary(self, result, stop)
            end_run(self, result, stop)
        if cfg.checkpoint.export_hf and not result.stopped:
            result.export = self.export()
        self.llm.engine.close()
        self.log.close()
        return result
