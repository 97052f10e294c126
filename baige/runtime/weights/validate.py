"""Checks of a checkpoint's files before any tensor is read or the model allocated.

A safetensors file (format: https://github.com/huggingface/safetensors, "Format") is an 8-byte
little-endian header length N, N bytes of JSON ``{name: {"dtype", "shape", "data_offsets": [begin,
end]}, "__metadata__": {str: str}}``, then the data; offsets count from the data's start.
:func:`read_safetensors_header` checks all of it with the rules of the reference implementation
(``Metadata::validate``: the tensors' byte ranges tile the data exactly, each as long as its shape and
dtype say), so the ``safetensors`` library is only ever handed files it accepts.

Then, still without reading a tensor: the layer indices the checkpoint names against
``num_hidden_layers`` (:func:`check_layer_count`), the bytes the loaded model will take against the
memory free (:func:`check_fits`), and every tensor's name and shape against the model the config
describes, built on the meta device (:func:`meta_state` with ``loader.check_state_dict``).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from baige.errors import BaigeError
from baige.runtime.model.config import ModelConfig
from baige.runtime.model.config_checks import read_json
from baige.runtime.model.device import available_memory

# safetensors dtype name -> (bytes per element, torch dtype)
SAFETENSORS_DTYPES = {
    "BOOL": (1, torch.bool),
    "U8": (1, torch.uint8),
    "I8": (1, torch.int8),
    "F8_E5M2": (1, torch.float8_e5m2),
    "F8_E4M3": (1, torch.float8_e4m3fn),
    "I16": (2, torch.int16),
    "U16": (2, torch.uint16),
    "F16": (2, torch.float16),
    "BF16": (2, torch.bfloat16),
    "I32": (4, torch.int32),
    "U32": (4, torch.uint32),
    "F32": (4, torch.float32),
    "I64": (8, torch.int64),
    "U64": (8, torch.uint64),
    "F64": (8, torch.float64),
}
MAX_HEADER_BYTES = 100_000_000  # the reference implementation's MAX_HEADER_SIZE
MAX_TENSOR_DIMS = 8
_LAYER = re.compile(r"(?:^|\.)layers\.(\d{1,9})\.")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header declares it (no data read)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise BaigeError(f"the name {dup[:80]!r} appears twice in the header")
    return dict(pairs)


def _tensor_info(name: str, info: object, data_len: int) -> tuple[TensorInfo, int, int]:
    """One header entry checked: a known dtype, a shape of at most 8 non-negative dims, offsets
    inside the data whose span is the shape's byte size. Returns (info, begin, end)."""
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise BaigeError(f"tensor {name!r}: its entry must hold exactly dtype, shape and data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in SAFETENSORS_DTYPES:
        raise BaigeError(f"tensor {name!r}: unknown dtype {str(dtype)[:20]!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_TENSOR_DIMS
        or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in shape)
    ):
        raise BaigeError(f"tensor {name!r}: shape {str(shape)[:60]} is not a list of at most 8 sizes in [0, 2**63)")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise BaigeError(f"tensor {name!r}: data_offsets {str(offsets)[:60]} lie outside the {data_len} data bytes")
    size, torch_dtype = SAFETENSORS_DTYPES[dtype]
    numel = 1
    for d in shape:
        numel *= d
    if numel * size != offsets[1] - offsets[0]:
        raise BaigeError(
            f"tensor {name!r}: shape {tuple(shape)} in {dtype} is {numel * size} bytes "
            f"but data_offsets span {offsets[1] - offsets[0]}"
        )
    return TensorInfo(torch_dtype, tuple(shape), numel * size), offsets[0], offsets[1]


