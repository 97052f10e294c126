"""The rooflines of the 2026 architectures, by hand: MLA's latent reads (and its expanded, MHA-sized
cache), attention sinks as weights, sliding-window layers' bounded reads in ``bench latency``."""

import shutil

import pytest
from tiny import make_checkpoint

from baige.runtime import roofline
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.transformer import Transformer

# DeepSeek-V3's attention shapes (kv_lora_rank 512, rope 64, nope 128, v 128) on 2 small layers
MLA = dict(
    model_type="deepseek_v3",
    vocab_size=64,
    hidden_size=36,
    intermediate_size=48,
    moe_intermediate_size=8,
    num_hidden_layers=2,
    num_attention_heads=3,
    num_key_value_heads=3,
    n_routed_experts=4,
    num_experts_per_tok=2,
    first_k_dense_replace=2,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
)


def test_mla_counts_its_latent_reads_and_the_mean_of_its_head_widths():
    from baige.runtime.model.mla import use_expanded_cache

    cfg = ModelConfig.from_dict(MLA)
    # (kv_lora_rank + qk_rope_head_dim) values per token per layer, read once for every head
    assert cfg.kv_bytes_per_token(2) == 2 * (512 + 64) * 2 == 2304
    assert roofline.kv_read_bytes_per_token(cfg, 2, 1000) == 2304  # no window: the whole context
    # a decode step at batch 4 and 1000 cached tokens: weights + 4 * 1000 * 2304 bytes
    r = roofline.decode_roofline(10.0, 4, 1_000_000, cfg.kv_bytes_per_token(2), 1000, 1e9)
    assert r["bytes_per_step"] == 1_000_000 + 4 * 1000 * 2304
    model = Transformer(cfg)
    counts = roofline.model_counts(model)
    # QK^T over 192 and PV over 128 values per head: 4 L H Q T with Q = (192 + 128) / 2 = 160
    assert counts["attn_dims"] == 2 * 3 * 160
    assert roofline.forward_flops_per_token(counts["num_params_active"], counts["attn_dims"], 7) == pytest.approx(
        model.flops_per_token(7) / 3
    )
    # the same model with the MHA-sized cache: K and V of 3 heads, each max(192, 128) = 192 wide
    use_expanded_cache(model)
    assert model.config.kv_bytes_per_token(2) == 2 * 2 * 3 * 192 * 2 == 4608
    assert roofline.model_counts(model)["attn_dims"] == 2 * 3 * 160  # same FLOPs, only the cache changes


