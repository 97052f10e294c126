"""The ratios of ``baige bench compare``: baige's rows over its peers' rows, tokens/s over tokens/s."""

from __future__ import annotations

# (baige row, llama.cpp row) at about the same bits per weight: int8 per channel vs Q8_0 (8.5 bits),
# int4 g32 vs Q4_0 (4.5) and Q4_1 (5.0; the embedded GGUF as shipped), int4 vs Q4_K_M (about 4.9;
# Qwen2.5-Coder-1.5B's GGUF as shipped). llama.cpp quantizes the output matrix too (a tied lm_head
# included), so the "+int8-weight" rows, whose remaining float linears (the tied lm_head) are int8,
# are the closer match in bytes read per token.
EQUAL_BITS = (
    ("baige-int8", "llama.cpp-Q8_0"),
    ("baige-int8+int8-weight", "llama.cpp-Q8_0"),
    ("baige-int4-g32", "llama.cpp-Q4_0"),
    ("baige-int4-g32+int8-weight", "llama.cpp-Q4_0"),
    ("baige-int4-g32", "llama.cpp-Q4_1"),
    ("baige-int4-g32+int8-weight", "llama.cpp-Q4_1"),
    ("baige-int4", "llama.cpp-Q4_K_M"),
    ("baige-int4-g32", "llama.cpp-Q4_K_M"),
    ("baige-int4-g32+int8-weight", "llama.cpp-Q4_K_M"),
)
# the child-process peers' rows at 8 and 4 bits per weight (peers.PEER_MODULES' formats), and baige's rows
# they pair with: int8 weights per channel (OpenVINO, CTranslate2) or in blocks of 32 (ONNX Runtime GenAI);
# int4 in groups of 128 (OpenVINO) or blocks of 32 (ONNX Runtime GenAI), each with its lm_head quantized
PEER_BITS = {
    "int8": (
        ("baige-int8", "baige-int8+int8-weight"),
        ("openvino-int8", "onnxruntime-genai-int8", "ctranslate2-int8", "ctranslate2-int8_float32"),
    ),
    "int4": (
        ("baige-int4", "baige-int4-g32", "baige-int4-g32+int8-weight"),
        ("openvino-int4", "onnxruntime-genai-int4"),
    ),
}
LLAMA_BITS = {"int8": ("llama.cpp-Q8_0",), "int4": ("llama.cpp-Q4_0", "llama.cpp-Q4_1", "llama.cpp-Q4_K_M")}


def ratio_key(kind: str, ours: str, peer: str) -> str:
    """The ratios' key: ``<workload>_<baige row>_over_<peer row>``, e.g. ``decode_baige-int8_over_llama.cpp-Q8_0``;
    workload ``decode``, ``throughput`` or ``prefill-pp<tokens>``."""
    return f"{kind}_{ours}_over_{peer}"


def _workload_ratios(kind: str, rows: dict[str, float]) -> dict[str, float]:
    out = {}
    peers = {k: v for k, v in rows.items() if not k.startswith("baige")}
    if "baige" in rows:
        for k, v in peers.items():
            out[ratio_key(kind, "baige", k)] = rows["baige"] / v
    hf = [v for k, v in peers.items() if k.startswith("hf-")]
    if hf:
        for k, v in rows.items():  # baige and every variant (quantized, fp16-weight) against the best HF
            if k.startswith("baige"):
                out[ratio_key(kind, k, "hf-best")] = v / max(hf)
    pairs = list(EQUAL_BITS) + [(o, p) for ours, theirs in PEER_BITS.values() for o in ours for p in theirs]
    for ours_k, peer_k in pairs:
        if ours_k in rows and peer_k in rows:
            out[ratio_key(kind, ours_k, peer_k)] = rows[ours_k] / rows[peer_k]
    for bits, (ours, theirs) in PEER_BITS.items():  # against the fastest peer row at these bits
        best = [rows[p] for p in (*theirs, *LLAMA_BITS[bits]) if p in rows]
        if len(best) > 1:
            for o in (o for o in ours if o in rows):
                out[ratio_key(kind, o, f"fastest-peer-{bits}")] = rows[o] / max(best)
    return out


def ratios(summary: dict) -> dict[str, float]:
    """baige / peer tokens/s for every peer row, baige and each baige variant against ``hf-best`` (the
    fastest HF dtype), the :data:`EQUAL_BITS` and :data:`PEER_BITS` pairs present, and each baige row of
    :data:`PEER_BITS` against ``fastest-peer-int8`` / ``fastest-peer-int4`` (the fastest peer row at those
    bits, llama.cpp's included, where two or more are present). Keys: :func:`ratio_key`; prefill's per
    length (``summary["prefill"][row]["pp<tokens>"]``)."""
    out = {}
    for kind in ("decode", "throughput"):
        rows = {k: v["tokens_per_s"] for k, v in summary.get(kind, {}).items()}
        if "baige" in rows:
            out.update(_workload_ratios(kind, rows))
    prefill = summary.get("prefill", {})
    for pp in dict.fromkeys(pp for row in prefill.values() for pp in row):
        rows = {k: v[pp]["tokens_per_s"] for k, v in prefill.items() if pp in v}
        if "baige" in rows:
            out.update(_workload_ratios(f"prefill-{pp}", rows))
    return out
