import math

import pytest
import torch

from baige.errors import BaigeError
from baige.runtime.infer.sampling import SamplerRow, SamplingParams, apply_filters, sample, sample_batch


def test_temperature_zero_is_greedy_whatever_the_filters():
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0], [5.0, 0.0, 0.0, 4.99]])
    p = SamplingParams(temperature=0.0, top_p=0.01, top_k=3, min_p=0.9)
    assert sample(logits, p).tolist() == [1, 0]


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    out = apply_filters(logits, top_k=2, top_p=1.0, min_p=0.0)
    assert torch.isfinite(out).tolist() == [[False, True, True, False, False]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the first two tokens survive
    assert torch.isfinite(apply_filters(logits, 0, 0.7, 0.0)).tolist() == [[True, True, False, False]]
    # p = 0.5 exactly is reached by the first token alone
    assert torch.isfinite(apply_filters(logits, 0, 0.5, 0.0)).tolist() == [[True, False, False, False]]


def test_min_p_scales_with_top_probability():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    # threshold 0.4 * 0.5 = 0.2 keeps 0.5 and 0.3
    assert torch.isfinite(apply_filters(probs.log(), 0, 1.0, 0.4)).tolist() == [[True, True, False, False]]


def test_seed_reproduces_and_frequencies_follow_softmax():
    logits = torch.tensor([[0.0, 1.0, 2.0]]).expand(4000, -1)
    p = SamplingParams(temperature=1.0, seed=7)
    a = sample(logits, p, torch.Generator().manual_seed(7))
    b = sample(logits, p, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    freq = torch.bincount(a, minlength=3).float() / len(a)
    expected = torch.tensor([0.0, 1.0, 2.0]).softmax(0)  # 0.090, 0.245, 0.665
    assert (freq - expected).abs().max() < 0.03


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2), dict(max_tokens=0)]
)
def test_bad_params_are_user_errors(kwargs):
    with pytest.raises(BaigeError):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------------------------------------------
# sample_batch (the engine's sampler) against a brute-force per-row reference in plain Python floats
# (float64). The reference follows the documented order (vLLM's): allowed_token_ids mask, logit_bias,
# min_tokens mask of the stop ids, repetition penalty, presence/frequency penalties; greedy = argmax
# (first index on ties); otherwise / temperature, top-k, top-p, min-p, each on the renormalised
# result of the one before; top-k keeps every token tied with the k-th (as apply_filters).

NEG = -math.inf