def test_attention_sinks_are_weights_the_decode_step_reads():
    spec = dict(
        model_type="gpt_oss",
        vocab_size=64,
        hidden_size=24,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        tie_word_embeddings=False,
    )
    model = Transformer(ModelConfig.from_dict(spec))
    counts = roofline.model_counts(model)
    sinks = [p for n, p in model.named_parameters() if n.endswith("sinks")]
    assert [p.numel() for p in sinks] == [4, 4]  # one logit per head per layer
    # every non-embedding parameter (the 8 sinks among them) and the untied 64 x 24 head, fp32
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    assert counts["num_params_non_embedding"] == body
    assert counts["weight_bytes"] == 4 * (body + 64 * 24)
    # layer 0 slides (window 4), layer 1 is full: at a 20-token context a step reads 4 + 20 of 2 x 20 rows
    cfg = model.config
    per_layer = 2 * 2 * 6 * 4
    assert roofline.kv_read_bytes_per_token(cfg, 4, 20) == pytest.approx(per_layer * (4 + 20) / 20)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, embedded_dir):
    path = make_checkpoint(tmp_path_factory.mktemp("gemma3") / "ckpt", "gemma3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_dir / name, path / name)
    return path


def test_bench_latency_roofline_reads_only_the_windows(gemma3_dir):
    """``bench latency`` on a gemma3_text checkpoint (layers sliding, full, sliding, full; window 12):
    its decode roofline counts each sliding layer's 12 keys, not the whole context."""
    from baige.runtime.bench.offline import LatencyConfig, bench_engine, run_latency

    cfg = LatencyConfig(
        bench_engine(model=str(gemma3_dir), dtype="float32"),
        input_len=40,
        output_len=8,
        batch_size=1,
        num_iters=1,
        num_iters_warmup=0,
    )
    r = run_latency(cfg)
    per_layer = 2 * 2 * 16 * 4  # K and V, 2 KV heads x 16 dims, fp32
    ctx = 40 + 8 / 2  # the mean context of the decode
    assert r["model"]["kv_bytes_per_token"] == 4 * per_layer
    assert r["model"]["kv_read_bytes_per_token"] == pytest.approx(per_layer * (12 + ctx + 12 + ctx) / ctx)
    # prefill FLOPs/token 2 N + 4 L H Q T with T the layer mean of the 40-token prompt and the 12-token window
    m = r["model"]
    assert roofline.attn_context(m, 40) == (40 + 12 + 40 + 12) / 4
    assert r["summary"]["prefill_roofline"]["flops_per_token"] == pytest.approx(
        2 * m["num_params_active"] + 4 * m["attn_dims"] * 26
    )
    dec = r["summary"]["decode_roofline"]
    assert dec["bytes_per_step"] == pytest.approx(r["model"]["weight_bytes"] + per_layer * (12 + ctx + 12 + ctx))


class _Seq:
    """The fields ``ScheduledBatch.shape`` reads."""

    def __init__(self, computed: int, total: int):
        self.num_computed_tokens, self.token_ids, self.spec_token_ids = computed, list(range(total)), []


def test_step_shape_counts_a_windows_keys_and_pairs():
    from baige.runtime.infer.scheduler import ScheduledBatch

    # window 4: a 6-token prompt chunk from 0 and one decode row after 10 cached tokens
    batch = ScheduledBatch([_Seq(10, 11), _Seq(0, 6)], [1, 6], num_decodes=1)
    s = batch.shape(window=4)
    assert (s.kv_tokens, s.attn_pairs, s.sampled) == (11 + 6, 11 + 21, 2)
    # the decode reads its last 4 keys; the chunk its 6 (all in reach); pairs min(p + 1, 4): 4 and 1+2+3+4+4+4
    assert (s.window_kv_tokens, s.window_attn_pairs) == (4 + 6, 4 + 18)
    assert batch.shape().window_kv_tokens is None


def test_workload_bounds_count_sliding_layers_by_hand():
    from baige.runtime.infer.scheduler import StepShape

    # two layers, one sliding: each count is the mean of the full layer's and the window's
    counts = {
        "num_params_active": 1000,
        "attn_dims": 10,
        "lm_head_params": 500,
        "weight_bytes": 4000,
        "num_layers": 2,
        "sliding_layers": 1,
        "sliding_window": 2,
    }
    step = StepShape(7, 17, 32, 2, window_kv_tokens=10, window_attn_pairs=22)
    b = roofline.workload_roofline([step], counts, 100, peak=1e6, bandwidth=1e5)
    # FLOPs 2*1000*7 + 4*10*(32 + 22)/2 + 2*500*2 = 17080 (0.01708 s); bytes 4000 + 100*((17 + 10)/2 + 7) = 6050
    assert b["min_time_s"] == pytest.approx(0.0605) and b["bandwidth_bound_steps"] == 1
    # one request of 3 prompt and 4 output tokens, window 2: T = 6; pairs 21 full, 1+2+2+2+2+2 = 11 windowed;
    # cache reads 3 + (3+1) + (3+2) + (3+3) = 18 full, 3 + 2 + 2 + 2 = 9 windowed, plus 6 writes
    f = roofline.workload_floor([(3, 4)], counts, 100, peak=1e6, bandwidth=1e5)
    assert f["compute_s"] == pytest.approx((12000 + 40 * 16 + 4000) / 1e6)
    assert f["memory_s"] == pytest.approx((4 * 4000 + 100 * (13.5 + 6)) / 1e5)


def test_engine_records_the_window_counts_of_its_steps(gemma3_dir):
    from baige.runtime.config import EngineConfig
    from baige.runtime.infer.engine import Engine
    from baige.runtime.infer.sampling import SamplingParams
    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.weights.loader import load_model

    cfg = EngineConfig(
        max_model_len=64, kv_cache_memory=1_000_000, block_size=4, max_num_seqs=1, max_num_batched_tokens=16
    )
    eng = Engine(load_model(gemma3_dir, dtype="float32"), Tokenizer.from_dir(gemma3_dir), cfg)
    eng.step_shapes = []
    eng.add_request("r", list(range(40, 60)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    eng.run_to_completion(["r"])
    # chunks of 16 and 4 prompt tokens, then two decodes; window 12: the second chunk reads 11 + 4 keys
    assert [s.kv_tokens for s in eng.step_shapes] == [16, 20, 21, 22]
    assert [s.window_kv_tokens for s in eng.step_shapes] == [16, 15, 12, 12]
    counts = roofline.model_counts(eng.model)
    assert (counts["num_layers"], counts["sliding_layers"], counts["sliding_window"]) == (4, 2, 12)
