"""The tables of scripts/bench_arch.py's records (the 2026 architectures): MLA's latent cache against the same
model's MHA-sized cache (``arch_mla``), sliding-window memory over a 4x-window generation (``arch_window``),
int8 / int4 against fp32 on the new families (``arch_quant``). Each builder takes the records of its kind
(newest first), the machine labels and the link prefix, and returns its lines."""

from __future__ import annotations

from .machines import machine_key
from .records import DASH, date, link, num, table

MB = 1e6


def _cells(r: dict, labels: dict[tuple, str], family: str) -> list[str]:
    return [date(r), f"`{family}`", labels[machine_key(r)]]


def mla(rs, labels, prefix) -> list[str]:
    header = (
        "date (UTC) | model | machine | cache | KV bytes / token | tokens admitted | context (tokens) | "
        "decode tokens/s | bytes read / step (MB) | prefill (s) | record"
    )
    rows = []
    for r in rs:
        budget = (r.get("args") or {}).get("kv_cache_memory")
        for mode, m in (r.get("modes") or {}).items():
            for ctx, run in (m.get("contexts") or {}).items():
                rows.append(
                    [
                        *_cells(r, labels, (r.get("model") or {}).get("family", DASH)),
                        "latent (absorbed decode)" if mode == "latent" else "MHA-sized (per-head K/V)",
                        f"{m.get('kv_bytes_per_token', 0):,}",
                        f"{m.get('admitted_tokens', 0):,} in {num((budget or 0) / 2**30, 2)} GiB",
                        ctx,
                        num(run.get("decode_tokens_per_s")),
                        num((run.get("decode_bytes_per_step") or 0) / MB),
                        num(run.get("prefill_s")),
                        link(r, prefix),
                    ]
                )
    intro = [
        "Batch-1 decode after a prompt of each context length, fp32, through the latent cache and through the "
        "same model's MHA-sized cache (V zero-padded to the K width: the records also give the unpadded "
        "`n_heads x (qk + v)` size as `mha_formula_kv_bytes_per_token`); what was measured: "
        "[models](models.md#benchmarks-of-the-new-architectures).",
        "",
    ]
    return intro + table(header, rows)


def window(rs, labels, prefix) -> list[str]:
    header = (
        "date (UTC) | model | machine | layers sliding / full | window / block (tokens) | sequences x tokens | "
        "peak sliding blocks / sequence (bound) | sliding layers (MB) | full layers (MB) | without the window (MB) "
        "| record"
    )
    rows = []
    for r in rs:
        for family, f in (r.get("families") or {}).items():
            peak, nbytes, layers = f.get("peak") or {}, f.get("peak_bytes") or {}, f.get("layers") or {}
            rows.append(
                [
                    *_cells(r, labels, family),
                    f"{layers.get('sliding', DASH)} / {layers.get('full', DASH)}",
                    f"{f.get('window', DASH)} / {f.get('block_size', DASH)}",
                    f"{f.get('sequences', DASH)} x ({f.get('prompt_len', DASH)} + {f.get('output_len', DASH)})",
                    f"{peak.get('sliding_blocks_per_seq', DASH)} ({f.get('bound_sliding_blocks_per_seq', DASH)})",
                    num((nbytes.get("sliding_layers") or 0) / MB),
                    num((nbytes.get("full_layers") or 0) / MB),
                    num((nbytes.get("no_window_cache") or 0) / MB),
                    link(r, prefix),
                ]
            )
    intro = [
        "The KV cache each kind of layer holds at the peak of a generation of four windows (fp32), against the "
        "bound `ceil(window / block) + 1` sliding blocks per sequence and against a cache that keeps every "
        "block for every layer.",
        "",
    ]
    return intro + table(header, rows)


def quant(rs, labels, prefix) -> list[str]:
    header = (
        "date (UTC) | model | machine | weights | weight MB | decode tokens/s | mean abs logit diff "
        "(fp32 logit std) | top-1 agreement | perplexity | record"
    )
    rows = []
    for r in rs:
        for family, f in (r.get("families") or {}).items():
            for variant, v in (f.get("variants") or {}).items():
                if "refused" in v:
                    rows.append([*_cells(r, labels, family), variant, f"refused: {v['refused']}", *[DASH] * 4])
                    rows[-1].append(link(r, prefix))
                    continue
                rows.append(
                    [
                        *_cells(r, labels, family),
                        variant,
                        num((v.get("weight_bytes") or 0) / MB),
                        num(v.get("decode_tokens_per_s")),
                        f"{num(v.get('mean_abs_logit_diff'), 3)} ({num(v.get('logit_std_fp32'), 3)})",
                        num(v.get("top1_agreement"), 3),
                        num(v.get("perplexity"), 0),
                        link(r, prefix),
                    ]
                )
    intro = [
        "Random weights (transformers' initialisation): their logits are nearly flat, so perplexity sits near "
        "the vocabulary size and top-1 agreement is fragile; the logit difference against the fp32 logits' "
        "spread is the comparable number. int8 / int4 are `baige quantize` RTN copies (group 128), the lm_head "
        "(tied to the embeddings) in fp32.",
        "",
    ]
    return intro + table(header, rows)
