"""scripts/data_files.py: the tests' and benchmarks' text files ship in tests/data; $BAIGE_DATA overrides."""

from pathlib import Path

from conftest import REPO, data_files

NAMES = list(data_files.SOURCES)


def test_shipped_files_are_the_recorded_text():
    assert data_files.SHIPPED == REPO / "tests" / "data"
    for name, sha256 in data_files.SOURCES.items():
        assert data_files.digest(data_files.SHIPPED / name) == sha256, name
    assert len((data_files.SHIPPED / "tinyshakespeare.txt").read_text(encoding="utf-8")) == 1115394


def test_baige_data_overrides(tmp_path, monkeypatch):
    monkeypatch.delenv("BAIGE_DATA", raising=False)
    assert data_files.data_dir() == data_files.SHIPPED
    monkeypatch.setenv("BAIGE_DATA", str(tmp_path))
    assert data_files.data_dir() == Path(tmp_path)  # used as given, even before it holds the files
    assert data_files.missing(tmp_path) == NAMES
    (tmp_path / NAMES[0]).write_text("x")
    assert data_files.missing(tmp_path) == NAMES[1:]


def test_missing_files_are_one_note_and_exit_0(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BAIGE_DATA", str(tmp_path / "nothing"))
    assert data_files.main(["--check"]) == 1
    assert data_files.main([]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("note: ") and all(n in err[0] for n in NAMES), err
    assert data_files.main(["--bogus"]) == 2
