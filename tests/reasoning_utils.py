"""A tiny reasoning "model" whose greedy output is known in advance: a random-free Llama checkpoint whose
attention and MLP write nothing (o_proj and down_proj are zero), so each next token depends on the current
token alone, and whose lm_head maps every token of a fixed chain to its successor (orthonormal
embeddings: the successor's logit is 16, every other 0). From the end of the generation prompt it writes

    <think> Okay, the user asks about Paris.</think> It is sunny.<|im_end|>

token by token. A structured-output constraint masks the chain's choice after ``</think>``; among the
tokens it allows (all at logit 0) greedy takes the lowest id, so the constrained answer is decided by the
grammar alone. The tokenizer is byte-level (any text, JSON included, can be written), plus the chain's
words and the chat markers as added tokens; two chat templates: Qwen3's shape (the model opens
``<think>``; ``enable_thinking: false`` writes ``<think></think>`` into the prompt; tools rendered,
hermes calls) and DeepSeek-R1's (the prompt opens ``<think>``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

REASONING = [" Okay,", " the", " user", " asks", " about", " Paris."]
ANSWER = [" It", " is", " sunny."]
REASONING_TEXT = "".join(REASONING)
ANSWER_TEXT = "".join(ANSWER)
SPECIAL = ["<|im_start|>", "<|im_end|>", "<｜User｜>", "<｜Assistant｜>"]
WORDS = ["<think>", "</think>", *REASONING, *ANSWER]
# `baige serve` flags for a chain checkpoint: the reasoning parser from its template, a small KV cache
SERVE_ARGS = (
    "--reasoning-parser",
    "auto",
    "--max-model-len",
    "2048",
    "--kv-cache-memory",
    "40MB",
    "--log-level",
    "warning",
)

QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    'Call a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{%- endif %}"
)
DEEPSEEK_R1_TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{%- elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<|im_end|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<｜Assistant｜><think>{%- endif %}"
)


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in WORDS])
    return tok


def write_reasoning_checkpoint(path: Path, style: str) -> Path:
    """The chain model with the ``style`` ("qwen3" or "deepseek_r1") chat template, written as an HF Llama
    checkpoint (config.json, model.safetensors, tokenizer files); returns ``path``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    vocab, hidden, inter, heads, kv_heads = tok.get_vocab_size(), 64, 96, 4, 2
    t = tok.token_to_id
    chain = {
        t("Ċ"): t("<think>"),  # "\n" ends Qwen3's generation prompt
        t("<think>"): t(REASONING[0]),
        **{t(a): t(b) for a, b in zip(REASONING, REASONING[1:])},
        t(REASONING[-1]): t("</think>"),
        t("</think>"): t(ANSWER[0]),
        **{t(a): t(b) for a, b in zip(ANSWER, ANSWER[1:])},
        t(ANSWER[-1]): t("<|im_end|>"),
    }
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(hidden, hidden, generator=g))[0].T  # orthonormal rows
    embed, head = torch.zeros(vocab, hidden), torch.zeros(vocab, hidden)
    for k, (a, b) in enumerate(chain.items()):
        embed[a] = basis[k]
        head[b] += 2.0 * basis[k]  # after RMSNorm the input is 8 * basis[k]: logit 16, every other 0
    head_dim = hidden // heads
    layer = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": embed,
        "lm_head.weight": head,
        "model.norm.weight": torch.ones(hidden),
        layer + "input_layernorm.weight": torch.ones(hidden),
        layer + "post_attention_layernorm.weight": torch.ones(hidden),
        layer + "self_attn.q_proj.weight": 0.1 * torch.randn(hidden, hidden, generator=g),
        layer + "self_attn.k_proj.weight": 0.1 * torch.randn(kv_heads * head_dim, hidden, generator=g),
        layer + "self_attn.v_proj.weight": 0.1 * torch.randn(kv_heads * head_dim, hidden, generator=g),
        layer + "self_attn.o_proj.weight": torch.zeros(hidden, hidden),  # attention writes nothing
        layer + "mlp.gate_proj.weight": 0.1 * torch.randn(inter, hidden, generator=g),
        layer + "mlp.up_proj.weight": 0.1 * torch.randn(inter, hidden, generator=g),
        layer + "mlp.down_proj.weight": torch.zeros(hidden, inter),  # nor does the MLP
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "eos_token_id": t("<|im_end|>"),
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    tok.save(str(path / "tokenizer.json"))
    template = QWEN3_TEMPLATE if style == "qwen3" else DEEPSEEK_R1_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    return path
