"""The text files the tests and benchmarks read (the runtime never needs them).

- ``tinyshakespeare.txt``: Karpathy's char-rnn corpus (1,115,394 characters), for training and calibration.
- ``wikitext-2-raw-test.txt``: the wikitext-2-raw-v1 test split, its rows joined by blank lines as in HF
  transformers' perplexity guide (``"\\n\\n".join(test["text"])``), for perplexity.

Where they are (:func:`data_dir`, first match wins):

1. ``$BAIGE_DATA``, when set (used as given: a missing file there is an error, never a download);
2. ``../shared/data`` beside the repository, when it holds both files (this project's machines and CI);
3. ``$BAIGE_CACHE/data`` (default ``~/.cache/baige/data``), which this script fills once from the Hugging
   Face Hub (huggingface_hub; the parquet files are read with pyarrow): ``python scripts/data_files.py``,
   as ``scripts/setup.sh`` runs it.

Usage: python scripts/data_files.py [--check | --where]
  (no option)  fetch the files into the cache when no directory above holds them; exit 1 with one line if that fails
  --check      exit 0 when the resolved directory holds both files, else 1 (prints nothing)
  --where      print the resolved directory
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"

# name -> (HF dataset repo, parquet files whose "text" rows make the file, the separator between rows,
#          sha256 of the text as read with universal newlines: the copy in ../shared/data the README measured on)
SOURCES = {
    "tinyshakespeare.txt": (
        "karpathy/tiny_shakespeare",
        # one row per split; train + validation + test is the original file (a 90/5/5 cut of it)
        [f"data/{split}-00000-of-00001.parquet" for split in ("train", "validation", "test")],
        "",
        "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    ),
    "wikitext-2-raw-test.txt": (
        "Salesforce/wikitext",
        ["wikitext-2-raw-v1/test-00000-of-00001.parquet"],  # 4358 rows, one per line of wiki.test.raw
        "\n\n",
        "696cca6b65a171b0a358a4be6732cdfdf2dd6164a32e20fd70e3c13fc4dfae83",
    ),
}


def cache_data_dir() -> Path:
    """``$BAIGE_CACHE/data``, the cache root resolved as the runtime does (default ``~/.cache/baige``)."""
    return Path(os.environ.get("BAIGE_CACHE") or Path.home() / ".cache" / "baige").expanduser() / "data"


def data_dir() -> Path:
    """The directory holding the text files: ``$BAIGE_DATA``, else ``../shared/data`` when it holds them all,
    else the cache (which may still be empty: see :func:`missing`)."""
    if os.environ.get("BAIGE_DATA"):
        return Path(os.environ["BAIGE_DATA"]).expanduser()
    if all((SHARED / name).is_file() for name in SOURCES):
        return SHARED
    return cache_data_dir()


def missing(directory: Path) -> list[str]:
    return [name for name in SOURCES if not (directory / name).is_file()]


def _download_text(repo: str, files: list[str], sep: str) -> str:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no retry chatter: one line on failure (main)
    paths = [hf_hub_download(repo, f, repo_type="dataset") for f in files]
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeError("reading the downloaded parquet files needs pyarrow (pip install pyarrow)") from None
    rows = [row for p in paths for row in pq.read_table(p, columns=["text"]).column("text").to_pylist()]
    return sep.join(rows)


def fetch(directory: Path) -> None:
    """Download the missing files into ``directory`` (each written under a temporary name, then renamed).

    Raises whatever huggingface_hub raises when the Hub cannot be reached; prints a warning when a file's
    text differs from the copy the README's numbers were measured on (the Hub dataset changed).
    """
    directory.mkdir(parents=True, exist_ok=True)
    for name in missing(directory):
        repo, files, sep, sha256 = SOURCES[name]
        print(f"fetching {name} from the Hugging Face Hub dataset {repo}", file=sys.stderr)
        text = _download_text(repo, files, sep)
        if hashlib.sha256(text.encode("utf-8")).hexdigest() != sha256:
            print(
                f"warning: {name} from {repo} differs from the copy the README's numbers were measured on "
                "(the dataset changed upstream)",
                file=sys.stderr,
            )
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text, encoding="utf-8", newline="")
        tmp.replace(directory / name)


def _first_sentence(e: Exception) -> str:
    text = " ".join(str(e).split())
    return text.split(". ")[0][:200].rstrip(".")


def main(argv: list[str]) -> int:
    directory = data_dir()
    if argv[:1] == ["--where"]:
        print(directory)
        return 0
    if argv[:1] == ["--check"]:
        return 1 if missing(directory) else 0
    if argv:
        print(__doc__.split("Usage:")[1].strip(), file=sys.stderr)
        return 2
    absent = missing(directory)
    if not absent:
        return 0
    if os.environ.get("BAIGE_DATA"):
        print(
            f"error: BAIGE_DATA={directory} lacks {', '.join(absent)} (unset BAIGE_DATA to download them "
            f"into {cache_data_dir()})",
            file=sys.stderr,
        )
        return 1
    try:
        fetch(directory)
    except Exception as e:  # a set-up script: any failure of the download is one line, not a traceback
        print(
            f"error: could not download the test/benchmark text into {directory} from the Hugging Face Hub "
            f"({type(e).__name__}: {_first_sentence(e)}); offline? Put {' and '.join(SOURCES)} "
            "in a directory and set BAIGE_DATA to it",
            file=sys.stderr,
        )
        return 1
    print(f"data: {directory}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
