"""Speculative decoding at batch 1 on the embedded model: tokens/s with and without it.

Two prompt sets, greedy, one request at a time (``LLM.generate`` per prompt, after one warm-up):

- ``grounded``: the model is asked to repeat a wikitext passage of a few hundred tokens word for
  word (the input-grounded case n-gram lookup is for);
- ``open``: open-ended questions with nothing to copy.

Rows: the fp32 model alone; fp32 + n-gram (k = ``--k``); the int4 copy alone (``baige quantize
--method int4``, made once into ``--int4-dir``); fp32 + the int4 copy as draft model (k = ``--draft-k``).
Rows are interleaved (each prompt runs on every row in turn, the fastest of ``--repeats`` kept), so
a busy machine slows them alike. Per row: decode tokens/s ((output tokens - 1) / (finish - first
token), summed over the prompts),
end-to-end tokens/s (output tokens / wall time of the requests), the acceptance counters, and
whether every output equals the plain fp32 run's token for token.

``--sharegpt-out FILE`` also writes the grounded prompts (chat template applied) as a ShareGPT JSON
for ``baige bench serve --dataset-path FILE`` (the completion there is the passage, which sets the
output length).

    .venv/bin/python scripts/bench_spec_decode.py --threads 1 --out bench-results/spec_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines work.",
    "What are the benefits of regular exercise?",
    "Describe the water cycle.",
    "Give some advice to a new programmer.",
    "Why do leaves change colour in autumn?",
    "What makes a good friend?",
    "Explain what a black hole is.",
]


def passages(data: Path, n: int, lo: int = 600, hi: int = 1100) -> list[str]:
    """The first ``n`` wikitext paragraphs of ``lo``..``hi`` characters (about 150-300 tokens)."""
    text = (data / "wikitext-2-raw-test.txt").read_text()
    paras = [p.strip() for p in text.split("\n") if lo < len(p.strip()) < hi and not p.strip().startswith("=")]
    return paras[:n]


def chat_prompts(tok, data: Path, n: int) -> dict[str, list[str]]:
    chat = lambda t: tok.apply_chat_template([{"role": "user", "content": t}])  # noqa: E731
    return {
        "grounded": [chat(f"Repeat the following passage exactly, word for word:\n\n{p}") for p in passages(data, n)],
        "open": [chat(q) for q in QUESTIONS[:n]],
    }


def build(model: str | None, spec: dict | None):
    from baige.runtime.infer.llm import LLM

    return LLM(model, max_model_len=1024, max_num_seqs=1, kv_cache_memory="200MB", speculative_config=spec)


def timed(llm, prompt: str, max_tokens: int) -> dict:
    """One greedy request: its tokens, decode seconds (first token to finish) and wall seconds."""
    from baige.runtime.infer.sampling import SamplingParams

    before = llm.engine.spec_stats.as_dict()
    t = time.monotonic()
    o = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    wall = time.monotonic() - t
    after = llm.engine.spec_stats.as_dict()
    return {
        "tokens": o.outputs[0].token_ids,
        "decode_s": o.finished_time - o.first_token_time,
        "wall_s": wall,
        **{k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")},
    }


def summarize_row(samples: list[dict]) -> dict:
    """Totals over the prompts (each prompt's fastest repeat)."""
    n_out = sum(len(s["tokens"]) for s in samples)
    decode_s, wall = sum(s["decode_s"] for s in samples), sum(s["wall_s"] for s in samples)
    drafts, proposed, accepted = (
        sum(s[k] for s in samples) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    )
    return {
        "output_tokens": n_out,
        "decode_tokens_per_s": (n_out - len(samples)) / decode_s,
        "e2e_tokens_per_s": n_out / wall,
        "num_drafts": drafts,
        "num_draft_tokens": proposed,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def int4_copy(path: Path) -> Path:
    if not (path / "config.json").exists():
        subprocess.run(
            [sys.executable, "-m", "baige", "quantize", "--method", "int4", "--output", str(path)], check=True
        )
    return path


def cpu_flags() -> str:
    try:
        flags = set(re.findall(r"\bavx[^ \n]*", Path("/proc/cpuinfo").read_text()))
    except OSError:
        return platform.processor()
    return " ".join(sorted(flags))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=6, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="n-gram num_speculative_tokens")
    ap.add_argument("--draft-k", type=int, default=4, help="draft-model num_speculative_tokens")
    ap.add_argument("--int4-dir", type=Path, default=Path("bench-results/smollm2-int4"))
    ap.add_argument("--data", type=Path, default=Path(__file__).resolve().parents[1] / "tests" / "data")
    ap.add_argument("--rows", default="fp32,ngram,int4,draft", help="comma-separated rows to run")
    ap.add_argument("--sets", default="grounded,open")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each prompt per row (the fastest is kept)")
    ap.add_argument("--out", type=Path, default=Path("bench-results/spec_decode.json"))
    ap.add_argument("--sharegpt-out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from baige.runtime.model.tokenizer import Tokenizer
    from baige.runtime.weights.hub import resolve_model

    tok = Tokenizer.from_dir(resolve_model(None))
    sets = chat_prompts(tok, args.data, args.prompts)
    if args.sharegpt_out:  # prompts as text (the server tokenizes them), the passage as the completion
        args.sharegpt_out.parent.mkdir(parents=True, exist_ok=True)
        rows = [
            {
                "conversations": [
                    {
                        "from": "human",
                        "value": tok.render_chat_template(
                            [
                                {
                                    "role": "user",
                                    "content": f"Repeat the following passage exactly, word for word:\n\n{src}",
                                }
                            ]
                        ),
                    },
                    {"from": "gpt", "value": src},
                ]
            }
            for src in passages(args.data, args.prompts)
        ]
        args.sharegpt_out.write_text(json.dumps(rows))
        print(f"wrote {args.sharegpt_out}")
    wanted = args.rows.split(",")
    configs = {
        "fp32": (None, None),
        "ngram": (None, {"method": "ngram", "num_speculative_tokens": args.k}),
        "int4": (str(int4_copy(args.int4_dir)) if {"int4", "draft"} & set(wanted) else None, None),
        "draft": (None, {"method": "draft_model", "model": str(args.int4_dir), "num_speculative_tokens": args.draft_k}),
    }
    result = {
        "threads": args.threads,
        "cpu_flags": cpu_flags(),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "load_average": list(os.getloadavg()),
        "rows": {},
    }
    llms = {name: build(*configs[name]) for name in wanted}
    for kind in args.sets.split(","):
        prompts = sets[kind]
        for llm in llms.values():
            llm.generate(prompts[:1], __import__("baige").SamplingParams(max_tokens=8))  # warm-up
        best: dict[str, list[dict]] = {name: [] for name in wanted}
        for p in prompts:  # interleaved: every row runs each prompt in turn, fastest of --repeats kept
            for name in wanted:
                runs = [timed(llms[name], p, args.max_tokens) for _ in range(args.repeats)]
                best[name].append(min(runs, key=lambda r: r["decode_s"]))
        base = best.get("fp32")
        for name in wanted:
            r = summarize_row(best[name])
            r["same_output_as_fp32"] = (
                None if base is None else [b["tokens"] for b in best[name]] == [b["tokens"] for b in base]
            )
            if base is not None:
                r["speedup_vs_fp32"] = r["decode_tokens_per_s"] / summarize_row(base)["decode_tokens_per_s"]
            result["rows"][f"{kind}/{name}"] = r
            print(
                f"{kind:9s} {name:6s} decode {r['decode_tokens_per_s']:6.1f} tok/s  e2e {r['e2e_tokens_per_s']:6.1f}  "
                f"x{r.get('speedup_vs_fp32') or 0:.2f}  accept {r['acceptance_rate'] or 0:.2f}  "
                f"len {r['mean_acceptance_length'] or 0:.2f}  same {r['same_output_as_fp32']}",
                flush=True,
            )
    result["load_average_after"] = list(os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
