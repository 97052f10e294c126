"""The text files the tests and benchmarks read (the runtime never needs them), shipped in ``tests/data/``.

- ``tinyshakespeare.txt``: Karpathy's char-rnn corpus (1,115,394 characters; Shakespeare's plays, public
  domain), for training and calibration.
- ``wikitext-2-raw-test.txt``: the wikitext-2-raw-v1 test split (Merity et al. 2016, CC BY-SA 3.0), its rows
  joined by blank lines as in HF transformers' perplexity guide (``"\\n\\n".join(test["text"])``), for
  perplexity. Sources and licences: ``tests/data/README.md``.

Where they are (:func:`data_dir`): ``$BAIGE_DATA`` when set (used as given), else ``tests/data`` in this
repository. Nothing is downloaded.

Usage: python scripts/data_files.py [--check | --where]
  (no option)  print the resolved directory and say in one line which files it lacks (exit 0 either way)
  --check      exit 0 when the resolved directory holds both files, else 1 (prints nothing)
  --where      print the resolved directory
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "tests" / "data"

# name -> sha256 of the text as read with universal newlines (the copy every recorded number was measured on)
SOURCES = {
    "tinyshakespeare.txt": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed",
    "wikitext-2-raw-test.txt": "696cca6b65a171b0a358a4be6732cdfdf2dd6164a32e20fd70e3c13fc4dfae83",
}


def data_dir() -> Path:
    """The directory holding the text files: ``$BAIGE_DATA`` when set, else the repository's ``tests/data``."""
    if os.environ.get("BAIGE_DATA"):
        return Path(os.environ["BAIGE_DATA"]).expanduser()
    return SHIPPED


def missing(directory: Path) -> list[str]:
    """The names of :data:`SOURCES` that ``directory`` lacks."""
    return [name for name in SOURCES if not (directory / name).is_file()]


def digest(path: Path) -> str:
    """sha256 of a file's text read as UTF-8 with universal newlines (the form :data:`SOURCES` records)."""
    return hashlib.sha256(path.read_text(encoding="utf-8").encode("utf-8")).hexdigest()


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
    if absent:
        print(
            f"note: {directory} lacks {', '.join(absent)} (only some tests and benchmarks read them; "
            "unset BAIGE_DATA to use the copies in tests/data)",
            file=sys.stderr,
        )
    else:
        print(f"data: {directory}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