def ref_adjust(logits, p: SamplingParams, prompt_ids=(), output_ids=(), stop_ids=()):
    x = [float(v) for v in logits]
    if p.allowed_token_ids is not None:
        allowed = set(p.allowed_token_ids)
        x = [v if t in allowed else NEG for t, v in enumerate(x)]
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output_ids) < p.min_tokens:
        for t in stop_ids:
            x[t] = NEG
    if p.repetition_penalty != 1:
        for t in set(prompt_ids) | set(output_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in range(len(x)):
        c = list(output_ids).count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (1 if c else 0)
    return x


def ref_softmax(z, keep):
    m = max(z[t] for t in keep)
    e = {t: math.exp(z[t] - m) for t in keep}
    s = sum(e.values())
    return {t: v / s for t, v in e.items()}


def ref_probs(logits, p: SamplingParams, prompt_ids=(), output_ids=(), stop_ids=()):
    """The final sampling distribution, by token id (list of V floats)."""
    x = ref_adjust(logits, p, prompt_ids, output_ids, stop_ids)
    V = len(x)
    if p.temperature < 1e-5:
        best = max(range(V), key=lambda t: (x[t], -t))  # first index of the maximum
        return [1.0 if t == best else 0.0 for t in range(V)]
    z = [v / p.temperature for v in x]
    order = sorted(range(V), key=lambda t: (-z[t], t))
    keep = {t for t in range(V) if z[t] > NEG}
    if 0 < p.top_k < V:
        kth = z[order[p.top_k - 1]]
        keep = {t for t in keep if z[t] >= kth}
    if p.top_p < 1:
        pr, mass, kept = ref_softmax(z, keep), 0.0, set()
        for t in order:
            if t in keep:
                if mass < p.top_p:  # dropped once the mass before it reaches top_p
                    kept.add(t)
                mass += pr[t]
        keep = kept
    if p.min_p > 0:
        pr = ref_softmax(z, keep)
        top = max(pr.values())
        keep = {t for t in keep if pr[t] >= p.min_p * top}
    pr = ref_softmax(z, keep)
    return [pr.get(t, 0.0) for t in range(V)]


def ref_draw(logits, p: SamplingParams, seed: int, prompt_ids=(), output_ids=(), stop_ids=()):
    """The token inverse-transform sampling draws with torch.Generator().manual_seed(seed): one
    U ~ U[0, 1) (float64, torch's stream), x = (1 - U) * total mass, the first token (vocabulary
    order) whose cumulative mass reaches x."""
    probs = ref_probs(logits, p, prompt_ids, output_ids, stop_ids)
    u = torch.rand((), dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).item()
    x, cum = (1 - u) * sum(probs), 0.0
    for t, q in enumerate(probs):
        cum += q
        if cum >= x and q > 0:
            return t
    raise AssertionError("no token reached the mass")


def ref_logsoftmax(logits):
    x = [float(v) for v in logits]
    m = max(x)
    lse = m + math.log(sum(math.exp(v - m) for v in x))
    return [v - lse for v in x]


def support(probs):
    return {t for t, q in enumerate(probs) if q > 0}


def lg(*probs):
    """Logits whose softmax is ``probs``."""
    return [math.log(q) for q in probs]


def row(p, seed=None, prompt_ids=None, output_ids=None, stop_ids=None):
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplerRow(p, gen, prompt_ids, output_ids, stop_ids)


def draw(logits_rows, rows):
    tokens, lps = sample_batch(torch.tensor(logits_rows, dtype=torch.float32), rows)
    return tokens, lps


# Hand-computed cases (literal expected supports, not from the reference): the order of operations.
HAND_SUPPORTS = [
    # top-k 3 first renormalises to .47/.29/.24: .47 + .29 >= .7 keeps 2 (without renormalising,
    # .4 + .25 = .65 < .7 would keep 3)
    (lg(0.4, 0.25, 0.2, 0.1, 0.05), dict(top_k=3, top_p=0.7), {}, {0, 1}),
    # top-p .7 first (keeps 3: .4 + .25 < .7), then min-p .3 (threshold .12 keeps the same 3); min-p
    # first would renormalise to .47/.29/.24 and top-p would keep 2
    (lg(0.4, 0.25, 0.2, 0.1, 0.05), dict(top_p=0.7, min_p=0.3), {}, {0, 1, 2}),
    # temperature before top-p: at T=2 the probabilities are .51/.31/.19 and top-p .6 keeps 2 (at
    # T=1: .67/.24/.09 keeps 1)
    ([2.0, 1.0, 0.0], dict(temperature=2.0, top_p=0.6), {}, {0, 1}),
    ([2.0, 1.0, 0.0], dict(temperature=1.0, top_p=0.6), {}, {0}),
    # penalties before temperature: [2, 1, 0] - presence 1 on token 0 = [1, 1, 0], / 2 -> an exact
    # tie that min-p 1 keeps (temperature first would give [0, .5, 0] -> {1})
    ([2.0, 1.0, 0.0], dict(temperature=2.0, presence_penalty=1.0, min_p=1.0), dict(output_ids=[0]), {0, 1}),
    # min-p = 1 keeps exactly the tokens tied at the maximum
    ([1.0, 3.0, 0.5, 3.0, 3.0, -2.0], dict(min_p=1.0), {}, {1, 3, 4}),
    # min-p .5: threshold .5 * .4 = .2 keeps .4, .3 and the tied .2 (equal survives), not .1
    (lg(0.4, 0.3, 0.1, 0.2), dict(min_p=0.5), {}, {0, 1, 3}),
    # allowed_token_ids masks before logit_bias: a +100 bias on a disallowed token does nothing
    ([5.0, 1.0, 0.0, 2.0], dict(allowed_token_ids=[1, 2], logit_bias={0: 100.0}, min_p=0.5), {}, {1}),
    # min_tokens: the stop id 1 is masked while fewer than min_tokens are generated ...
    ([0.0, 9.0, 1.0, 1.0], dict(min_tokens=3, min_p=0.5), dict(output_ids=[2, 2], stop_ids=[1]), {2, 3}),
    # ... and no longer once min_tokens are
    ([0.0, 9.0, 1.0, 1.0], dict(min_tokens=3, min_p=0.5), dict(output_ids=[2, 2, 3], stop_ids=[1]), {1}),
]


@pytest.mark.parametrize("logits,kw,ctx,expected", HAND_SUPPORTS)
def test_sample_batch_hand_computed_supports(logits, kw, ctx, expected):
    p = SamplingParams(**kw)
    assert support(ref_probs(logits, p, **ctx)) == expected  # the reference agrees with the hand value
    seen = set()
    for seed in range(400):
        tokens, _ = draw([logits], [row(p, seed, **ctx)])
        seen.add(tokens[0])
    assert seen == expected


# Hand-computed greedy cases: the adjusted logits decide the argmax.
HAND_GREEDY = [
    # frequency x count + presence once: [3 - 1.5 - .2, 2.6 - .5 - .2, 2.0, 0] = [1.3, 1.9, 2.0, 0]
    ([3.0, 2.6, 2.0, 0.0], dict(frequency_penalty=0.5, presence_penalty=0.2), dict(output_ids=[0, 0, 0, 1]), 2),
    # repetition 1.5 on prompt {0} and output {1, 4}: [2/1.5, -1*1.5, 1.5, .5, 1.8/1.5] -> token 2
    ([2.0, -1.0, 1.5, 0.5, 1.8], dict(repetition_penalty=1.5), dict(prompt_ids=[0], output_ids=[1, 4]), 2),
    # a negative seen logit is multiplied: -1 * 1.5 = -1.5 < -1.2 (unseen)
    ([9.0, -1.0, 9.0, -1.2], dict(repetition_penalty=1.5, allowed_token_ids=[1, 3]), dict(output_ids=[1]), 3),
    # repetition before presence: 2/2 - 1 = 0 < .3 (presence first: (2-1)/2 = .5 > .3)
    ([2.0, 0.3], dict(repetition_penalty=2.0, presence_penalty=1.0), dict(output_ids=[0]), 1),
    # logit_bias: 1 + 2.5 beats 3; a negative bias 3 - 1.5 loses to 2
    ([1.0, 2.0, 3.0], dict(logit_bias={0: 2.5}), {}, 0),
    ([1.0, 2.0, 3.0], dict(logit_bias={2: -1.5}), {}, 1),
    # ties: the first index of the maximum
    ([1.0, 4.0, 0.0, 4.0], {}, {}, 1),
    # min_tokens masks the stop ids (EOS 1 and stop id 3), not the others
    ([0.0, 5.0, 1.0, 4.0], dict(min_tokens=2), dict(output_ids=[0], stop_ids=[1, 3]), 2),
    ([0.0, 5.0, 1.0, 4.0], dict(min_tokens=2), dict(output_ids=[0, 2], stop_ids=[1, 3]), 1),
    # (also when a penalty sends the row through the logit processors anyway)
    ([0.0, 5.0, 1.0, 4.0], dict(min_tokens=2, presence_penalty=0.1), dict(output_ids=[0, 2], stop_ids=[1, 3]), 1),
]


@pytest.mark.parametrize("logits,kw,ctx,expected", HAND_GREEDY)
def test_sample_batch_hand_computed_greedy(logits, kw, ctx, expected):
    p = SamplingParams(temperature=0.0, **kw)
    assert support(ref_probs(logits, p, **ctx)) == {expected}
    tokens, lps = draw([logits], [row(p, **ctx)])
    assert tokens == [expected] and lps == [None]


# One batch, V = 10, every row its own parameters; ties inside supports and among dropped tokens.
BATCH_V10 = [
    # greedy with a repetition penalty that moves the argmax; a tie for the new maximum (3 and 7)
    (
        [1.0, 4.0, 0.5, 3.0, -1.0, 2.0, 0.0, 3.0, -2.0, 1.5],
        dict(temperature=0.0, repetition_penalty=2.0),
        dict(prompt_ids=[1], output_ids=[5]),
    ),
    # top-k 4 with ties inside the kept set (2.0 x 2) and among the dropped (0.0 x 3)
    ([2.5, 2.0, 0.0, 2.0, 0.0, 1.0, 0.0, -1.0, 0.3, 0.7], dict(temperature=0.7, top_k=4), {}),
    # top-p
    (lg(0.22, 0.05, 0.18, 0.15, 0.12, 0.08, 0.08, 0.06, 0.04, 0.02), dict(temperature=1.3, top_p=0.8), {}),
    # min-p with a tie at the maximum
    ([1.0, 2.0, 2.0, 0.2, 1.5, -0.5, 0.82, 1.9, -3.0, 0.0], dict(temperature=1.0, min_p=0.3), {}),
    # greedy next to sampling rows, with logit_bias
    ([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], dict(temperature=0.0, logit_bias={2: 7.5}), {}),
    # all three filters
    ([1.2, 0.4, 2.2, 1.9, -0.3, 0.9, 1.6, 0.1, 2.0, -1.1], dict(temperature=0.9, top_k=6, top_p=0.85, min_p=0.15), {}),
    # penalties + logit_bias + allowed_token_ids + min_tokens masking of two stop ids
    (
        [0.5, 3.0, 1.0, 2.0, 1.8, -0.2, 2.2, 0.9, 1.1, 2.4],
        dict(
            temperature=1.1,
            presence_penalty=0.3,
            frequency_penalty=0.4,
            repetition_penalty=1.3,
            logit_bias={4: 0.7, 0: -2.0},
            allowed_token_ids=[0, 1, 2, 3, 4, 6, 8, 9],
            min_tokens=5,
        ),
        dict(prompt_ids=[2, 3], output_ids=[3, 3, 6, 8], stop_ids=[1, 9]),
    ),
    # plain temperature sampling, no filter
    ([0.3, -0.4, 1.1, 0.0, 0.6, -1.5, 0.9, 0.2, -0.7, 0.5], dict(temperature=1.5), {}),
]


def test_sample_batch_support_equals_reference_per_row():
    refs = [ref_probs(lgts, SamplingParams(**kw), **ctx) for lgts, kw, ctx in BATCH_V10]
    supports = [support(r) for r in refs]
    # hand-checked anchors for the reference itself
    assert supports[0] == {3} and supports[4] == {2}  # 4 / 2 < 3 (tied with 7: first index); 2 + 7.5 > 9
    # top-k 4: 2.5, 2.0, 2.0, 1.0; min-p .3 keeps x >= 2 + ln .3 = 0.796: 2.0 x 2, 1.9, 1.5, 1.0, 0.82
    assert supports[1] == {0, 1, 3, 5} and supports[3] == {0, 1, 2, 4, 6, 7}
    assert 1 not in supports[6] and 9 not in supports[6] and 5 not in supports[6]
    assert min(q for r in refs for q in r if q > 0) > 0.01  # 1000 draws reach every support token
    logits = [lgts for lgts, _, _ in BATCH_V10]
    seen = [set() for _ in BATCH_V10]
    for seed in range(1000):
        rows = [row(SamplingParams(**kw), seed * 16 + i, **ctx) for i, (_, kw, ctx) in enumerate(BATCH_V10)]
        tokens, lps = draw(logits, rows)
        assert lps == [None] * len(rows)
        for i, t in enumerate(tokens):
            assert t in supports[i], (i, seed, t)
            seen[i].add(t)
    assert seen == supports


# Rows whose adjusted logits are all distinct (the draw then does not depend on how ties are ordered).
RACE_ROWS = [
    ([0.3, -0.4, 1.1, 0.05, 0.6, -1.5, 0.9, 0.2], dict(temperature=1.0), {}),
    ([0.3, -0.4, 1.1, 0.05, 0.6, -1.5, 0.9, 0.2], dict(temperature=0.6, top_k=5), {}),
    (lg(0.3, 0.05, 0.2, 0.16, 0.12, 0.09, 0.05 + 1e-3, 0.03 - 1e-3), dict(temperature=1.2, top_p=0.75), {}),
    ([2.0, 0.1, 1.4, -0.6, 1.7, 0.8, -2.0, 1.1, 0.45, 0.3, -0.1], dict(temperature=0.8, min_p=0.2), {}),
    ([1.2, 0.4, 2.2, 1.9, -0.3, 0.9, 1.6, 0.1, 2.05, -1.1], dict(temperature=0.9, top_k=7, top_p=0.9, min_p=0.1), {}),
    (
        [0.5, 3.0, 1.0, 2.0, 1.8, -0.2, 2.2, 0.9, 1.1, 2.4, 0.05, 0.7],
        dict(
            temperature=1.1,
            presence_penalty=0.3,
            frequency_penalty=0.45,
            repetition_penalty=1.3,
            logit_bias={4: 0.7, 0: -2.0},
            allowed_token_ids=[0, 1, 2, 3, 4, 6, 8, 9, 10, 11],
            min_tokens=5,
            top_p=0.95,
        ),
        dict(prompt_ids=[2, 3], output_ids=[3, 3, 6, 8], stop_ids=[1, 9]),
    ),
]


def test_sample_batch_seeded_draw_is_the_inverse_transform():
    logits = [lgts for lgts, _, _ in RACE_ROWS]
    # the same rows in two batch layouts: with a greedy row in front and in reverse order
    greedy_logits = [0.0, 2.0, 1.0, 3.0, -1.0, 0.5, 0.2, 0.1, 0.0, 0.0, 0.0, 0.0]
    for seed in range(200):
        seeds = [seed * 8 + i for i in range(len(RACE_ROWS))]
        expected = [ref_draw(lgts, SamplingParams(**kw), s, **ctx) for (lgts, kw, ctx), s in zip(RACE_ROWS, seeds)]
        rows = [row(SamplingParams(**kw), s, **ctx) for (_, kw, ctx), s in zip(RACE_ROWS, seeds)]
        tokens, _ = sample_batch(torch.tensor(logits[0:3], dtype=torch.float32), rows[0:3])
        assert tokens == expected[0:3], seed
        for rest in range(3, len(RACE_ROWS)):  # rows of other vocabulary sizes, one per batch
            tokens, _ = draw([logits[rest]], [rows[rest]])
            assert tokens == [expected[rest]], (seed, rest)
        # batch layout does not matter: a greedy row in front, the others reversed, fresh generators
        rows = [row(SamplingParams(**kw), s, **ctx) for (_, kw, ctx), s in zip(RACE_ROWS[:3], seeds)]
        tokens, _ = draw([greedy_logits[:8]] + logits[2::-1], [row(SamplingParams(temperature=0.0), 99)] + rows[::-1])
        assert tokens == [3] + expected[2::-1], seed


def test_greedy_row_does_not_consume_its_generator():
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    tokens, _ = draw([[0.0, 1.0, 0.5]], [SamplerRow(SamplingParams(temperature=0.0), g)])
    assert tokens == [1] and torch.equal(g.get_state(), state)


def test_sample_batch_logprobs_are_the_raw_log_softmax():
    # softmax([0, ln 2, ln 5]) = [1/8, 2/8, 5/8]; penalties and temperature do not enter the logprobs
    r0 = [0.0, math.log(2), math.log(5)]
    tokens, lps = draw([r0], [row(SamplingParams(temperature=0.0, logprobs=2, logit_bias={0: 50.0}))])
    assert tokens == [0] and lps[0].token_id == 0
    assert lps[0].logprob == pytest.approx(math.log(1 / 8), abs=1e-6)
    assert [t for t, _ in lps[0].top] == [2, 1]
    assert [v for _, v in lps[0].top] == pytest.approx([math.log(5 / 8), math.log(2 / 8)], abs=1e-6)
    # a batch: logprobs None / 0 / 3 / 1 per row, with penalties, temperature and filters
    batch = [
        (
            [0.3, -0.4, 1.1, 0.05, 0.6, -1.5, 0.9, 0.2],
            dict(temperature=0.0, logprobs=None, repetition_penalty=3.0),
            dict(prompt_ids=[2]),
        ),
        ([1.3, -0.4, 0.1, 0.05, 0.6, -1.5, 0.9, 0.2], dict(temperature=0.7, logprobs=0, top_k=3), {}),
        (
            [0.2, 2.1, -1.0, 0.7, 1.4, 0.0, 0.5, -0.3],
            dict(temperature=1.4, logprobs=3, presence_penalty=1.5, min_p=0.1),
            dict(output_ids=[1]),
        ),
        ([0.2, 2.1, -1.0, 0.7, 1.4, 0.0, 0.5, -0.3], dict(temperature=0.0, logprobs=1, logit_bias={7: 10.0}), {}),
    ]
    for seed in range(20):
        rows = [row(SamplingParams(**kw), seed + 100 * i, **ctx) for i, (_, kw, ctx) in enumerate(batch)]
        tokens, lps = draw([lgts for lgts, _, _ in batch], rows)
        assert tokens[0] == 6 and tokens[3] == 7  # 1.1 / 3 < .9; -.3 + 10 wins
        assert lps[0] is None
        for i in (1, 2, 3):
            ref = ref_logsoftmax(batch[i][0])
            k = batch[i][1]["logprobs"]
            assert lps[i].token_id == tokens[i]
            assert lps[i].logprob == pytest.approx(ref[tokens[i]], abs=1e-6)
            best = sorted(range(8), key=lambda t: -ref[t])[:k]
            assert [t for t, _ in lps[i].top] == best
            assert [v for _, v in lps[i].top] == pytest.approx([ref[t] for t in best], abs=1e-6)
        assert lps[3].top[0][0] == 1 and lps[3].token_id == 7  # the raw top-1 is not the biased pick


def test_sample_batch_top_k_keeps_ties_with_the_kth():
    """Like apply_filters and vLLM: every token tied with the k-th largest logit stays."""
    logits, p = [3.0, 2.0, 2.0, 1.0], SamplingParams(top_k=2)
    expected = {0, 1, 2}
    assert support(ref_probs(logits, p)) == expected
    assert torch.isfinite(apply_filters(torch.tensor([logits]), 2, 1.0, 0.0)).tolist() == [[True, True, True, False]]
    seen = {draw([logits], [row(p, seed)])[0][0] for seed in range(300)}
    assert seen == expected


def test_min_tokens_never_masks_every_allowed_token():
    """allowed_token_ids of stop ids only, min_tokens not reached: the stop ids stay drawable (a row
    of all -inf would otherwise yield token 0, which is not allowed)."""
    p = SamplingParams(allowed_token_ids=[2], min_tokens=3, temperature=0)
    r = SamplerRow(p, None, output_ids=[], stop_ids=[2])
    tokens, _ = sample_batch(torch.tensor([[5.0, 4.0, 1.0, 0.0]]), [r])
    assert tokens == [2]
    p = SamplingParams(allowed_token_ids=[1, 2], min_tokens=3, temperature=0)
    tokens, _ = sample_batch(torch.tensor([[5.0, 0.5, 4.0, 0.0]]), [SamplerRow(p, None, output_ids=[], stop_ids=[2])])
    assert tokens == [1]  # a non-stop allowed token exists: the stop id is masked


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_p=1e-46),  # > 0 as a Python float, 0 in fp32: every token's preceding mass "reaches" it
        dict(temperature=1e39),  # inf in fp32: -inf / inf is NaN for every refused token
        dict(repetition_penalty=1e-46),  # 0 in fp32: a seen logit / 0 is inf, a refused one -inf * 0 NaN
    ],
)
def test_parameters_past_fp32_range_still_draw_an_allowed_token(kw):
    """Values the API accepts but fp32 rounds to 0 or inf: the draw stays inside allowed_token_ids and
    the filters' meaning holds (the most likely allowed token survives top-p), never a NaN row."""
    logits = [[5.0, 4.0, 1.0, 3.0, 0.5]]
    p = SamplingParams(allowed_token_ids=[1, 3], **kw)
    seen = {draw(logits, [row(p, seed, prompt_ids=[1], output_ids=[3])])[0][0] for seed in range(50)}
    expected = {1} if "top_p" in kw else {1, 3}  # top_p ~ 0 keeps the argmax of the allowed tokens
    assert seen == expected
    assert torch.isfinite(apply_filters(torch.tensor(logits), 0, 1e-46, 0.0)).tolist() == [
        [True, False, False, False, False]
    ]
    assert sample(torch.tensor(logits), SamplingParams(temperature=1e39), torch.Generator().manual_seed(0)).shape == (
        1,
    )
