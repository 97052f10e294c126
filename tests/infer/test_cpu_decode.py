"""The native CPU decode step (baige/runtime/infer/cpu_decode.py + kernels/cpu/decode.c) against the
module path on the PyTorch reference kernels: same hidden states and KV writes for a batch of
decoding sequences with scattered blocks, on every tiny architecture and on int8 / int4 copies,
and with multi-LoRA serving stacks (the kernel's own grouped shrink/expand against the hooks)."""

import shutil

import pytest
import torch

from baige.kernels.cpu import build as cpu_build
from baige.runtime.infer.cpu_decode import FusedDecoder
from baige.runtime.infer.kv_cache import KVCache
from baige.runtime.infer.step_inputs import PagedAttentionMetadata
from baige.runtime.quant.apply import quantize_model
from baige.runtime.quant.scheme import QuantScheme
from baige.runtime.settings import reload_settings
from baige.runtime.weights.loader import load_model
from tests.tiny import make_checkpoint


@pytest.fixture(autouse=True)
def _native():
    if not (shutil.which("cc") or shutil.which("gcc")) or not cpu_build.cpu_has_avx2():
        pytest.skip("no C compiler or no AVX2: the native kernels are not built here")
    assert cpu_build.library() is not None


BS = 4
CTX = [5, 17, 2]  # context lengths including the new token: partial, several blocks, tiny


