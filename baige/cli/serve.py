"""``baige serve``: the OpenAI-compatible HTTP server (paged KV cache, continuous batching)."""

from __future__ import annotations

import logging
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from baige.cli.app import app
from baige.cli.options import (
    MODEL_HELP,
    BatchInvariantOpt,
    Device,
    DType,
    ExpertParallelOpt,
    KVTransferConfigOpt,
    SpeculativeConfigOpt,
    TensorParallelOpt,
)
from baige.errors import BaigeError


class ToolCallParser(str, Enum):
    auto = "auto"
    hermes = "hermes"
    llama3_json = "llama3_json"
    mistral = "mistral"


def read_chat_template(value: str) -> tuple[str, str]:
    """``--chat-template``: a jinja file, or (as vLLM takes it) the template itself -> (template, the
    name its errors give it). Compiled and rendered once on a sample conversation now, before the model
    loads (:func:`~baige.runtime.model.chat_template.probe_template`). Raises BaigeError."""
    from baige.runtime.model.chat_template import probe_template

    path = Path(value)
    if path.is_file():
        try:
            source, where = path.read_text(encoding="utf-8"), f"--chat-template {path}"
        except (OSError, UnicodeDecodeError) as e:
            raise BaigeError(f"--chat-template: cannot read {path} ({e})") from None
    elif "{{" in value or "{%" in value:
        source, where = value, "--chat-template"
    else:
        raise BaigeError(f"--chat-template: {value} is not a file (nor a jinja template)")
    probe_template(source, where)
    return source, where


def parse_lora_modules(values: list[str] | None, enable_lora: bool, served_name: str) -> dict[str, str] | None:
    """``--lora-modules NAME=DIR ...`` (vLLM's form) -> {name: dir}, checked before the model loads.

    Raises:
        BaigeError: without --enable-lora, a value not NAME=DIR, a repeated name or the base model's
        name, a DIR that is not a directory.
    """
    if not values:
        return None
    if not enable_lora:
        raise BaigeError("--lora-modules needs --enable-lora")
    out: dict[str, str] = {}
    for v in values:
        name, eq, path = v.partition("=")
        if not (eq and name and path):
            raise BaigeError(f"--lora-modules: {v!r} is not NAME=DIR")
        if name in out or name == served_name:
            raise BaigeError(f"--lora-modules: the name {name!r} is used twice (or is the base model's name)")
        if not Path(path).is_dir():
            raise BaigeError(f"--lora-modules: {name}={path}: not a directory")
        out[name] = path
    return out


LongPrefillThresholdOpt = Annotated[
    int,
    typer.Option(
        min=0,
        help="Most prompt tokens one request computes per step (0: no limit but the step's), so a long "
        "prompt's prefill runs in chunks that leave room for the prompts queued behind it.",
    ),
]
KVOffloadSizeOpt = Annotated[
    Optional[str],
    typer.Option(
        help="Second KV tier, e.g. 8GB or 512MiB: prefix-cache blocks evicted from the pool are kept there "
        "(host memory for a GPU pool, files under --kv-offload-dir for a CPU pool) and loaded back on a later "
        "prefix hit instead of recomputed. Default: off."
    ),
]
KVOffloadDirOpt = Annotated[
    Optional[str],
    typer.Option(
        help="Directory of the second KV tier's files (reused across restarts of the same model). "
        "Default: a temporary directory removed at exit (CPU pool) or host memory (GPU pool)."
    ),
]
EnableLoraOpt = Annotated[
    bool,
    typer.Option(
        "--enable-lora/--no-enable-lora",
        help="Serve LoRA adapters (PEFT directories): a request's `model` picks "
        "one; POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them at run time.",
    ),
]
LoraModulesOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        help="Adapters loaded at start-up, NAME=DIR (several may follow one flag, as in vLLM); each is listed "
        "in /v1/models under NAME."
    ),
]
MaxLorasOpt = Annotated[int, typer.Option(min=1, help="Most distinct adapters in one step (requests for others wait).")]
MaxLoraRankOpt = Annotated[int, typer.Option(min=1, help="Largest adapter rank accepted.")]
LoraRootOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        help="Read adapters only from inside this directory (repeatable; as vLLM's --allowed-local-media-path): "
        "a --lora-modules DIR or a load_lora_adapter lora_path elsewhere, symlinks and .. resolved, is refused. "
        "Default: any directory."
    ),
]


