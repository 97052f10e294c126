"""Perplexity of the integer-dot CPU kernels against the exact dequantize-to-fp32 path.

The embedded model (or ``--model``) is quantized in memory to int8 (per channel) and int4 (g32, g128
symmetric; RTN, lm_head kept fp32) and its perplexity measured on the first ``--max-tokens`` wikitext
tokens in ``--seq-len`` windows, twice per scheme:

- exact: ``BAIGE_CPU_INT_DOT=0`` (the dequantizing kernels; what ``F.linear`` of the dequantized
  weight gives, up to fp32 summation order);
- int-dot: ``BAIGE_CPU_INT_DOT=1`` with the kernels' row limits lifted, so every projection of every
  window runs through ``qdot.c``, the numerics a decode step sees, with one activation pass
  (``BAIGE_CPU_INT_DOT_PASSES=1``: int8 blocks of 32, llama.cpp's Q8_0 rounding) and with two (the
  default: + the residual's int8 blocks).

Prints a table (perplexity, and int-dot's change in %) and writes JSON.

    .venv/bin/python scripts/ppl_int_dot.py --out bench-results/ppl_int_dot.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF directory, .gguf, alias (default: the embedded model)")
    p.add_argument("--data", default=None, help="text file (default: wikitext-2-raw-test.txt)")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from baige.kernels.cpu import qlinear
    from baige.runtime.evaluate import perplexity
    from baige.runtime.model.tokenizer import Tokenizer, read_tokens
    from baige.runtime.quant.apply import quantize_model
    from baige.runtime.quant.scheme import QuantScheme
    from baige.runtime.settings import reload_settings
    from baige.runtime.weights.hub import resolve_model
    from baige.runtime.weights.loader import load_model

    sys.path.insert(0, str(Path(__file__).parent))
    import data_files

    data = Path(args.data) if args.data else data_files.data_dir() / "wikitext-2-raw-test.txt"
    model_dir = resolve_model(args.model)
    ids = read_tokens(Tokenizer.from_dir(model_dir), data, args.max_tokens)
    base = load_model(model_dir, "float32").eval()
    qlinear.MAX_ROWS = args.seq_len  # every window's projections on the native kernels
    rows = []
    fp32 = perplexity(base, ids, args.seq_len).perplexity
    for name, scheme in [
        ("int8", QuantScheme(8, None)),
        ("int4 g32", QuantScheme(4, 32)),
        ("int4 g128", QuantScheme(4, 128)),
    ]:
        model = copy.deepcopy(base)
        quantize_model(model, scheme, ignore=["lm_head"])
        got = {}
        for mode, passes in (("0", "2"), ("1", "1"), ("1", "2")):
            os.environ["BAIGE_CPU_INT_DOT"], os.environ["BAIGE_CPU_INT_DOT_PASSES"] = mode, passes
            reload_settings()
            with torch.inference_mode():
                got[mode + passes] = perplexity(model, ids, args.seq_len).perplexity
        exact, one, two = got["02"], got["11"], got["12"]
        rows.append(
            {
                "scheme": name,
                "exact": exact,
                "int_dot_1_pass": one,
                "int_dot_2_passes": two,
                "change_pct_1_pass": 100 * (one / exact - 1),
                "change_pct_2_passes": 100 * (two / exact - 1),
            }
        )
        print(
            f"{name:10s} exact {exact:.4f}  int-dot, 1 pass {one:.4f} ({rows[-1]['change_pct_1_pass']:+.3f}%)  "
            f"2 passes {two:.4f} ({rows[-1]['change_pct_2_passes']:+.3f}%)",
            flush=True,
        )
    print(f"fp32 (unquantized) {fp32:.4f}; {len(ids)} tokens of {data.name}, windows of {args.seq_len}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "model": str(model_dir),
                    "data": str(data),
                    "tokens": len(ids),
                    "seq_len": args.seq_len,
                    "fp32": fp32,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
