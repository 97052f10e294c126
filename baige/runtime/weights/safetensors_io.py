"""Safetensors checkpoints: read every tensor of a (sharded) HF directory, and write one
atomically (:func:`save_hf_checkpoint`, the one writer of HF directories in baige).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import MLA_MODEL_TYPES, MOE_MODEL_TYPES, ModelConfig
from baige.runtime.weights import moe_layout, mtp_layout
from baige.runtime.weights.validate import TensorInfo, read_index, read_safetensors_header

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def checkpoint_files(model_dir: Path) -> dict[str, list[str] | None]:
    """Safetensors files of a checkpoint -> the tensor names the index promises (None: unindexed).

    Raises:
        BaigeError: no safetensors (pickle-only checkpoints are refused, never unpickled), an index
        that is not valid (:func:`~baige.runtime.weights.validate.read_index`) or names a missing shard.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files: dict[str, list[str] | None] = {}
        for tensor, fname in read_index(index).items():
            files.setdefault(fname, []).append(tensor)
        for fname in files:
            if not (model_dir / fname).is_file():
                raise BaigeError(f"{model_dir / fname}: shard listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return {"model.safetensors": None}
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise BaigeError(
            f"{model_dir}: only pickle checkpoints (*.bin/*.pt) found; baige reads safetensors only, never unpickling"
        )
    raise BaigeError(f"{model_dir}: no model.safetensors or model.safetensors.index.json")


def checkpoint_headers(model_dir: Path) -> dict[str, TensorInfo]:
    """Every tensor of a (sharded) checkpoint as its headers declare it, each header checked
    (:func:`~baige.runtime.weights.validate.read_safetensors_header`); no tensor data is read.

    Raises:
        BaigeError: as :func:`checkpoint_files` and ``read_safetensors_header``; a tensor the index
        lists that its shard lacks, or one held by two shards.
    """
    tensors: dict[str, TensorInfo] = {}
    for fname, promised in checkpoint_files(model_dir).items():
        shard = read_safetensors_header(model_dir / fname)
        for name in promised or []:
            if name not in shard:
                raise BaigeError(f"{model_dir / fname}: tensor {name!r} listed in the index is absent")
        for name, info in shard.items():
            if name in tensors:
                raise BaigeError(f"{model_dir / fname}: tensor {name!r} is also in another shard")
            tensors[name] = info
    return tensors


def load_state_dict(model_dir: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Read every tensor of a (possibly sharded) safetensors checkpoint, its headers checked first
    (:func:`checkpoint_headers`).

    Raises BaigeError (naming the file) when a header is not valid, an index entry's tensor is absent
    from its shard, or the file cannot be read.
    """
    from safetensors import SafetensorError, safe_open

    checkpoint_headers(model_dir)
    state: dict[str, torch.Tensor] = {}
    for fname in checkpoint_files(model_dir):
        try:
            with safe_open(str(model_dir / fname), framework="pt") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    state[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        except (SafetensorError, OSError) as e:  # a file changed since its header was checked
            raise BaigeError(f"{model_dir / fname}: not a readable safetensors file ({e})") from None
    return state


@contextmanager
def atomic_dir(out_dir: Path, what: str) -> Iterator[Path]:
    """Write a directory all at once: yields an empty temporary sibling of ``out_dir``, which replaces
    ``out_dir`` (removed first if it exists) when the block ends, or is deleted when the block raises,
    so a reader never sees a half-written directory. The result has the modes the umask gives new
    files and directories (not the temporary directory's owner-only one).

    Raises BaigeError (naming ``what``) when the temporary directory cannot be created.
    """
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as e:
        raise BaigeError(f"{out_dir}: cannot create the {what} ({e.strerror or e})") from None
    try:
        yield tmp
        _umask_modes(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask() -> int:
    """This process's umask (Linux: read from /proc, which leaves it untouched; elsewhere set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _umask_modes(root: Path) -> None:
    """Give ``root`` and everything in it the modes a plain ``mkdir`` / ``open`` would have (0777 / 0666 less
    the umask): ``mkdtemp`` makes the directory owner-only, and some writers make files so too."""
    mask = _umask()
    os.chmod(root, 0o777 & ~mask)
    for path in root.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


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
    A Mixture-of-Experts model's stacked experts are written per expert, as published
    (:func:`baige.runtime.weights.moe_layout.to_hf`).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise BaigeError(f"{out_dir}: already exists and is not empty; choose a new output directory")
    if any(k.startswith("mtp.") for k in state):  # MTP modules under DeepSeek-V3's published names
        state = mtp_layout.to_hf(state, ModelConfig.from_dict(config))
    if config.get("model_type") in (
        *MOE_MODEL_TYPES,
        *MLA_MODEL_TYPES,
    ):  # routed experts back in the published per-expert layout
        state = moe_layout.to_hf(state, ModelConfig.from_dict(config))
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

    with atomic_dir(out_dir, "output directory") as tmp:
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
    return out_dir
