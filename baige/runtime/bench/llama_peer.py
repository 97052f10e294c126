"""llama.cpp (through llama-cpp-python) as a peer of ``baige bench compare``: the model's GGUF as shipped (or,
for an HF checkpoint, the GGUF baige's writer makes of it: :func:`model_gguf`), and the same GGUF re-quantized
by llama.cpp itself to the bit widths of baige's quantized rows.

Rows are named ``llama.cpp-<type>`` by the file's llama.cpp file type (GGUF ``general.file_type``,
llama.h's ``LLAMA_FTYPE_MOSTLY_*``): the embedded SmolLM2 GGUF is ``llama.cpp-Q4_1``, Qwen2.5-Coder's
``llama.cpp-Q4_K_M``, a converted fp32 / bf16 HF checkpoint ``llama.cpp-F32`` / ``llama.cpp-BF16``, and
the re-quantized copies ``llama.cpp-Q8_0`` (8.5 bits per weight, baige int8's peer) and ``llama.cpp-Q4_0``
(4.5 bits, baige int4-g32's).

Re-quantization (``llama_model_quantize`` with ``allow_requantize``) runs in a child process,
``python -m baige.runtime.bench.llama_peer SRC DST TYPE THREADS``: with llama-cpp-python 0.3.36 an
in-process call once crashed the benchmark (SIGSEGV right after writing Q4_0). The result is cached as
``$BAIGE_CACHE/llama_cpp/<stem>-<key>-<TYPE>.gguf`` (key: the source's path, size and mtime), written
under a temporary name and renamed only after the child exited 0 and the file starts with the GGUF magic.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# llama.cpp file types baige re-quantizes to (llama.h: LLAMA_FTYPE_MOSTLY_Q4_0 = 2, Q4_1 = 3, Q8_0 = 7)
LLAMA_FTYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
REQUANT_TIMEOUT_S = 1800  # seconds; Q8_0 of a 1.5B model takes well under a minute on one core


def gguf_file_type(path: Path) -> str:
    """llama.cpp's name for the GGUF's file type (``general.file_type``, llama.h's ``LLAMA_FTYPE_*``):
    ``Q4_1``, ``Q4_K_M``, ``F16``, ...; ``GGUF`` when the file does not say. Read with gguf's
    ``GGUFReader`` (memory-mapped; what the GGUF importer uses). Raises ValueError for a file that is
    not GGUF."""
    from gguf import GGUFReader, LlamaFileType

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
    field = GGUFReader(str(path)).fields.get("general.file_type")
    if field is None:
        return "GGUF"
    value = int(field.contents())
    try:
        return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except ValueError:
        return f"ftype{value}"


def _writer_sources() -> list[Path]:
    """The GGUF writer's modules (``weights/gguf_export*.py``), sorted: part of the cache key."""
    from baige.runtime.weights import gguf_export

    return sorted(Path(gguf_export.__file__).parent.glob("gguf_export*.py"))


def hf_gguf(model_dir: Path, cache: Path) -> tuple[Path, list[str]]:
    """The HF checkpoint ``model_dir`` written as a GGUF in its own dtype by baige's writer
    (:func:`baige.runtime.weights.gguf_export.export_gguf`), made once and cached as
    ``$BAIGE_CACHE/llama_cpp/<dir>-<key>-hf.gguf`` (key: the directory's path and its files' sizes and mtimes,
    as the other peers' conversions, and the writer's own source, so a fixed writer never reuses an older
    file); and one line per config field llama.cpp's graph computes differently
    (the row then times the checkpoint's shapes, not its exact function). Raises BaigeError when the family,
    a tensor or the tokenizer has no GGUF form; OSError when the cache cannot be written."""
    from baige.runtime.model.config import ModelConfig
    from baige.runtime.weights.gguf_export import export_gguf
    from baige.runtime.weights.gguf_export_hparams import differing_fields

    differs = differing_fields(ModelConfig.from_file(model_dir / "config.json"))
    files = sorted(p for p in model_dir.iterdir() if p.is_file())
    stamp = ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    writer = hashlib.sha256(b"".join(p.read_bytes() for p in _writer_sources())).hexdigest()
    key = hashlib.sha256(f"{model_dir.resolve()}|{stamp}|{writer}".encode()).hexdigest()[:16]
    out = cache / "llama_cpp" / f"{model_dir.name}-{key}-hf.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        export_gguf(model_dir, out, "auto", [])  # written under a temporary name, renamed when complete
    return out, differs


def model_gguf(spec: str | None, model_dir: Path | None, cache: Path, notes: list[str]) -> Path | None:
    """The GGUF llama.cpp times for the model ``spec``: an alias's embedded GGUF, a ``.gguf`` path, or for an HF
    checkpoint directory ``model_dir`` its conversion (:func:`hf_gguf`; each field llama.cpp computes
    differently becomes a note). None, with one note, when there is none."""
    from baige.errors import BaigeError
    from baige.runtime.weights.hub import ALIASES, DEFAULT_MODEL, alias_gguf_path

    spec = spec or DEFAULT_MODEL
    if spec in ALIASES:
        return alias_gguf_path(spec)
    if spec.endswith(".gguf") and Path(spec).is_file():
        return Path(spec)
    if model_dir is None or not (model_dir / "config.json").is_file():
        notes.append("the model is neither a GGUF file nor an HF directory: llama.cpp skipped")
        return None
    try:
        path, differs = hf_gguf(model_dir, cache)
    except (BaigeError, OSError) as e:
        notes.append(f"llama.cpp skipped: baige cannot write the checkpoint as a GGUF ({e})")
        return None
    notes.extend(f"llama.cpp times the checkpoint's shapes, not its exact function: {d}" for d in differs)
    return path


def cached_path(src: Path, qtype: str, cache: Path) -> Path:
    """Where the ``qtype`` re-quantization of ``src`` is cached under ``cache`` (the baige cache root)."""
    st = src.stat()
    key = hashlib.sha256(f"{src.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache / "llama_cpp" / f"{src.stem}-{key}-{qtype}.gguf"


def child_argv(src: Path, dst: Path, qtype: str, threads: int) -> list[str]:
    """The command line of the re-quantizing child process."""
    return [sys.executable, "-m", __name__, str(src), str(dst), qtype, str(threads)]


def _exit_reason(rc: int) -> str:
    if rc < 0:
        try:
            return f"died of {signal.Signals(-rc).name}"
        except ValueError:
            return f"died of signal {-rc}"
    return f"exited with status {rc}"


def requantize(src: Path, qtype: str, threads: int, cache: Path) -> Path:
    """``src`` re-quantized by llama.cpp to ``qtype`` (a key of :data:`LLAMA_FTYPES`) with ``threads``
    threads, in a child process; a cached result is reused. Returns the GGUF's path.

    Raises RuntimeError (one line: the exit status or signal and the child's last stderr line) when
    the child fails, times out, or leaves no GGUF; OSError when the cache cannot be written. Nothing
    is left under the final name on failure."""
    out = cached_path(src, qtype, cache)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        try:
            proc = subprocess.run(
                child_argv(src, tmp, qtype, threads),
                capture_output=True,
                text=True,
                timeout=REQUANT_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"llama_model_quantize to {qtype} took over {REQUANT_TIMEOUT_S} s") from None
        last = next((ln.strip() for ln in reversed(proc.stderr.splitlines()) if ln.strip()), "")
        if proc.returncode != 0:
            raise RuntimeError(
                f"the llama_model_quantize process (to {qtype}) {_exit_reason(proc.returncode)}"
                + (f": {last[:200]}" if last else "")
            )
        with open(tmp, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RuntimeError(f"llama_model_quantize (to {qtype}) wrote no GGUF file")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def llama_cpp_decode(gguf: Path, prompt: list[int], n: int, threads: int) -> Callable[[], None]:
    """A call that greedily decodes ``n`` tokens after ``prompt`` with llama.cpp on ``gguf`` (EOS
    banned), prompt processing and generation both on ``threads`` threads."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf), n_ctx=len(prompt) + n + 8, n_threads=threads, n_threads_batch=threads, verbose=False
    )
    bias = {llm.token_eos(): -1e9}

    def run() -> None:
        llm.reset()
        llm.create_completion(prompt, max_tokens=n, temperature=0.0, logit_bias=bias)

    return run


def llama_cpp_prefill(gguf: Path, n_ctx: int, threads: int) -> Callable[[list[int]], None]:
    """A call that evaluates a prompt (at most ``n_ctx`` tokens) with llama.cpp on ``gguf`` from an empty
    cache, on ``threads`` threads, in batches of up to ``n_ctx`` tokens (llama-bench's ``pp``)."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False
    )

    def run(prompt: list[int]) -> None:
        llm.reset()
        llm.eval(prompt)

    return run


def _quantize_main(argv: list[str]) -> int:
    """The child: ``SRC DST TYPE THREADS`` -> ``llama_model_quantize``'s return code."""
    import llama_cpp

    src, dst, qtype, threads = argv
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = LLAMA_FTYPES[qtype], True, int(threads)
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"llama_model_quantize returned {rc}", file=sys.stderr)
    return 1 if rc else 0


if __name__ == "__main__":
    code = _quantize_main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown (the file is closed by now): llama.cpp's destructors stay out of it
