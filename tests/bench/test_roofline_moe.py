"""The roofline's MoE counts, by hand: active parameters, routed-expert bytes, and the weight bytes
a decode step reads when a batch activates only some experts."""

import pytest
from tiny import make_checkpoint

from baige.runtime import roofline
from baige.runtime.weights.loader import load_model


def test_expected_active_experts_by_hand():
    assert roofline.expected_active_experts(8, 2, 1) == pytest.approx(2.0)  # one token: exactly its k
    assert roofline.expected_active_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert roofline.expected_active_experts(8, 8, 3) == pytest.approx(8.0)  # k = E: all of them
    assert roofline.expected_active_experts(8, 2, 10_000) == pytest.approx(8.0)


def test_step_weight_bytes_by_hand():
    counts = {"weight_bytes": 1000, "routed_expert_bytes": 800, "num_experts": 8, "top_k": 2}
    assert roofline.step_weight_bytes(counts, 1) == pytest.approx(200 + 800 * 2 / 8)  # 400
    assert roofline.step_weight_bytes(counts, 2) == pytest.approx(200 + 800 * 3.5 / 8)  # 550
    assert roofline.step_weight_bytes({"weight_bytes": 1000, "num_experts": 0}, 16) == 1000


def test_model_counts_of_a_tiny_moe(tmp_path):
    # qwen3-moe tiny: hidden 72, 3 layers of which 2 sparse, 7 experts of width 40, top-2
    model = load_model(make_checkpoint(tmp_path / "m", "qwen3-moe"))
    c = roofline.model_counts(model)
    routed = 2 * 7 * 3 * 72 * 40  # sparse layers x experts x (gate, up, down) x hidden x width
    assert c["routed_expert_bytes"] == routed * 4  # fp32
    assert (c["num_experts"], c["top_k"]) == (7, 2)
    assert c["num_params_non_embedding"] - c["num_params_active"] == 2 * (7 - 2) * 3 * 72 * 40
    assert c["num_params_active"] == model.config.num_params(non_embedding=True, active=True)
