"""``baige train``: pre-train or fine-tune with FSDP2 / tensor / pipeline parallel, one process or many.

Launch forms:
  baige train --data corpus.txt --steps 200 --output runs/a                   (one process)
  baige train --method grpo --data prompts.jsonl --reward exact_answer ...    (RL: GRPO, rollouts from baige's engine)
  torchrun --nproc-per-node 8 --no-python baige train --config run.toml       (one node)
  srun ... torchrun ... baige train ... / srun baige train ...                (SLURM: scripts/slurm/train.sbatch)
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.app import app
from baige.cli.options import MODEL_HELP
from baige.runtime.train.config import TrainConfig

D = TrainConfig()  # the defaults a flag left out keeps (unless --config or --set gives the field)

SET_HELP = (
    "Override any config field: --set section.field=value (TOML value; repeatable), e.g. "
    "--set training.steps=200 --set optimizer.betas=[0.9,0.99] --set lr_scheduler.name=wsd. "
    "Sections: model, data, training, optimizer, lr_scheduler, parallelism, checkpoint, metrics, moe "
    "(router_aux_loss_coef, router_z_loss_coef, load_balance=aux_loss|bias, bias_update_rate), lora "
    "(rank, alpha, dropout, targets, use_rslora, merge), rl (--method grpo: group_size, prompts_per_step, "
    "max_tokens, temperature, top_p, stop, clip_low, clip_high, kl_coef, epochs_per_step, tis_cap, "
    "loss_agg_mode=token-mean|seq-mean-token-mean|seq-mean-token-sum|seq-mean-token-sum-norm, "
    "norm_adv_by_std_in_grpo, reward_regex, reward_json_schema, overlong_buffer)."
)


@app.command()
def train(
    config: Annotated[
        Optional[Path], typer.Option("--config", help="TOML file with the sections listed under --set.")
    ] = None,
    method: Annotated[
        Optional[str],
        typer.Option(
            "--method",
            help="sft (default) / pretrain: next-token training, the data decides which tokens carry loss; grpo: "
            "RL with GRPO on --data prompts (JSONL: prompt or messages, plus fields the rewards read), rollouts "
            "from baige's engine in the same process, the rl section of --set.",
        ),
    ] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP + " (pretrained weights)")] = None,
    model_config: Annotated[
        Optional[str],
        typer.Option(
            "--model-config",
            help=(
                "Train from scratch (seeded init): a config.json or a preset (debug, moe-tiny, smollm2-135m, "
                "llama3.2-1b)."
            ),
        ),
    ] = None,
    tokenizer: Annotated[
        Optional[str], typer.Option(help="Tokenizer directory or model spec (default: the model's).")
    ] = None,
    data: Annotated[
        Optional[list[str]],
        typer.Option(
            "--data", help='Training file (repeatable): .txt, or .jsonl with "text" or chat "messages" (SFT).'
        ),
    ] = None,
    eval_data: Annotated[Optional[list[str]], typer.Option("--eval-data", help="Held-out file (repeatable).")] = None,
    eval_every: Annotated[
        Optional[int], typer.Option(help="Steps between evaluations of --eval-data (0 = at the end only; default 0).")
    ] = None,
    steps: Annotated[Optional[int], typer.Option(help=f"Optimizer steps (default {D.training.steps}).")] = None,
    seq_len: Annotated[
        Optional[int], typer.Option(help=f"Tokens per training window (default {D.training.seq_len}).")
    ] = None,
    batch_size: Annotated[
        Optional[int], typer.Option(help=f"Windows per device per micro-batch (default {D.training.batch_size}).")
    ] = None,
    grad_accum: Annotated[
        Optional[int], typer.Option(help=f"Micro-batches per optimizer step (default {D.training.grad_accum}).")
    ] = None,
    lr: Annotated[
        Optional[float],
        typer.Option(
            help=f"Peak learning rate (default {D.optimizer.lr:g}): reached after lr_scheduler.warmup_steps of linear "
            f"warm-up, then lr_scheduler.name decays it (default {D.lr_scheduler.name})."
        ),
    ] = None,
    optimizer: Annotated[
        Optional[str],
        typer.Option(
            "--optimizer",
            help="adamw (default) or muon: Newton-Schulz orthogonalised momentum on the hidden matrices, AdamW on "
            "embeddings, the LM head, norms and biases, one --lr for both (optimizer.momentum, optimizer.ns_steps).",
        ),
    ] = None,
    dtype: Annotated[
        Optional[str],
        typer.Option(
            "--dtype",
            help="Compute dtype (parallelism.mixed_precision_param): auto (default: bf16 on CUDA and on CPUs with "
            "native bf16, AVX-512 BF16 or AMX; else float32), float32 or bfloat16. Master weights, gradient "
            "reductions and optimizer state stay fp32.",
        ),
    ] = None,
    output: Annotated[
        Optional[str],
        typer.Option(
            "--output", "-o", help=f"Run directory (checkpoints, metrics.jsonl, the hf export); default {D.output}."
        ),
    ] = None,
    resume: Annotated[
        Optional[str],
        typer.Option(
            help="auto (newest complete checkpoint in the output dir, default), none (start fresh) or a step directory."
        ),
    ] = None,
    tp: Annotated[
        Optional[int],
        typer.Option(
            "--tp", help="Tensor-parallel degree (default 1); world_size must be divisible by it times --dp-replicate."
        ),
    ] = None,
    dp_replicate: Annotated[Optional[int], typer.Option(help="HSDP replica count (1 = FSDP).")] = None,
    ep: Annotated[
        Optional[int],
        typer.Option(
            "--ep",
            help="Expert-parallel degree for MoE models (default 1): experts "
            "sharded over EP ranks taken from the data-parallel shard dimension "
            "(must divide it and the expert count); tokens move by all_to_all.",
        ),
    ] = None,
    pp: Annotated[
        Optional[int],
        typer.Option(
            "--pp",
            help="Pipeline-parallel degree (default 1): stages over PP ranks, the "
            "outermost mesh dimension (torch.distributed.pipelining); must divide world_size.",
        ),
    ] = None,
    pp_schedule: Annotated[
        Optional[str],
        typer.Option(
            "--pp-schedule",
            help="Pipeline schedule: GPipe, 1F1B (default), Interleaved1F1B or ZBVZeroBubble (2 stages per rank).",
        ),
    ] = None,
    pp_microbatches: Annotated[
        Optional[int],
        typer.Option(
            "--pp-microbatches",
            help="Pipeline micro-batches per --batch-size batch (must divide it; default: one window each).",
        ),
    ] = None,
    cp: Annotated[
        Optional[int],
        typer.Option(
            "--cp",
            help="Context-parallel degree (default 1): each window's sequence sharded over CP ranks (ring "
            "attention; --set parallelism.context_parallel_method=ulysses for all-to-all); --seq-len must be a "
            "multiple of 2 x CP.",
        ),
    ] = None,
    ac: Annotated[
        Optional[str], typer.Option("--ac", help="Activation checkpointing: none, full, or N (every N-th block).")
    ] = None,
    compile: Annotated[
        Optional[bool],
        typer.Option(
            "--compile/--no-compile",
            help=(
                "torch.compile each block (default: on for single-device CPU training when a C++ compiler is on PATH)."
            ),
        ),
    ] = None,
    device: Annotated[Optional[str], typer.Option(help="auto, cpu or cuda.")] = None,
    seed: Annotated[
        Optional[int], typer.Option(help=f"Seed for init and data order, 0 .. 2**63-1 (default {D.training.seed}).")
    ] = None,
    lora_rank: Annotated[
        Optional[int],
        typer.Option(
            help="LoRA fine-tuning with adapters of this rank (>= 1): the base frozen (bf16/fp32 or a baige int8/int4 "
            "checkpoint: QLoRA-style), the adapters written as a PEFT directory <output>/adapter."
        ),
    ] = None,
    lora_alpha: Annotated[
        Optional[float], typer.Option(help=f"LoRA alpha: scaling alpha / rank (default {D.lora.alpha:g}).")
    ] = None,
    lora_dropout: Annotated[
        Optional[float], typer.Option(help="Dropout on the adapters' input, in [0, 1) (default 0).")
    ] = None,
    lora_targets: Annotated[
        Optional[str], typer.Option(help=f"Comma-separated modules to adapt (default {','.join(D.lora.targets)}).")
    ] = None,
    lora_use_rslora: Annotated[
        Optional[bool],
        typer.Option("--lora-use-rslora/--no-lora-use-rslora", help="rsLoRA scaling alpha / sqrt(rank) (default off)."),
    ] = None,
    merge: Annotated[
        Optional[bool],
        typer.Option(
            "--merge/--no-merge", help="With LoRA, also write <output>/hf: the base with the adapter merged in."
        ),
    ] = None,
    reward: Annotated[
        Optional[list[str]],
        typer.Option(
            "--reward",
            help="GRPO reward NAME[=WEIGHT] (repeatable; weighted sum): exact_answer (last \\boxed{} or number vs "
            "the record's answer), regex (rl.reward_regex), json_schema (rl.reward_json_schema or the record's "
            "json_schema), length_penalty (DAPO overlong), or module:function(prompts, completions, **fields).",
        ),
    ] = None,
    batch_invariant: Annotated[
        Optional[bool],
        typer.Option(
            "--batch-invariant",
            help="GRPO: engine and trainer logprobs bitwise equal (batch-invariant kernels; slower).",
        ),
    ] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help=SET_HELP)] = None,
) -> None:
    """Train or fine-tune a model; checkpoints (DCP), metrics.jsonl and an HF export go to --output."""
    from baige.runtime.train.config import load_train_config
    from baige.runtime.train.trainer import run_training

    flags = {
        "method": method,
        "rl.rewards": reward or None,
        "rl.batch_invariant": batch_invariant,
        "model.name": model,
        "model.config": model_config,
        "model.tokenizer": tokenizer,
        "data.train": data or None,
        "data.eval": eval_data or None,
        "training.eval_every": eval_every,
        "training.steps": steps,
        "training.seq_len": seq_len,
        "training.batch_size": batch_size,
        "training.grad_accum": grad_accum,
        "optimizer.lr": lr,
        "optimizer.name": optimizer,
        "parallelism.mixed_precision_param": dtype,
        "output": output,
        "checkpoint.resume": resume,
        "parallelism.tensor_parallel_degree": tp,
        "parallelism.data_parallel_replicate_degree": dp_replicate,
        "parallelism.expert_parallel_degree": ep,
        "parallelism.pipeline_parallel_degree": pp,
        "parallelism.pipeline_parallel_schedule": pp_schedule,
        "parallelism.pipeline_parallel_microbatches": pp_microbatches,
        "parallelism.context_parallel_degree": cp,
        "training.activation_checkpointing": ac,
        "training.compile": compile,
        "training.device": device,
        "training.seed": seed,
        "lora.rank": lora_rank,
        "lora.alpha": lora_alpha,
        "lora.dropout": lora_dropout,
        "lora.targets": [t.strip() for t in lora_targets.split(",")] if lora_targets is not None else None,
        "lora.use_rslora": lora_use_rslora,
        "lora.merge": merge,
    }
    cfg = load_train_config(config, flags, set_)
    run_training(cfg)