def _step_inputs(model, num_blocks=20, seed=0, kv_dtype=torch.float32):
    """A filled KV cache and one decode step's inputs for len(CTX) sequences on scattered blocks."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    kv = KVCache(cfg, num_blocks, BS, kv_dtype, torch.device("cpu"))
    for t in kv.k + kv.v:
        t.copy_(torch.randn(t.shape, generator=g))
    perm = torch.randperm(num_blocks, generator=g).tolist()
    W = max(-(-n // BS) for n in CTX)
    tables, slots, at = [], [], 0
    for n in CTX:
        blocks = perm[at : at + -(-n // BS)]
        at += len(blocks)
        slots.append(blocks[(n - 1) // BS] * BS + (n - 1) % BS)
        tables.append(blocks + [kv.scratch_block] * (W - len(blocks)))
    ids = torch.randint(0, cfg.vocab_size, (1, len(CTX)), generator=g)
    pos = torch.tensor([[n - 1 for n in CTX]])
    return kv, ids, pos, torch.tensor(slots), torch.tensor(tables), torch.tensor(CTX)


def _check(model, monkeypatch, atol=1e-4, kv_dtype=torch.float32, lora=None, against="reference"):
    """``lora``: (LoRABatch the model's stacks read, (len(CTX),) adapter slot per sequence).
    ``against``: the module path on the PyTorch reference kernels, or ``"native"``: on the per-op
    native kernels (the same quantized-linear kernels as the fused step)."""
    kv, ids, pos, slots, tables, lens = _step_inputs(model, kv_dtype=kv_dtype)
    ref_k, ref_v = [t.clone() for t in kv.k], [t.clone() for t in kv.v]
    fused, why = FusedDecoder.build(model, kv)
    assert fused is not None, why
    with torch.inference_mode():
        if lora is not None:
            lora[0].token_lora_ids = None  # the kernel gets the ids as an argument, not from the hooks
        out = fused(ids, pos, slots, tables, lens, None if lora is None else lora[1])
        if lora is not None:
            lora[0].token_lora_ids = lora[1]
        if against == "reference":
            monkeypatch.setenv("BAIGE_KERNELS", "reference")
        else:
            monkeypatch.delenv("BAIGE_KERNELS", raising=False)
        reload_settings()
        md = PagedAttentionMetadata(ref_k, ref_v, slots, len(CTX), decode_groups=[(tables, lens)])
        ref = model(ids, pos, md)
    assert out.shape == ref.shape == (1, len(CTX), model.config.hidden_size)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=atol)
    for a, b in zip(kv.k + kv.v, ref_k + ref_v):  # the new K/V landed in the same slots
        assert a.dtype == kv_dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-3 if kv_dtype == torch.float16 else 1e-4, atol=atol)


@pytest.mark.parametrize(
    "variant",
    ["llama", "llama-tied", "mistral-head-dim", "qwen2-bias", "qwen3-qk-norm", "llama-llama3-rope", "ernie4.5"],
)
def test_fused_decode_matches_module_path(tmp_path, monkeypatch, variant):
    model = load_model(make_checkpoint(tmp_path / variant, variant), "float32")
    _check(model, monkeypatch)


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(8, None), QuantScheme(4, 32), QuantScheme(4, 64, symmetric=False)],
    ids=["int8", "int4-g32", "int4-g64-asym"],
)
@pytest.mark.parametrize("int_dot", [False, True], ids=["exact", "int-dot"])
def test_fused_decode_quantized(tmp_path, monkeypatch, scheme, int_dot):
    """int8 and int4 projections (g64 on in_features 96: a partial last group), q/k/v biases kept fp32.
    Exact kernels (BAIGE_CPU_INT_DOT=0) against the PyTorch reference; the integer-dot kernels
    (qdot.c, checked against their reference in test_kernels_cpu) against the per-op path calling them,
    and visibly not the exact kernels' result."""
    monkeypatch.setenv("BAIGE_CPU_INT_DOT", "1" if int_dot else "0")
    reload_settings()
    model = load_model(make_checkpoint(tmp_path / "q", "qwen2-bias"), "float32")
    quantize_model(model, scheme, ignore=["lm_head"])
    _check(model, monkeypatch, against="native" if int_dot else "reference")
    if int_dot:
        kv, *step = _step_inputs(model)
        with torch.inference_mode():
            dot = FusedDecoder.build(model, kv)[0](*step)
            monkeypatch.setenv("BAIGE_CPU_INT_DOT", "0")
            reload_settings()
            kv, *step = _step_inputs(model)
            exact = FusedDecoder.build(model, kv)[0](*step)
        assert (dot - exact).abs().max() > 1e-5


def test_fused_decode_fp16_weight(tmp_path, monkeypatch):
    """--quantization fp16-weight projections (native F16C kernel) against the module path on fbgemm."""
    from baige.runtime.quant.fp16_weight import apply_quantization

    model = load_model(make_checkpoint(tmp_path / "h", "qwen3-qk-norm"), "float32")
    apply_quantization(model, "fp16-weight")
    _check(model, monkeypatch)


def test_fused_decode_fp16_kv_cache(tmp_path, monkeypatch):
    """--kv-cache-dtype float16 under an fp32 model: the fused step stores fp16 K/V and reads them
    back converted, like the module path (reference store rounds with .to(float16))."""
    model = load_model(make_checkpoint(tmp_path / "k", "qwen3-qk-norm"), "float32")
    _check(model, monkeypatch, kv_dtype=torch.float16)


def _bf16_step(model, kv_dtype, monkeypatch, path: str):
    """(1, M, hidden) fp32 hidden states of one decode step of ``model`` on the scattered-block inputs:
    ``path`` "fused" (the native step), "per-op" (the module path, reference kernels) or "logits" (the
    fused step's logits)."""
    kv, ids, pos, slots, tables, lens = _step_inputs(model, kv_dtype=kv_dtype)
    with torch.inference_mode():
        if path != "per-op":
            fused, why = FusedDecoder.build(model, kv)
            assert fused is not None, why
            out = fused(ids, pos, slots, tables, lens)
            return fused.logits(out[0]) if path == "logits" else out
        monkeypatch.setenv("BAIGE_KERNELS", "reference")
        reload_settings()
        try:
            md = PagedAttentionMetadata(kv.k, kv.v, slots, len(CTX), decode_groups=[(tables, lens)])
            out = model(ids, pos, md)
            return out.float()
        finally:
            monkeypatch.delenv("BAIGE_KERNELS")
            reload_settings()


@pytest.mark.parametrize("variant", ["qwen3-qk-norm", "qwen2-bias", "llama-tied"])
def test_fused_decode_bf16_model(tmp_path, monkeypatch, variant):
    """A bf16 model on every native variant (vdpbf16ps on AVX-512 BF16, exact widening elsewhere): the
    fused step keeps activations in fp32, so against an fp64 oracle (the same bf16 weights and bf16
    K/V pools, computed in fp64 on the reference path) it is at least as close as torch's per-op bf16
    path, which rounds every activation to bf16 (the 2x rule of the kernel tests); without the bf16
    dot (widening kernels) it equals the fp32 native step on the upcast weights. Logits too
    (bf16 lm_head through the same kernel; tied or not)."""
    from baige.kernels.cpu import isa

    path = make_checkpoint(tmp_path / variant, variant)
    bf16 = load_model(path, "bfloat16")
    f64 = load_model(path, "bfloat16").double()  # the same rounded weights
    oracle = _bf16_step(f64, torch.bfloat16, monkeypatch, "per-op").double()
    per_op = _bf16_step(bf16, torch.bfloat16, monkeypatch, "per-op")
    ref_err = (per_op.double() - oracle).abs().max().item()
    for isa_name in isa.supported():
        monkeypatch.setenv("BAIGE_CPU_ISA", isa_name)
        reload_settings()
        fused = _bf16_step(bf16, torch.bfloat16, monkeypatch, "fused")
        assert fused.dtype == torch.float32
        err = (fused.double() - oracle).abs().max().item()
        assert err <= 2 * ref_err + 1e-6, f"{isa_name}: fused error {err:.3g} vs per-op bf16 {ref_err:.3g}"
        if not cpu_build.library().baige_bf16_dot():
            f32 = load_model(path, "bfloat16").float()
            torch.testing.assert_close(
                fused, _bf16_step(f32, torch.bfloat16, monkeypatch, "fused"), rtol=1e-4, atol=1e-4
            )
    logits = _bf16_step(bf16, torch.bfloat16, monkeypatch, "logits")
    oracle_logits = f64.compute_logits(oracle[0])
    per_op_logits = bf16.compute_logits(per_op[0].bfloat16()).double()
    assert logits.dtype == torch.float32 and logits.shape == (len(CTX), bf16.config.vocab_size)
    assert (logits.double() - oracle_logits).abs().max() <= 2 * (per_op_logits - oracle_logits).abs().max() + 1e-6


def test_fused_decode_int4_under_bf16_model(tmp_path, monkeypatch):
    """int4 projections in a bf16 model (the remaining parameters bf16): the fused step runs and agrees
    with the per-op bf16 path to bf16 precision."""
    model = load_model(make_checkpoint(tmp_path / "q", "qwen2-bias"), "bfloat16")
    quantize_model(model, QuantScheme(4, 32), ignore=["lm_head"])
    fused = _bf16_step(model, torch.bfloat16, monkeypatch, "fused")
    per_op = _bf16_step(model, torch.bfloat16, monkeypatch, "per-op")
    scale = per_op.abs().max()
    assert (fused - per_op).abs().max() <= 0.03 * scale


def _stacks(model, ranks, seed=0):
    """Serve one random adapter per rank in ``ranks`` on ``model``: adapter i on every projection but
    adapter 0 on q/k/v/o only (the MLP's stacks hold zeros in its slot), B large enough to move the
    outputs. Returns the LoRABatch."""
    from baige.runtime.model.lora import LORA_TARGETS, LoRABatch, attach_adapters

    g = torch.Generator().manual_seed(seed)
    adapters = []
    for i, r in enumerate(ranks):
        adapter = {}
        for name, m in model.named_modules():
            target = name.rpartition(".")[2]
            if target in LORA_TARGETS and (i or target in ("q_proj", "k_proj", "v_proj", "o_proj")):
                adapter[name] = (
                    torch.randn(r, m.in_features, generator=g) * 0.3,
                    torch.randn(m.out_features, r, generator=g) * 0.3,
                    2.0 / r,
                )
        adapters.append(adapter)
    batch = LoRABatch()
    attach_adapters(model, adapters, batch, torch.float32)
    return batch


@pytest.mark.parametrize("base", ["fp32", "int4-g32"])
@pytest.mark.usefixtures("exact_quant_kernels")
def test_fused_decode_lora_stacks(tmp_path, monkeypatch, base):
    """Three adapters of ranks 1, 7 and 16 stacked (zero-padded to 16) on an fp32 and an int4 base
    (QLoRA-style serving); the three sequences on adapter 2, none and 0 (adapter 1 has no token):
    the native step's hidden states and KV writes equal the module path's hooks on the reference
    kernels, and differ from the base alone (the adapters are not a no-op)."""
    model = load_model(make_checkpoint(tmp_path / "l", "qwen2-bias"), "float32")
    if base != "fp32":
        quantize_model(model, QuantScheme(4, 32), ignore=["lm_head"])
    batch = _stacks(model, [1, 7, 16])
    ids = torch.tensor([2, -1, 0])
    _check(model, monkeypatch, lora=(batch, ids))
    kv, *step = _step_inputs(model)
    monkeypatch.delenv("BAIGE_KERNELS")
    reload_settings()
    fused = FusedDecoder.build(model, kv)[0]
    with torch.inference_mode():
        plain = fused(*[t.clone() for t in step])
        kv2, *step2 = _step_inputs(model)
        adapted = FusedDecoder.build(model, kv2)[0](*step2, ids)
    assert torch.equal(adapted[0, 1], plain[0, 1])  # the base row: untouched
    assert (adapted[0, 0] - plain[0, 0]).abs().max() > 1e-2 and (adapted[0, 2] - plain[0, 2]).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_build_moves_streamed_weights_into_the_arena_in_read_order(tmp_path, dtype, monkeypatch):
    """Building the step moves each projection weight and a (tied) lm_head into the huge-page arena:
    same Parameter objects and values, the storages back to back in the order the step reads them
    (layer by layer q, k, v, o, gate, up, down, then the lm_head); a second build moves nothing."""
    from baige.kernels.cpu import arena

    monkeypatch.setattr(arena, "weights", arena.Arena())  # a fresh chunk: no boundary from earlier tests
    model = load_model(make_checkpoint(tmp_path / "m", "llama-tied"), dtype)
    params = [
        p
        for layer in model.model.layers
        for p in (
            layer.self_attn.q_proj.weight,
            layer.self_attn.k_proj.weight,
            layer.self_attn.v_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.mlp.gate_proj.weight,
            layer.mlp.up_proj.weight,
            layer.mlp.down_proj.weight,
        )
    ] + [model.lm_head.weight]
    before = [p.detach().clone() for p in params]
    kv = _step_inputs(model)[0]
    assert FusedDecoder.build(model, kv)[0] is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    ptrs = [p.data_ptr() for p in params]
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert ptrs == sorted(ptrs) and len(set(ptrs)) == len(ptrs)
    assert all(b - a < p.numel() * p.element_size() + 64 for a, b, p in zip(ptrs, ptrs[1:], params))
    assert FusedDecoder.build(model, kv)[0] is not None
    assert [p.data_ptr() for p in params] == ptrs


def test_ineligible_models_say_why(tmp_path, monkeypatch):
    path = make_checkpoint(tmp_path / "m", "llama")
    half = load_model(path, "float16")
    kv = KVCache(half.config, 4, BS, torch.float16, torch.device("cpu"))
    assert FusedDecoder.build(half, kv) == (None, "the model is torch.float16, not fp32 or bf16")
    model = load_model(path, "float32")
    kv = KVCache(model.config, 4, BS, torch.float32, torch.device("cpu"))
    model.model.layers[1].mlp.up_proj = torch.nn.Identity()
    assert FusedDecoder.build(model, kv) == (None, "layer 1 up_proj: Identity has no native kernel")
    from baige.runtime.model.lora import add_lora

    model = load_model(path, "float32")
    add_lora(model.model.layers[0].self_attn.v_proj, 4, 8.0)
    assert FusedDecoder.build(model, kv) == (None, "layer 0 v_proj: it has a training LoRA adapter")
    gemma = load_model(make_checkpoint(tmp_path / "g", "gemma2"), "float32")
    gemma_kv = KVCache(gemma.config, 4, BS, torch.float32, torch.device("cpu"))
    assert FusedDecoder.build(gemma, gemma_kv) == (
        None,
        "Gemma's (1 + w) norms, GeGLU MLP and soft-caps are not in the native step",
    )
    monkeypatch.setenv("BAIGE_CPU_DECODE", "0")
    reload_settings()
    assert FusedDecoder.build(load_model(path, "float32"), kv)[0] is None


def test_engine_uses_it_and_gives_the_same_tokens(embedded_dir, monkeypatch):
    """The embedded model through LLM.generate: fused decode on by default on CPU fp32; greedy tokens
    of a mixed batch equal to the per-op path's (BAIGE_CPU_DECODE=0)."""
    from baige import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time there was a story about"]
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("BAIGE_CPU_DECODE", flag)
        reload_settings()
        llm = LLM(str(embedded_dir), dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory=64 << 20)
        assert (llm.engine.runner.fused_decode is not None) == (flag == "1")
        outs[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["1"] == outs["0"] and all(len(t) == 12 for t in outs["1"])


def test_engine_fp16_kv_cache(embedded_dir, monkeypatch):
    """kv_cache_dtype="float16" under the fp32 model: an fp16 pool of twice the blocks for the same
    bytes, the fused step used, greedy tokens equal to the reference kernels on the same fp16 cache."""
    from baige import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time there was a story about"]
    outs, blocks = {}, {}
    for mode in ("auto", "reference"):
        monkeypatch.setenv("BAIGE_KERNELS", mode)
        reload_settings()
        llm = LLM(
            str(embedded_dir),
            dtype="float32",
            enforce_eager=True,
            max_model_len=256,
            kv_cache_memory=64 << 20,
            kv_cache_dtype="float16",
        )
        assert llm.engine.kv_cache.k[0].dtype == torch.float16
        assert (llm.engine.runner.fused_decode is not None) == (mode == "auto")
        blocks[mode] = llm.engine.kv_cache.num_blocks
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["auto"] == outs["reference"] and all(len(t) == 12 for t in outs["auto"])
    fp32 = LLM(str(embedded_dir), dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_memory="64MiB")
    assert blocks["auto"] == 2 * fp32.engine.kv_cache.num_blocks


def test_whole_step_in_c_matches_the_layers_call(tmp_path):
    """The one-call step (embedding, rotary rows from the position tables, layers, final norm in C)
    gives the hidden states of the layers-only call with the lookups in PyTorch (bitwise on an fp32
    model, within an ulp of the final norm on a bf16 one) and the same KV writes; a position past the tables grows
    them; a token id outside the vocabulary is one
    ValueError and leaves the KV cache untouched."""
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(make_checkpoint(tmp_path / str(dtype), "llama"), dtype)
        kv, ids, pos, slots, tables, lens = _step_inputs(model)
        kv2 = KVCache(model.config, 20, BS, torch.float32, torch.device("cpu"))
        for a, b in zip(kv2.k + kv2.v, kv.k + kv.v):
            a.copy_(b)
        whole, _ = FusedDecoder.build(model, kv)
        parts, _ = FusedDecoder.build(model, kv2)
        assert whole._whole
        parts._whole = False
        with torch.inference_mode():
            a = whole(ids, pos, slots, tables, lens)
            b = parts(ids, pos, slots, tables, lens)
            assert a.dtype == torch.float32
            if dtype == torch.float32:
                assert torch.equal(a, b)
            else:  # the final norm of a bf16 weight: PyTorch's promoted ops vs the C norm on its fp32 copy
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            assert all(torch.equal(x, y) for x, y in zip(kv.k + kv.v, kv2.k + kv2.v))
            assert whole._cos.shape[0] == 1024  # built with the decoder
            far = torch.tensor([[1500, 3, 1]])  # past the first table: it grows to 2048 rows
            whole(ids, far, slots, tables, lens)
            assert whole._cos.shape[0] == 2048
            torch.testing.assert_close(whole._cos[1500], model.rotary_emb(far, torch.float32)[0][0, 0])
            before = [t.clone() for t in kv.k + kv.v]
            bad = ids.clone()
            bad[0, 1] = model.config.vocab_size
            with pytest.raises(ValueError, match="outside the vocabulary"):
                whole(bad, pos, slots, tables, lens)
            with pytest.raises(ValueError, match="position"):
                whole(ids, torch.tensor([[4, -1, 1]]), slots, tables, lens)
            assert all(torch.equal(x, y) for x, y in zip(kv.k + kv.v, before))


@pytest.mark.parametrize(
    "dtype, scheme",
    [
        ("float32", None),
        ("bfloat16", None),
        ("float32", QuantScheme(8, None)),
        ("float32", QuantScheme(4, 32)),
        ("float32", QuantScheme(4, 64, symmetric=False)),
    ],
    ids=["fp32", "bf16", "int8", "int4-g32", "int4-g64-asym"],
)
def test_joined_projections_match_separate_ones(tmp_path, monkeypatch, dtype, scheme):
    """q/k/v, and gate/up, read as one weight each (one kernel call: one activation quantization, one
    run of tiles) give the same hidden states and KV writes, bit for bit, as seven separate projections
    on a second copy of the model (q/k/v biases included); the table says which layers are joined."""
    from baige.kernels.cpu import decode as native_decode

    path = make_checkpoint(tmp_path / "m", "qwen2-bias")
    cfg = load_model(path, "float32").config
    results = []
    for join in (True, False):
        if not join:
            monkeypatch.setattr(native_decode, "JOINED", {})
        model = load_model(path, dtype)
        if scheme is not None:
            quantize_model(model, scheme, ignore=["lm_head"])
        kv, *step = _step_inputs(model)
        fused, why = FusedDecoder.build(model, kv)
        assert fused is not None, why
        rows = fused._layers._table
        qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
        assert [r.qkv.n for r in rows] == [qkv if join else 0] * cfg.num_hidden_layers
        assert [r.gate_up.n for r in rows] == [2 * cfg.intermediate_size if join else 0] * cfg.num_hidden_layers
        with torch.inference_mode():
            results.append((fused(*step), [t.clone() for t in kv.k + kv.v]))
    (a, kv_a), (b, kv_b) = results
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(kv_a, kv_b))


def test_repacked_together_refuses_what_it_cannot_join():
    """Joining needs every member but the last on whole 16-row tiles, one bit width, one in_features and
    (int4) one group count and zero-point form; a joined member's own tiles are views of the joined ones."""
    from baige.kernels.cpu.qlinear import repacked, repacked_together

    g = torch.Generator().manual_seed(0)

    def int4(n, k=64, groups=2, asym=False):
        return (
            torch.randint(-(2**31), 2**31 - 1, (n, k // 8), generator=g, dtype=torch.int32),
            torch.rand(n, groups, generator=g),
            torch.randint(0, 15, (n, groups), generator=g) if asym else None,
        )

    def int8(n, k=64):
        return torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g), None

    assert repacked_together([int4(24), int4(16)]) is None  # 24 rows: half a tile inside the output
    assert repacked_together([int4(16), int4(16, k=32, groups=1)]) is None
    assert repacked_together([int4(16), int4(16, groups=1)]) is None
    assert repacked_together([int4(16), int4(16, asym=True)]) is None
    assert repacked_together([int8(16), int4(16)]) is None
    assert repacked_together([int8(16)]) is None
    parts = [int8(32), int8(16), int8(8)]  # the last member may end on a partial tile
    joined = repacked_together(parts)
    assert joined[0].shape[0] == 2 + 1 + 1
    for (q, s, z), lo, hi in zip(parts, (0, 2, 3), (2, 3, 4)):
        own = repacked(q, s, z)[0]
        assert own.data_ptr() == joined[0][lo:hi].data_ptr() and torch.equal(own, joined[0][lo:hi])
    parts = [int4(16, asym=True), int4(40, asym=True)]
    words, scales, zeros = repacked_together(parts)
    assert words.shape[0] == scales.shape[0] == zeros.shape[0] == 1 + 3
    assert torch.equal(repacked(*parts[1])[2], zeros[1:])


def test_prefill_chunks_and_mixed_steps_run_natively(embedded_dir, monkeypatch):
    """Steps of prefill chunks (16-token chunks here) mixed with decodes run through the native step as
    token rows of their own contexts when small enough (FusedDecoder.takes_rows): greedy tokens equal to
    the per-op path's and prompt logprobs within 1e-4 (fp32 model), and the native step saw the chunks."""
    from baige import LLM, SamplingParams
    from baige.runtime.infer import cpu_decode

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    prompts = ["The capital of France is", "Once upon a time there was a story about a dragon who lived", "1, 2,"]
    llm = LLM(
        str(embedded_dir),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        kv_cache_memory=64 << 20,
        max_num_batched_tokens=16,
        max_num_seqs=3,
        enable_prefix_caching=False,
    )
    rows = []
    call = cpu_decode.FusedDecoder.__call__
    monkeypatch.setattr(
        cpu_decode.FusedDecoder, "__call__", lambda self, ids, *a: rows.append(ids.shape[1]) or call(self, ids, *a)
    )
    native = llm.generate(prompts, params)
    # every prompt token and every decode (5 steps after each prompt's first token) went native, 16 at most
    assert max(rows) == 16 and sum(rows) == sum(len(o.prompt_token_ids) for o in native) + 5 * len(prompts)
    rows.clear()
    monkeypatch.setattr(cpu_decode, "MAX_STEP_ROWS_FP32", 0)
    per_op = llm.generate(prompts, params)
    assert max(rows) <= 3  # decodes only
    for a, b in zip(native, per_op):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lps_a = [lp for lp in a.prompt_logprobs if lp is not None]
        lps_b = [lp for lp in b.prompt_logprobs if lp is not None]
        assert len(lps_a) == len(lps_b) == len(a.prompt_token_ids) - 1
        for x, y in zip(lps_a, lps_b):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top] and len(x.top) == 2
            assert all(abs(p - q) < 1e-4 for (_, p), (_, q) in zip(x.top, y.top))


def test_takes_rows_limits_rows_and_prefill_contexts(tmp_path):
    """A step runs natively up to MAX_STEP_ROWS_FP32 rows on fp32 weights (MAX_STEP_ROWS on bf16 ones),
    and only while its longest prefill context's K + V per KV head fit the native attention's limit."""
    from baige.kernels import NATIVE_ATTENTION_MAX_BYTES
    from baige.runtime.infer import cpu_decode

    for dtype, rows in (("float32", cpu_decode.MAX_STEP_ROWS_FP32), ("bfloat16", cpu_decode.MAX_STEP_ROWS)):
        model = load_model(make_checkpoint(tmp_path / dtype, "llama"), dtype)
        kv = _step_inputs(model, kv_dtype=torch.float32)[0]
        fused = FusedDecoder.build(model, kv)[0]
        limit = NATIVE_ATTENTION_MAX_BYTES // (model.config.head_dim * 2 * 4)  # fp32 K + V per token
        assert fused.takes_rows(rows, limit) and not fused.takes_rows(rows + 1, 1)
        assert not fused.takes_rows(1, limit + 1)
