"""The grammar mask is right: on a tiny vocabulary, after random prefixes, a token is allowed
exactly when the text stays a prefix of the language (brute force with the `regex` module's
partial matching), and EOS exactly when the text is complete; plus the engine-level pieces
(constraint validation, the mask applied in sampling, the stop once the language is complete)."""

import json
import random

import pytest
import regex
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from baige.errors import BaigeError
from baige.runtime.infer.sampling import SamplerRow, SamplingParams, sample_batch
from baige.runtime.infer.structured import GrammarCompiler, StructuredOutputsParams

PIECES = ["a", "b", "c", "1", "2", "x", "-", "ab", "bc", "abc", "12", "a1", "b2", "b2c"]
MERGES = [("a", "b"), ("b", "c"), ("ab", "c"), ("1", "2"), ("a", "1"), ("b", "2"), ("b2", "c")]
EOS = len(PIECES)


def tiny_tokenizer_json() -> str:
    """A byte-level BPE over 14 pieces (single ASCII characters map to themselves) plus EOS."""
    vocab = {p: i for i, p in enumerate(PIECES)} | {"</s>": EOS}
    tok = Tokenizer(models.BPE(vocab, MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    return tok.to_str()


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(tiny_tokenizer_json(), EOS + 1, [EOS])


def allowed_by_brute_force(pattern: str, text: str) -> set[int]:
    out = {t for t, piece in enumerate(PIECES) if regex.fullmatch(pattern, text + piece, partial=True)}
    if regex.fullmatch(pattern, text):
        out.add(EOS)
    return out


@pytest.mark.parametrize("pattern", ["(ab|ac)+c?", "a[0-9]{2}b*", "(abc|a1)-[12]+", "x|abc|b2c"])
def test_mask_equals_brute_force_after_random_prefixes(compiler, pattern):
    rng = random.Random(0)
    for _ in range(40):
        m = compiler.matcher(StructuredOutputsParams(regex=pattern))
        text = ""
        for _ in range(rng.randint(0, 5)):  # walk a random valid path
            mask = compiler.start_masks({0: m}).result()[0]
            choices = [t for t in range(EOS) if mask[t]]
            if not choices:
                break
            t = rng.choice(choices)
            assert m.consume_token(t)
            text += PIECES[t]
        got = {t for t in range(EOS + 1) if compiler.start_masks({0: m}).result()[0][t]}
        assert got == allowed_by_brute_force(pattern, text), (pattern, text)


def test_sampling_only_draws_allowed_tokens(compiler):
    m = compiler.matcher(StructuredOutputsParams(choice=["b2c", "x"]))
    mask = compiler.start_masks({0: m}).result()[0]
    logits = torch.zeros(1, EOS + 1)
    logits[0, 0] = 100.0  # "a" would win without the mask
    seen = set()
    for seed in range(30):
        row = SamplerRow(SamplingParams(temperature=1.0), torch.Generator().manual_seed(seed), token_mask=mask)
        seen.add(sample_batch(logits, [row])[0][0])
    starts = {PIECES.index(p) for p in ("b", "b2", "b2c", "x")}  # the tokens that begin a choice
    assert seen and seen <= starts
    greedy = SamplerRow(SamplingParams(temperature=0), None, token_mask=mask)
    assert sample_batch(logits, [greedy])[0][0] in starts


@pytest.mark.parametrize(
    "spec,needle",
    [
        (dict(json={"type": "nonsense"}), "nonsense"),
        (dict(regex="(ab"), "regex"),
        (dict(grammar="start: ???"), "invalid constraint"),
    ],
)
def test_invalid_constraints_raise_one_line(compiler, spec, needle):
    with pytest.raises(BaigeError, match=needle) as e:
        compiler.matcher(StructuredOutputsParams(**spec))
    assert "\n" not in str(e.value) and e.value.param == "structured_outputs"


@pytest.mark.parametrize(
    "spec", [{}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": ["", "a"]}, {"regex": ""}, {"json": 5}]
)
def test_malformed_params_are_refused(spec):
    with pytest.raises(BaigeError):
        StructuredOutputsParams(**spec)


def test_compiled_constraints_are_cached_by_content(compiler):
    before = compiler.stats["compiles"]
    a = StructuredOutputsParams(json=json.dumps({"type": "integer", "minimum": 1}))  # digits: in PIECES
    b = StructuredOutputsParams(json={"minimum": 1, "type": "integer"})
    assert a.key() == b.key()
    compiler.matcher(a)
    compiler.matcher(b)
    assert compiler.stats["compiles"] == before + 1


@pytest.mark.parametrize(
    "kw",
    [
        {"json": {"type": "object"}},  # needs "{", which no piece holds
        {"regex": "zz"},
        {"json": {"$ref": "#"}},
        {"grammar": "start: x\nx: x"},
    ],
)
def test_constraints_no_token_sequence_can_write_are_refused(compiler, kw):
    with pytest.raises(BaigeError, match="accepts no output"):
        compiler.matcher(StructuredOutputsParams(**kw))


def test_a_tokenizer_the_engine_cannot_read_is_refused_once_and_for_all():
    """A character tokenizer with a Fuse decoder (tests/train_utils.py's): llguidance cannot tell each
    token's bytes; every constraint is a BaigeError naming the tokenizer, never a ValueError."""
    vocab = {p: i for i, p in enumerate(["<unk>", "</s>", "a", "{", "}"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(["<unk>", "</s>"])
    tok.decoder = decoders.Fuse()
    fused = GrammarCompiler(tok.to_str(), len(vocab), [1])
    for _ in range(2):  # the second refusal comes from the cached verdict
        with pytest.raises(BaigeError, match="not supported for this model's tokenizer") as e:
            fused.first_mask(StructuredOutputsParams(json={"type": "object"}))
        assert e.value.param == "structured_outputs"
    assert fused.stats["compiles"] == 0
