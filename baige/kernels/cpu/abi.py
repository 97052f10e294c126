"""The exported functions of the native CPU library and their ctypes signatures, one entry per C
function (the sources' ``baige_*`` definitions); :func:`baige.kernels.cpu.build.library` types every
function of a loaded library from this table. A C signature change is mirrored here."""

from __future__ import annotations

import ctypes

_i64, _int, _ptr, _f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float

# decode.c's entry points begin with the model's shape (layers, n_layers, M, hidden, hq, hk, d, inter, eps,
# scale, num_blocks, bs) and end with the paged cache, the adapters and the threads (slots, tables, W, lens,
# kv_dtype, lora_ids, nthreads)
_DECODE_SHAPE = [_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _i64, _i64]
_DECODE_CACHE = [_ptr, _ptr, _i64, _ptr, _int, _ptr, _int]
# a linear of any weight dtype (x, M, K, ldx, w, N, ldw, scale, bias, y, ldy, nthreads): y = x w^T (* scale) + bias
_LINEAR = [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _int]
# the paged attention entry points' leading parameters (q, k_cache, v_cache, S, hq, hk, d, num_blocks, bs,
# block_tables, W, table_of_row, context_lens, scale)
_PAGED = [_ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _f32]

# (name, argtypes, restype)
SIGNATURES: list[tuple[str, list, type | None]] = [
    ("baige_isa", [], ctypes.c_char_p),
    ("baige_qlinear_int8", _LINEAR, None),
    (
        "baige_qlinear_int4",
        [_ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int],
        None,
    ),
    ("baige_qdot_int8", [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _int, _int], _int),
    (
        "baige_qdot_int4",
        [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _int, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int, _int],
        _int,
    ),
    ("baige_rms_norm", [_ptr, _i64, _i64, _ptr, _f32, _ptr], None),
    ("baige_add_rms_norm", [_ptr, _ptr, _i64, _i64, _ptr, _f32, _ptr, _ptr], None),
    ("baige_rope", [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr], None),
    ("baige_store_kv", [_ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _int], None),
    ("baige_store_kv_same", [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr], None),
    ("baige_dequant_int4_bf16", [_ptr, _i64, _i64, _i64, _ptr, _int, _ptr, _i64, _i64, _ptr, _int], None),
    (
        "baige_prefill_attention_amx",
        [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _f32, _ptr, _int],
        _int,
    ),
    ("baige_silu_mul", [_ptr, _ptr, _i64, _ptr], None),
    # the batch-invariant mode's kernels (invariant.c)
    ("baige_bi_linear", [_ptr, _i64, _i64, _ptr, _int, _i64, _ptr, _ptr, _int], None),
    (
        "baige_bi_attention",
        [_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _int, _i64, _i64, _ptr, _i64, _ptr, _ptr, _f32, _ptr, _int],
        _int,
    ),
    ("baige_bi_sumsq", [_ptr, _i64, _i64, _ptr, _int], None),
    ("baige_bi_silu", [_ptr, _i64, _ptr, _int], None),
    ("baige_argmax_rows", [_ptr, _i64, _i64, _i64, _ptr], None),
    ("baige_inverse_cdf_rows", [_ptr, _i64, _i64, _i64, _ptr, _ptr], _int),
    ("baige_silu_mul_bf16", [_ptr, _ptr, _i64, _ptr, _int], None),
    ("baige_ce_rows_bf16", [_ptr, _i64, _i64, _ptr, _i64, _ptr, _int, _ptr, _int], None),
    ("baige_rms_norm_bf16", [_ptr, _i64, _i64, _ptr, _f32, _ptr, _int], None),
    ("baige_add_rms_norm_bf16", [_ptr, _ptr, _i64, _i64, _ptr, _f32, _ptr, _ptr, _int], None),
    ("baige_rope_bf16", [_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _int], None),
    ("baige_linear_f32", _LINEAR, None),
    ("baige_linear_f16", _LINEAR, None),
    ("baige_linear_bf16", _LINEAR, None),
    ("baige_linear_bf16_widen", _LINEAR, None),
    ("baige_bf16_dot", [], _int),
    ("baige_qdot_amx_rows", [], _int),
    # h, cos, sin between the parameters every decode entry point shares
    ("baige_decode_layers", [*_DECODE_SHAPE, _ptr, _ptr, _ptr, *_DECODE_CACHE], _int),
    # embed, embed_bf16, vocab, ids, positions, cos_table, sin_table, max_pos, final_norm, h, out
    (
        "baige_decode_step",
        [*_DECODE_SHAPE, _ptr, _int, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, *_DECODE_CACHE],
        _int,
    ),
    ("baige_moe_experts_f32", [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int], _int),
    (
        "baige_moe_experts_bf16",
        [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int],
        _int,
    ),
    ("baige_paged_decode_attention", [*_PAGED, _ptr, _int, _int], _int),  # out, kv_dtype, nthreads
    # window, sinks, softcap, out, kv_dtype, nthreads
    ("baige_paged_attention_ext", [*_PAGED, _i64, _ptr, _f32, _ptr, _int, _int], _int),
    ("baige_set_int8_prefetch", [_int], None),
]