def lora_engine_args(
    enable_lora: bool,
    lora_modules: list[str] | None,
    max_loras: int,
    max_lora_rank: int,
    served_name: str,
    lora_root: list[str] | None = None,
) -> dict:
    """The EngineConfig fields of the LoRA options. Raises BaigeError as :func:`parse_lora_modules`."""
    return {
        "enable_lora": enable_lora,
        "lora_modules": parse_lora_modules(lora_modules, enable_lora, served_name),
        "max_loras": max_loras,
        "max_lora_rank": max_lora_rank,
        "lora_roots": tuple(lora_root or ()),
    }


DP_ROUTER_OPTIONS = ("--host", "--port", "--data-parallel-size", "--api-key")  # the router's, not the ranks'


def rank_args(argv: list[str]) -> list[str]:
    """One data-parallel rank's ``baige serve`` arguments: the command line after ``serve`` less the
    options the router takes (``DP_ROUTER_OPTIONS``, as ``--opt VALUE`` or ``--opt=VALUE``; the API key
    reaches the ranks as ``BAIGE_API_KEY``)."""
    args = argv[argv.index("serve") + 1 :] if "serve" in argv else list(argv)
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in DP_ROUTER_OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in DP_ROUTER_OPTIONS)):
            out.append(arg)
    return out


def start_data_parallel(
    ctx: typer.Context,
    size: int,
    tp: int,
    device: str,
    api_key: str | None,
    host: str,
    port: int,
    log_level: str,
    shutdown_timeout: float,
) -> None:
    """``--data-parallel-size N``: N copies of this command behind one router (:mod:`baige.runtime.router.dp`)."""
    from baige.runtime.router.dp import rank_environments, serve_data_parallel

    gpus = 0
    if device != "cpu":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device == "cuda" and not gpus:
            raise BaigeError("--device cuda: no CUDA device is visible")
    envs = rank_environments(size, tp, gpus)
    if api_key:
        for env in envs:
            env["BAIGE_API_KEY"] = api_key
    argv = (ctx.obj or {}).get("argv") or sys.argv[1:]
    serve_data_parallel(rank_args(argv), envs, host, port, log_level, shutdown_timeout=shutdown_timeout)


class ReasoningParser(str, Enum):
    none = "none"
    auto = "auto"
    qwen3 = "qwen3"
    deepseek_r1 = "deepseek_r1"
    gpt_oss = "gpt_oss"


class Runner(str, Enum):
    auto = "auto"
    generate = "generate"
    pooling = "pooling"


class LogLevel(str, Enum):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"


