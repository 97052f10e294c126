"""LoRA on the embedded SmolLM2-135M-Instruct changes its answers on held-out prompts
(scripts/lora_demo.py: a fixed answer format; a few minutes of CPU)."""

import pytest
from conftest import _load_script


@pytest.mark.slow
def test_lora_teaches_the_embedded_model_a_format(tmp_path, embedded_dir):
    result = _load_script("lora_demo").run(tmp_path, steps=20)
    assert result["format_share_before"] <= 0.1, result["examples"]
    assert result["format_share_after"] >= 0.9, result["examples"]
    assert result["loss_last"] < result["loss_first"]
    mem = result["memory"]
    assert mem["lora_r8"]["trainable_params"] == 30 * 8 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))
    assert mem["full_finetune"]["bytes"] > 3 * mem["lora_r8"]["bytes"]
