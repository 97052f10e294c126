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
    """The chain model with the ``style`` ("qwen3" or "deepseek_r1") chat template; returns ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer()
    vocab = tok.get_vocab_size()
    ids = [tok.token_to_id(w) for w in ("Ċ", *WORDS)]  # "\n" (ends Qwen3's generation prompt) first
    chain = {
        ids[0]: tok.token_to_id("<think>"),
        tok.token_to_id("<think>"): tok.token_to_id(REASONING[0]),
        **{tok.token_to_id(a): tok.token_to_id(b) for a, b in zip(REASONING, REASONING[1:])},
        tok.token_to_id(REASONING[-1]): tok.token_to_id("</think>"),
        tok.token_to_id("</think>"): tok.token_to_id(ANSWER[0]),
        **{tok.token_to_id(a): tok.token_to_id(b) for a, b in zip(ANSWER, ANSWER[1:])},
        tok.token_to_id(ANSWER[-1]): tok.token_to_id("<|im_end|>"),
    }
    hidden = 64
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tok.token_to_id("<|im_end|>"),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    basis = torch.linalg.qr(torch.randn(hidden, hidden))[0].T  # orthonormal rows
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        for k, (a, b) in enumerate(chain.items()):
            embed[a] = basis[k]
            head[b] += 2.0 * basis[k]  # after RMSNorm the input is 8 * basis[k]: logit 16
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    template = QWEN3_TEMPLATE if style == "qwen3" else DEEPSEEK_R1_TEMPLATE
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