@app.command()
def serve(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=MODEL_HELP)] = None,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 8000,
    served_model_name: Annotated[
        Optional[str], typer.Option(help="Model name clients send (default: --model).")
    ] = None,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            envvar="BAIGE_API_KEY",
            help="Require 'Authorization: Bearer KEY' on /v1/* (and on the RL endpoints, --enable-rl-endpoints).",
        ),
    ] = None,
    max_model_len: Annotated[
        Optional[int],
        typer.Option(
            min=2, help="Context limit in tokens (prompt + output). Default: the model's max_position_embeddings."
        ),
    ] = None,
    dtype: Annotated[
        DType,
        typer.Option(
            help="Weights dtype (and the KV cache's unless --kv-cache-dtype is set); auto = the checkpoint's."
        ),
    ] = DType.auto,
    device: Annotated[Device, typer.Option(help="auto = cuda when available, else cpu.")] = Device.auto,
    seed: Annotated[
        int, typer.Option(help="Seed of the RNG that requests without a seed sample from (any 64-bit integer).")
    ] = 0,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Most sequences in one step.")] = 128,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="Most tokens computed in one step (prefill chunks + decodes).")
    ] = 2048,
    long_prefill_token_threshold: LongPrefillThresholdOpt = 0,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV-cache block.")] = 16,
    kv_cache_memory: Annotated[
        Optional[str],
        typer.Option(
            help="KV-cache size, e.g. 2GB or 512MiB. Default: 90% of free GPU memory, or 10% of available RAM on CPU."
        ),
    ] = None,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option(
            "--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse the KV blocks of shared prompt prefixes."
        ),
    ] = True,
    kv_offload_size: KVOffloadSizeOpt = None,
    kv_offload_dir: KVOffloadDirOpt = None,
    enforce_eager: Annotated[
        bool,
        typer.Option(
            help=(
                "GPU: never capture the decode step as CUDA graphs (torch.compile reduce-overhead). No effect on "
                "CPU, where decode steps are never captured."
            )
        ),
    ] = False,
    quantization: Annotated[
        Optional[str],
        typer.Option(
            help="Rewrite the loaded fp32 model's linears for CPU decode speed: fp16-weight (fp16 weights, fp32 math: "
            "half the bytes, near-lossless) or int8-weight (int8 per channel, rounded at load: a quarter). On an "
            "int8/int4 checkpoint: its remaining fp32 linears (the tied lm_head). Default: none."
        ),
    ] = None,
    kv_cache_dtype: Annotated[
        DType,
        typer.Option(
            help="KV-cache dtype; auto = the model's. On CPU float16 under an fp32 model halves the cache's "
            "memory and the attention's reads (K/V rounded to fp16; bfloat16 works but takes the slower "
            "PyTorch path). On CUDA only the model's dtype."
        ),
    ] = DType.auto,
    log_level: Annotated[
        LogLevel, typer.Option(help="Logging level (one line per request at info).", case_sensitive=False)
    ] = LogLevel.info,
    max_n: Annotated[
        int, typer.Option(min=1, help="Most sequences one request may ask for (n x prompts); more is a 400.")
    ] = 128,
    max_request_bytes: Annotated[
        int,
        typer.Option(min=1024, help="Largest request body in bytes; larger bodies get 413 before they are read whole."),
    ] = 16 * 2**20,
    read_timeout: Annotated[
        float,
        typer.Option(
            min=0.1,
            max=3600,
            help="Seconds a client may take to send a "
            "request's headers, and each piece of its body: a stalled body gets "
            "408, a connection idle that long without a request is closed.",
        ),
    ] = 30.0,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            min=0,
            max=86400,
            help="Seconds the requests in flight may take to finish after SIGTERM or SIGINT; meanwhile /health "
            "and new requests get 503. Those still running then end with an error (0: at once), and the server "
            "exits 0. A second signal exits at once.",
        ),
    ] = 30.0,
    chat_template: Annotated[
        Optional[str],
        typer.Option(
            help="A jinja chat template file (or the template itself) replacing the tokenizer's, e.g. one that "
            "renders `tools`."
        ),
    ] = None,
    tool_call_parser: Annotated[
        ToolCallParser,
        typer.Option(
            help="How tool calls are read from the output (vLLM's names): hermes (<tool_call>JSON</tool_call>, "
            "Qwen2.5/Qwen3), llama3_json, mistral ([TOOL_CALLS]); auto = from the chat template's markers, "
            "else hermes (the format of the default tool prompt).",
            case_sensitive=False,
        ),
    ] = ToolCallParser.auto,
    enable_auto_tool_choice: Annotated[
        bool,
        typer.Option(
            "--enable-auto-tool-choice/--no-enable-auto-tool-choice",
            help="Parse the calls the model writes for tool_choice=auto (the default when tools are given). "
            "Off: such requests get a 400, as vLLM without this flag.",
        ),
    ] = True,
    exclude_tools_when_tool_choice_none: Annotated[
        bool,
        typer.Option(
            help="Leave the tools out of the prompt when tool_choice is none (by default they are rendered, as "
            "vLLM does)."
        ),
    ] = False,
    reasoning_parser: Annotated[
        ReasoningParser,
        typer.Option(
            help="Split a reasoning model's output into message.reasoning_content and content (vLLM's names): "
            "qwen3 / deepseek_r1 (<think>...</think>), gpt_oss (harmony channels); auto = from the chat "
            "template's markers; none = off.",
            case_sensitive=False,
        ),
    ] = ReasoningParser.none,
    speculative_config: SpeculativeConfigOpt = None,
    tensor_parallel_size: TensorParallelOpt = 1,
    enable_expert_parallel: ExpertParallelOpt = False,
    enable_lora: EnableLoraOpt = False,
    lora_modules: LoraModulesOpt = None,
    max_loras: MaxLorasOpt = 1,
    max_lora_rank: MaxLoraRankOpt = 16,
    lora_root: LoraRootOpt = None,
    enable_rl_endpoints: Annotated[
        bool,
        typer.Option(
            "--enable-rl-endpoints/--no-enable-rl-endpoints",
            help="Serve the RL hooks (vLLM's / SGLang's names): POST /update_weights_from_disk {\"model_path\": DIR}, "
            "POST /sleep, POST /wake_up, POST /reset_prefix_cache, GET /is_sleeping. With --api-key they need it.",
        ),
    ] = False,
    batch_invariant: BatchInvariantOpt = False,
    kv_transfer_config: KVTransferConfigOpt = None,
    data_parallel_size: Annotated[
        int,
        typer.Option(
            min=1,
            help="Engine processes (vLLM's data parallelism): N copies of this server, each with its own threads "
            "(the cores split between them) or its own GPUs (--tensor-parallel-size each), on local ports behind "
            "one least_load router on --host/--port.",
        ),
    ] = 1,
    runner: Annotated[
        Runner,
        typer.Option(
            help="vLLM's runner: generate (completions, chat) or pooling (/v1/embeddings: prefill-only requests "
            "pooled by the checkpoint's sentence-transformers config, else by the last token); auto = pooling "
            "for a checkpoint with sentence-transformers files or a bare-decoder architecture (LlamaModel, ...).",
            case_sensitive=False,
        ),
    ] = Runner.auto,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/responses,
    /v1/embeddings, /v1/models, /tokenize, /detokenize)."""
    from baige.runtime.config import EngineConfig

    logging.basicConfig(level=log_level.value.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = served_model_name or model or "smollm2-135m-instruct"
    cfg = EngineConfig(
        model=model,
        dtype=dtype.value,
        device=device.value,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        block_size=block_size,
        kv_cache_memory=kv_cache_memory,
        enable_prefix_caching=enable_prefix_caching,
        kv_offload_size=kv_offload_size,
        kv_offload_dir=kv_offload_dir,
        enforce_eager=enforce_eager,
        seed=seed,
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype.value,
        speculative_config=speculative_config,
        tensor_parallel_size=tensor_parallel_size,
        enable_expert_parallel=enable_expert_parallel,
        batch_invariant=batch_invariant,
        kv_transfer_config=kv_transfer_config,
        runner=runner.value,
        **lora_engine_args(enable_lora, lora_modules, max_loras, max_lora_rank, name, lora_root),
    )
    if cfg.kv_transfer_config is not None:  # an unknown or missing transport fails now, before the model loads
        from baige.runtime.infer.kv_transfer.registry import resolve_connector

        resolve_connector(cfg.kv_transfer_config.kv_connector)
    template = read_chat_template(chat_template) if chat_template is not None else None
    if data_parallel_size > 1:
        args = (data_parallel_size, tensor_parallel_size, device.value, api_key, host, port, log_level.value)
        return start_data_parallel(ctx, *args, shutdown_timeout)
    from baige.runtime.infer.async_engine import AsyncEngine
    from baige.runtime.infer.engine import Engine
    from baige.runtime.server.app import listen, run_server

    sock = listen(host, port)  # a busy port or a bad host fails now, before the model loads
    core = Engine.from_config(cfg)
    if template is not None:
        core.tokenizer.set_chat_template(*template)
    core.tokenizer.check_chat_template()  # the model's own template: a hostile one fails at start-up
    run_server(
        AsyncEngine(core),
        name,
        sock,
        api_key,
        log_level.value,
        max_n=max_n,
        max_request_bytes=max_request_bytes,
        read_timeout=read_timeout,
        tool_call_parser=tool_call_parser.value,
        enable_auto_tool_choice=enable_auto_tool_choice,
        exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none,
        enable_rl_endpoints=enable_rl_endpoints,
        shutdown_timeout=shutdown_timeout,
        reasoning_parser=None if reasoning_parser is ReasoningParser.none else reasoning_parser.value,
    )
