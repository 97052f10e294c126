"""``baige bench compare``: the same workloads through baige and its peers in one run, interleaved.

Workloads (greedy, EOS ignored, every system generates exactly the asked tokens):

- **decode**: batch 1, one random-token prompt of ``input_len`` tokens, ``output_len`` new tokens;
  tokens/s = output_len / end-to-end seconds (gpt-fast's batch-1 tokens/s).
- **throughput**: ``num_prompts`` mixed-length random prompts (lengths uniform in
  ``len * [1 - range_ratio, 1 + range_ratio]``); total tokens/s = (prompt + output tokens) / seconds
  (``vllm bench throughput``). HF transformers runs *static batching*: ``hf_batch_size`` prompts at a
  time, left-padded, each batch generating its longest requested output; only requested tokens count;
  the first round times it in every HF dtype and later rounds only in the one that was fastest on
  this workload (the "best dtype"; decode speed does not predict it: on an AVX2-only CPU bf16 decoded
  fastest but ran static batches far slower than fp32; docs/benchmarks/archive.md, "The first CPU
  runs").

- **prefill**: batch 1, one random-token prompt of each of ``prefill_lens`` tokens, one new token;
  tokens/s = prompt tokens / seconds (llama-bench's ``pp``).

Peers (``peers``; ``hf`` and ``llama.cpp`` by default): HF transformers (``generate``) in float32 and
bfloat16; llama-cpp-python on the same GGUF when installed (decode and prefill, the same thread count), as
shipped and re-quantized by llama.cpp to baige's bit widths (:mod:`baige.runtime.bench.llama_peer`);
``openvino``, ``onnxruntime-genai`` and ``ctranslate2``, each on the model converted by its own tool and
timed one row per child process (:mod:`baige.runtime.bench.peers`; they run after baige's rounds).
The quantized rows are baige on int8 / int4 (RTN, group 128) / int4-g32 (group 32, the group of
llama.cpp's Q4_0) copies of the model quantized into a temporary directory, baige with
``--quantization fp16-weight`` (fp16-stored weights, fp32 math; CPU fp32 only), and ``int8+fp16-weight``
(the int8 copy with its remaining fp32 Linear, the tied lm_head, stored fp16); decode, prefill and
throughput for each. Every repeat runs each in-process system once in turn and the report keeps the median
per system. Ratios are baige / peer (:mod:`baige.runtime.bench.compare_ratios`), keyed
``<workload>_<baige row>_over_<peer row>`` (``hf-best``: the fastest HF dtype).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from baige.runtime import roofline
from baige.runtime.bench import llama_peer, peers
from baige.runtime.bench.common import environment, random_token_prompts
from baige.runtime.bench.compare_ratios import EQUAL_BITS, ratio_key, ratios  # noqa: F401  (the public names)
from baige.runtime.bench.offline import Progress, build_llm, run_args
from baige.runtime.config import DATA_SEED_RANGE, EngineConfig, check_int
from baige.runtime.infer.scheduler import StepShape

Requests = list[tuple[list[int], int]]  # (prompt token ids, output tokens) per request
PEERS = ("hf", "llama.cpp", *peers.PEER_MODULES)
DEFAULT_PEERS = ("hf", "llama.cpp")  # the child-process peers convert the model: asked for by name
# baige variants: a dtype (fp32 / bf16: the model's other floats, whatever --dtype auto picked for the
# "baige" row), a quantized copy (int8; int4 RTN g128; int4-g32, the bits of llama.cpp's Q4_0), a
# serving-time rewrite (--quantization fp16-weight / int8-weight), or a combination ("+")
VARIANTS = (
    "fp32",
    "bf16",
    "int8",
    "int4",
    "int4-g32",
    "fp16-weight",
    "int8+fp16-weight",
    "int8+int8-weight",
    "int4-g32+int8-weight",
)
DTYPE_VARIANTS = {"fp32": "float32", "bf16": "bfloat16"}
# baige checkpoint -> the llama.cpp type it is timed against at about the same bits per weight
REQUANT_FOR = {"int8": "Q8_0", "int4-g32": "Q4_0"}


@dataclass
class CompareConfig:
    """Resolved arguments of ``baige bench compare`` (``hf_dtypes`` kept once each, in order)."""

    engine: EngineConfig  # see offline.bench_engine
    input_len: int = 32  # tokens, decode prompt
    output_len: int = 64  # tokens, decode
    num_prompts: int = 32
    tp_input_len: int = 128  # tokens, throughput prompts (mean)
    tp_output_len: int = 64  # tokens, throughput outputs (mean)
    range_ratio: float = 0.5
    hf_batch_size: int = 32
    repeats: int = 1
    hf_dtypes: tuple[str, ...] = ("float32", "bfloat16")
    quantized: tuple[str, ...] = VARIANTS
    seed: int = 0
    peers: tuple[str, ...] = DEFAULT_PEERS  # which peers run (names of PEERS)
    prefill_lens: tuple[int, ...] = (128, 512)  # tokens, prefill prompts
    peer_venv: str | None = None  # a venv whose python exports for a peer that cannot share baige's (OpenVINO)

    def __post_init__(self) -> None:
        """Raises BaigeError for an unknown peer or variant, or a prefill length below 1."""
        self.hf_dtypes = tuple(dict.fromkeys(self.hf_dtypes))
        self.peers = tuple(dict.fromkeys(self.peers))
        self.quantized = tuple(dict.fromkeys(self.quantized))
        self.prefill_lens = tuple(dict.fromkeys(self.prefill_lens))
        check_int("--seed", self.seed, *DATA_SEED_RANGE)
        if any(n < 1 for n in self.prefill_lens):
            from baige.errors import BaigeError

            raise BaigeError(f"--prefill-lens: token counts must be >= 1, got {','.join(map(str, self.prefill_lens))}")
        check_names("--peers", self.peers, PEERS)
        check_names("--variants", self.quantized, VARIANTS)


def check_names(option: str, given: tuple[str, ...], known: tuple[str, ...]) -> None:
    """Raises BaigeError naming ``option`` when ``given`` holds a name not in ``known``."""
    from baige.errors import BaigeError

    bad = [g for g in given if g not in known]
    if bad:
        raise BaigeError(f"{option}: unknown {', '.join(map(repr, bad))} (known: {', '.join(known)})")


@dataclass
class Rows:
    """The systems under test by row name, in timing order: the calls timed and the roofline inputs."""

    decode: dict[str, Callable[[], None]] = field(default_factory=dict)  # batch-1 decode call
    batch: dict[str, Callable[[], None]] = field(default_factory=dict)  # offline throughput call
    prefill: dict[str, Callable[[list[int]], None]] = field(default_factory=dict)  # prompt -> 1 token
    weight_bytes: dict[str, int] = field(default_factory=dict)  # bytes read per decode step
    dtype_bytes: dict[str, int] = field(default_factory=dict)  # bytes per cached K/V element
    # baige rows: the schedule of the last throughput call and the model's roofline.model_counts
    steps: dict[str, list[StepShape]] = field(default_factory=dict)
    counts: dict[str, dict] = field(default_factory=dict)

    def add(
        self,
        name: str,
        decode: Callable[[], None],
        batch: Callable[[], None] | None,
        weight_bytes: int,
        dtype_bytes: int,
        prefill: Callable[[list[int]], None] | None = None,
    ) -> None:
        self.decode[name] = decode
        if batch is not None:
            self.batch[name] = batch
        if prefill is not None:
            self.prefill[name] = prefill
        self.weight_bytes[name], self.dtype_bytes[name] = weight_bytes, dtype_bytes


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _add_baige(rows: Rows, name: str, llm, prompt: list[int], reqs: Requests, n: int) -> None:
    """Row ``name``: ``llm`` decoding ``n`` tokens after ``prompt``, and generating ``reqs`` at once."""
    from baige.runtime.infer.sampling import SamplingParams

    decode_params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    counts = rows.counts[name] = roofline.model_counts(llm.engine.model)
    batch1_bytes = roofline.step_weight_bytes(counts, 1)  # MoE: k experts/layer

    def batch() -> None:
        llm.engine.step_shapes = []
        try:
            llm.generate(prompts, params)
            rows.steps[name] = llm.engine.step_shapes
        finally:
            llm.engine.step_shapes = None

    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows.add(
        name,
        lambda: llm.generate([{"prompt_token_ids": prompt}], decode_params),
        batch,
        batch1_bytes,
        llm.engine.kv_cache.k[0].element_size(),
        prefill=lambda p: llm.generate([{"prompt_token_ids": p}], first),
    )


def _hf_generate(model, batch: list[list[int]], n: int, pad_id: int) -> None:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # (B, width), left-padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_id
        )


def _hf_static(model, reqs: Requests, batch_size: int, pad_id: int) -> Callable[[], None]:
    def run() -> None:
        for i in range(0, len(reqs), batch_size):
            chunk = reqs[i : i + batch_size]
            _hf_generate(model, [p for p, _ in chunk], max(n for _, n in chunk), pad_id)

    return run


def _transformers():
    """HF transformers' ``AutoModelForCausalLM``, its (and the hub's) progress bars off. Raises
    BaigeError when transformers is not installed."""
    from baige.errors import BaigeError

    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise BaigeError("bench compare needs HF transformers: pip install 'baige[bench]'") from None

    hf_logging.disable_progress_bar()  # our own progress bar is the one on screen
    return AutoModelForCausalLM


def _add_hf(
    rows: Rows, auto_model, cfg: CompareConfig, model_dir: Path, prompt: list[int], reqs: Requests, pad_id: int
) -> None:
    """Rows ``hf-<dtype>``: ``auto_model`` (``AutoModelForCausalLM``) ``generate`` in each of
    ``cfg.hf_dtypes``; throughput in static batches of ``cfg.hf_batch_size``, left-padded with ``pad_id``."""
    for dt in cfg.hf_dtypes:
        hf = auto_model.from_pretrained(model_dir, dtype=getattr(torch, dt)).eval()
        rows.add(
            f"hf-{dt}",
            lambda m=hf: _hf_generate(m, [prompt], cfg.output_len, pad_id),
            _hf_static(hf, reqs, cfg.hf_batch_size, pad_id),
            roofline.weight_bytes(hf),
            torch.tensor([], dtype=getattr(torch, dt)).element_size(),
            prefill=lambda p, m=hf: _hf_generate(m, [p], 1, pad_id),
        )


def _add_quantized(
    rows: Rows, cfg: CompareConfig, model_dir: Path, tmp: Path, prompt: list[int], reqs: Requests, notes: list[str]
) -> None:
    """Rows ``baige-<variant>`` for each of ``cfg.quantized``: int8 / int4 copies quantized into ``tmp``
    (each once), fp16-weight, or both; a variant the quantizer or the engine refuses becomes a note."""
    from baige.errors import BaigeError
    from baige.runtime.config import QuantizeConfig
    from baige.runtime.quantize import quantize_checkpoint

    checkpoints: dict[str, Path | BaigeError] = {}
    for variant in cfg.quantized:
        # "<checkpoint>+<runtime>": a quantized copy (int8 / int4) and/or a serving-time rewrite (fp16-weight)
        checkpoint = next((p for p in variant.split("+") if p in ("int8", "int4", "int4-g32")), None)
        runtime = next((p for p in variant.split("+") if p in ("fp16-weight", "int8-weight")), None)
        dtype = next((DTYPE_VARIANTS[p] for p in variant.split("+") if p in DTYPE_VARIANTS), None)
        if runtime == "fp16-weight":
            dtype = "float32"  # fbgemm's fp16-weight rewrite is of an fp32 model's linears
        engine = cfg.engine if dtype is None else replace(cfg.engine, dtype=dtype)
        if runtime is not None:
            engine = replace(engine, quantization=runtime)
        try:
            if checkpoint is not None:
                if checkpoint not in checkpoints:
                    method, _, group = checkpoint.partition("-g")
                    try:  # a refusal (a family the quantizer does not take) is kept: each variant's note
                        checkpoints[checkpoint] = quantize_checkpoint(
                            QuantizeConfig(
                                model=str(model_dir),
                                method=method,
                                group_size=int(group or 128),
                                output=str(tmp / checkpoint),
                                device=cfg.engine.device,
                            )
                        )[0]
                    except BaigeError as e:
                        checkpoints[checkpoint] = e
                if isinstance(checkpoints[checkpoint], BaigeError):
                    raise checkpoints[checkpoint]
                engine = replace(engine, model=str(checkpoints[checkpoint]))
            q = build_llm(engine, _context_len(cfg), cfg.num_prompts)
        except BaigeError as e:
            notes.append(f"baige-{variant} skipped: {e}")
            continue
        _add_baige(rows, f"baige-{variant}", q, prompt, reqs, cfg.output_len)


def _add_llama_cpp(
    rows: Rows, cfg: CompareConfig, prompt: list[int], notes: list[str], model_dir: Path | None = None
) -> None:
    """Rows ``llama.cpp-<type>`` (decode and prefill, ``torch.get_num_threads()`` threads): the model's GGUF as
    shipped, or an HF checkpoint (``model_dir``) written as a GGUF by baige (:func:`llama_peer.model_gguf`), and,
    for the int8 / int4-g32 variants being timed, that GGUF re-quantized by llama.cpp to Q8_0 / Q4_0 (cached, in
    a child process). Without llama-cpp-python or a GGUF, or when a conversion fails, one note and no row."""
    from baige.runtime.weights.hub import cache_dir

    if importlib.util.find_spec("llama_cpp") is None:
        notes.append("llama-cpp-python is not installed: llama.cpp skipped (scripts/setup.sh --with-llama-cpp)")
        return
    gguf = llama_peer.model_gguf(cfg.engine.model, model_dir, cache_dir(), notes)
    if gguf is None:
        return
    threads = torch.get_num_threads()
    files = {llama_peer.gguf_file_type(gguf): gguf}
    checkpoints = {p for v in cfg.quantized for p in v.split("+")}
    for qtype in (q for c, q in REQUANT_FOR.items() if c in checkpoints and q not in files):
        try:
            files[qtype] = llama_peer.requantize(gguf, qtype, threads, cache_dir())
        except (RuntimeError, OSError) as e:
            notes.append(f"llama.cpp-{qtype} skipped: {e}")
    for qtype, path in files.items():
        try:  # llama.cpp refusing the file (ValueError: "Failed to load model") is a note, not an abort
            decode = llama_peer.llama_cpp_decode(path, prompt, cfg.output_len, threads)
            n = max(cfg.prefill_lens, default=0) + 8
            prefill = llama_peer.llama_cpp_prefill(path, n, threads) if cfg.prefill_lens else None
        except (ValueError, RuntimeError, OSError) as e:
            notes.append(f"llama.cpp-{qtype} skipped: {e}")
            continue
        rows.add(f"llama.cpp-{qtype}", decode, None, path.stat().st_size, 2, prefill=prefill)


def _context_len(cfg: CompareConfig) -> int:
    """Tokens of context every baige engine is built for: the decode run, the longest prefill prompt and
    its token, or twice the mean throughput request."""
    return max(cfg.input_len + cfg.output_len, 2 * (cfg.tp_input_len + cfg.tp_output_len), *cfg.prefill_lens, 0) + 1


def _fit_prefill(cfg: CompareConfig, model_dir: Path, notes: list[str]) -> CompareConfig:
    """``cfg`` without the prefill lengths the model's context (``max_position_embeddings`` of its
    config.json) cannot hold with one new token; each dropped length is a note."""
    import json

    config = model_dir / "config.json"
    limit = (json.loads(config.read_text()).get("max_position_embeddings") if config.is_file() else None) or 0
    if not limit:
        return cfg
    notes += [f"prefill pp{n} skipped: the model's context is {limit} tokens" for n in cfg.prefill_lens if n >= limit]
    return dataclasses.replace(cfg, prefill_lens=tuple(n for n in cfg.prefill_lens if n < limit))


def time_rows(
    rows: Rows, repeats: int, progress: Progress | None = None, prefill_prompts: tuple[list[int], ...] = ()
) -> tuple[dict, bool]:
    """One warm-up decode call per row (compilation, allocation, first-touch page faults), then
    ``repeats`` rounds, each timing every decode row, then every prefill row on each of
    ``prefill_prompts``, then every throughput row, once in turn. Round 1 times every HF dtype's static
    batching; later rounds only the one fastest in round 1.

    Returns ``({"decode": {row: [seconds per round]}, "prefill": {row: [[seconds per round] per prompt]},
    "throughput": {...}}, interrupted)``; a ``KeyboardInterrupt`` while timing ends the rounds early with
    ``interrupted`` True.
    """
    for fn in rows.decode.values():
        fn()
    batch = rows.batch
    pre = {k: fn for k, fn in rows.prefill.items() if prefill_prompts}
    samples: dict[str, dict] = {
        "decode": {k: [] for k in rows.decode},
        "prefill": {k: [[] for _ in prefill_prompts] for k in pre},
        "throughput": {},
    }
    n_hf = sum(k.startswith("hf-") for k in batch)
    per_round = len(rows.decode) + len(pre) * len(prefill_prompts) + len(batch) - n_hf + min(n_hf, 1)
    total = repeats * per_round + max(n_hf - 1, 0)
    done = 0

    def tick(what: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(done, total, what)

    try:
        for r in range(repeats):
            for name, fn in rows.decode.items():
                samples["decode"][name].append(_timed(fn))
                tick(f"decode {name}")
            for name, fn in pre.items():
                for i, p in enumerate(prefill_prompts):
                    samples["prefill"][name][i].append(_timed(lambda fn=fn, p=p: fn(p)))
                    tick(f"prefill {name} pp{len(p)}")
            if r == 0:
                samples["throughput"] = {k: [] for k in batch}
            for name, fn in batch.items():
                samples["throughput"][name].append(_timed(fn))
                tick(f"throughput {name}")
            if r == 0:  # later rounds: static batching in HF's fastest dtype on this workload only
                hf = [k for k in batch if k.startswith("hf-")]
                best = min(hf, key=lambda k: samples["throughput"][k][0]) if hf else None
                batch = {k: v for k, v in batch.items() if not k.startswith("hf-") or k == best}
    except KeyboardInterrupt:
        return samples, True
    return samples, False


def _summary(cfg: CompareConfig, rows: Rows, samples: dict, reqs: Requests, counts: dict, mc, limits) -> dict:
    """Median tokens/s per row and its roofline: decode against the bandwidth ``limits`` (weights +
    KV bytes per step at the mean context, KV bytes per token from the ``ModelConfig`` ``mc``),
    throughput against the matmul peak (FLOPs/token from baige's model ``counts`` at the mean
    request length) and, for baige's rows, against the least time their schedule needs on this
    machine and the least time any schedule of the same requests needs (``workload_roofline``:
    :func:`roofline.workload_summary`); plus the ratios."""
    tp_tokens = sum(len(p) + n for p, n in reqs)
    summary: dict = {"decode": {}, "prefill": {}, "throughput": {}}
    for name, ts in samples["decode"].items():
        if ts:
            tps = cfg.output_len / statistics.median(ts)
            summary["decode"][name] = {
                "tokens_per_s": tps,
                "roofline": roofline.decode_roofline(
                    tps,
                    1,
                    rows.weight_bytes[name],
                    roofline.kv_read_bytes_per_token(mc, rows.dtype_bytes[name], cfg.input_len + cfg.output_len / 2),
                    cfg.input_len + cfg.output_len / 2,
                    limits.bandwidth,
                ),
            }
    for name, ts in samples["throughput"].items():
        if ts:
            tps = tp_tokens / statistics.median(ts)
            flops = roofline.forward_flops_per_token(
                counts["num_params_active"], counts["attn_dims"], roofline.attn_context(counts, tp_tokens / len(reqs))
            )
            summary["throughput"][name] = {
                "tokens_per_s": tps,
                "roofline": roofline.compute_roofline(tps, flops, limits.matmul_peak),
            }
            if rows.steps.get(name):
                summary["throughput"][name]["workload_roofline"] = roofline.workload_summary(
                    rows.steps[name],
                    rows.counts[name],
                    mc.kv_bytes_per_token(rows.dtype_bytes[name]),
                    limits,
                    tp_tokens,
                    flops,
                    statistics.median(ts),
                    requests=[(len(p), n) for p, n in reqs],
                )
    for name, per_len in samples.get("prefill", {}).items():
        for n_tok, ts in zip(cfg.prefill_lens, per_len):
            if ts:
                tps = n_tok / statistics.median(ts)
                ctx = roofline.attn_context(counts, n_tok)  # sliding layers: their window
                flops = roofline.forward_flops_per_token(counts["num_params_active"], counts["attn_dims"], ctx)
                summary["prefill"].setdefault(name, {})[f"pp{n_tok}"] = {
                    "tokens_per_s": tps,
                    "roofline": roofline.compute_roofline(tps, flops, limits.matmul_peak),
                }
    summary["ratios"] = ratios(summary)
    return summary


def run_compare(cfg: CompareConfig, progress: Progress | None = None) -> dict:
    """Run ``baige bench compare``; returns the JSON result with per-repeat samples (seconds) and a
    summary of tokens/s, ratios and roofline per system. Raises BaigeError without HF transformers."""
    from baige.runtime.weights.hub import resolve_model

    auto_model = _transformers() if "hf" in cfg.peers and cfg.hf_dtypes else None
    model_dir = resolve_model(cfg.engine.model)
    notes: list[str] = []
    cfg = _fit_prefill(cfg, Path(model_dir), notes)
    baige = build_llm(cfg.engine, _context_len(cfg), cfg.num_prompts)
    dtype = next(baige.engine.model.parameters()).dtype  # --dtype auto's pick: limits.dtype in the result
    vocab = baige.engine.vocab_size
    decode_prompt = random_token_prompts(vocab, 1, cfg.input_len, 1, 0.0, cfg.seed)[0][0]
    reqs = random_token_prompts(vocab, cfg.num_prompts, cfg.tp_input_len, cfg.tp_output_len, cfg.range_ratio, cfg.seed)
    prefill_prompts = tuple(random_token_prompts(vocab, 1, n, 1, 0.0, cfg.seed)[0][0] for n in cfg.prefill_lens)
    rows = Rows()
    _add_baige(rows, "baige", baige, decode_prompt, reqs, cfg.output_len)
    if auto_model is not None:
        _add_hf(rows, auto_model, cfg, model_dir, decode_prompt, reqs, pad_id=baige.engine.eos_token_ids[0])
    with tempfile.TemporaryDirectory(prefix="baige-bench-quant-") as tmp:
        _add_quantized(rows, cfg, model_dir, Path(tmp), decode_prompt, reqs, notes)
        if "llama.cpp" in cfg.peers:
            _add_llama_cpp(rows, cfg, decode_prompt, notes, Path(model_dir))
        # before the load, once; the matmul peak in the dtype baige runs (bf16 where --dtype auto picks it)
        limits = roofline.hardware_limits(next(baige.engine.model.parameters()).device, dtype)
        samples, interrupted = time_rows(rows, cfg.repeats, progress, prefill_prompts)
        if not interrupted:
            job = peers.job_factory(cfg, Path(model_dir), decode_prompt, prefill_prompts, reqs, torch.get_num_threads())
            peers.add_rows(cfg, rows, samples, job, notes, progress)
        if not interrupted:  # the better of before and after the timing (not after a Ctrl-C: no waiting then)
            limits = roofline.remeasure_limits(limits)
    counts = roofline.model_counts(baige.engine.model)
    summary = _summary(cfg, rows, samples, reqs, counts, baige.engine.model.config, limits)
    return {
        "benchmark": "compare",
        "args": run_args(cfg, baige),
        "environment": environment(),
        "limits": limits.to_dict(),
        "model": counts,
        "interrupted": interrupted,
        "notes": notes,
        "samples": samples,
        "summary": summary,
    }