def _parse_header(path: Path) -> tuple[dict, int]:
    """The header JSON object of ``path`` and the length of the data after it."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise BaigeError(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise BaigeError(
                f"header length {n} bytes is past the end of the {size}-byte file"
                if n > size - 8
                else f"header length {n} bytes is past the {MAX_HEADER_BYTES}-byte limit"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise BaigeError(f"header is not valid JSON ({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise BaigeError("header is not a JSON object")
    return header, size - 8 - n


def read_safetensors_header(path: str | Path) -> dict[str, TensorInfo]:
    """Check a safetensors file's header against the format and its own size; read no tensor.

    Returns:
        name -> :class:`TensorInfo` (torch dtype, shape, bytes).

    Raises:
        BaigeError: naming ``path``: shorter than 8 bytes, a header length past the file's end or
        100 MB, a header that is not a JSON object (or repeats a name), ``__metadata__`` not string to
        string, an entry with an unknown dtype, a bad shape, offsets outside the data, a byte span
        that is not its shape's size, spans that overlap or leave bytes uncovered.
    """
    path = Path(path)
    try:
        header, data_len = _parse_header(path)
        meta = header.pop("__metadata__", None)
        if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
            raise BaigeError("__metadata__ must map strings to strings")
        tensors, spans = {}, []
        for name, info in header.items():
            tensors[name], begin, end = _tensor_info(name[:120], info, data_len)
            spans.append((begin, end, name))
        position = 0
        for begin, end, name in sorted(spans):
            if begin != position:
                what = (
                    "overlaps the tensor before it" if begin < position else f"leaves bytes {position}..{begin} unused"
                )
                raise BaigeError(f"tensor {name[:120]!r}: data_offsets [{begin}, {end}] {what}")
            position = end
        if position != data_len:
            raise BaigeError(f"the tensors cover {position} of the {data_len} data bytes")
    except OSError as e:
        raise BaigeError(f"{path}: cannot read ({e.strerror or e})") from None
    except BaigeError as e:
        raise BaigeError(f"{path}: not a valid safetensors file: {e}") from None
    return tensors


def read_index(index: Path) -> dict[str, str]:
    """``model.safetensors.index.json``'s ``weight_map`` (tensor -> shard file name), checked: an
    object of string to string, each shard a plain file name (no directory part: a crafted index
    cannot point outside the checkpoint). Raises BaigeError naming ``index``."""
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise BaigeError(f"{index}: not a valid safetensors index (no weight_map)")
    for tensor, fname in weight_map.items():
        if not isinstance(fname, str) or Path(fname).name != fname or fname in ("", ".", ".."):
            raise BaigeError(f"{index}: tensor {tensor[:80]!r} maps to {str(fname)[:80]!r}, not a file name")
    return weight_map


def check_layer_count(names: list[str], cfg: ModelConfig, where: str | Path) -> None:
    """The checkpoint's layer indices (``...layers.{i}.``) are exactly 0 .. num_hidden_layers - 1.
    Checked before the model is built, so a config declaring far more layers than the file holds
    fails at once. Raises BaigeError naming ``where``."""
    layers = {int(m.group(1)) for name in names if (m := _LAYER.search(name))}
    if layers != set(range(cfg.num_hidden_layers)):
        missing = sorted(set(range(cfg.num_hidden_layers)) - layers)
        detail = (
            f"no tensor of layer {missing[0]}"
            if missing
            else f"a tensor of layer {max(layers - set(range(cfg.num_hidden_layers)))}"
        )
        raise BaigeError(
            f"{where}: config.json declares num_hidden_layers={cfg.num_hidden_layers} but the checkpoint has "
            f"tensors of {len(layers)} layers ({detail})"
        )


def meta_state(tensors: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """Meta-device tensors of the declared dtypes and shapes (no memory): the checkpoint as the
    state-dict checks see it, before any data is read."""
    return {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in tensors.items()}


def loaded_bytes(tensors: dict[str, TensorInfo], dtype: torch.dtype) -> int:
    """Bytes the tensors take once loaded: floating ones converted to ``dtype``, others as stored."""
    return sum(
        t.nbytes // t.dtype.itemsize * dtype.itemsize if t.dtype.is_floating_point else t.nbytes
        for t in tensors.values()
    )


def gib(nbytes: int) -> str:
    """``nbytes`` in GiB, as the errors print it."""
    return f"{nbytes / 2**30:.2f} GiB"


def check_fits(nbytes: int, devices: list[torch.device], what: str) -> None:
    """Refuse, before allocating, a load of ``nbytes`` that is more than any of ``devices`` has free
    (:func:`baige.runtime.model.device.available_memory`). Raises BaigeError starting with ``what``."""
    for device in dict.fromkeys(devices):
        free = available_memory(device)
        if nbytes > free:
            raise BaigeError(
                f"{what} needs {gib(nbytes)} ({nbytes} bytes), more than the {gib(free)} free on {device.type}"
            )


def check_config_fits(cfg: ModelConfig, dtype: torch.dtype, devices: list[torch.device], where: str | Path) -> None:
    """The parameter count config.json declares, at ``dtype``'s size, against the memory free; skipped for
    quantized checkpoints (their bytes per parameter are the headers', checked by :func:`check_fits`).
    Raises BaigeError naming ``where``."""
    if cfg.raw.get("quantization_config"):
        return
    n = cfg.num_params()
    check_fits(n * dtype.itemsize, devices, f"{where}: a model of {n} parameters in {dtype}".replace("torch.", ""))
