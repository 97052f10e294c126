"""scripts/data_files.py: where the tests' and benchmarks' text files come from, and its offline failure."""

import pytest
from conftest import data_files

NAMES = list(data_files.SOURCES)


@pytest.fixture
def layout(tmp_path, monkeypatch):
    """A shared dir (empty) and a cache root under tmp_path, no BAIGE_DATA."""
    shared = tmp_path / "shared" / "data"
    shared.mkdir(parents=True)
    monkeypatch.setattr(data_files, "SHARED", shared)
    monkeypatch.setenv("BAIGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("BAIGE_DATA", raising=False)
    return shared, tmp_path / "cache" / "data"


def _fill(directory, names=NAMES):
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text("text\n")


def test_resolution_order(layout, tmp_path, monkeypatch):
    shared, cache = layout
    assert data_files.data_dir() == cache  # nothing anywhere: the cache setup.sh fills
    _fill(shared, NAMES[:1])
    assert data_files.data_dir() == cache  # a shared dir missing a file does not count
    _fill(shared)
    assert data_files.data_dir() == shared
    mine = tmp_path / "mine"
    monkeypatch.setenv("BAIGE_DATA", str(mine))
    assert data_files.data_dir() == mine  # BAIGE_DATA wins, even before it holds the files
    assert data_files.missing(mine) == NAMES


def test_nothing_to_fetch_when_present(layout, monkeypatch):
    shared, _ = layout
    _fill(shared)
    monkeypatch.setattr(data_files, "_download_text", lambda *a: pytest.fail("downloaded"))
    assert data_files.main(["--check"]) == 0
    assert data_files.main([]) == 0


def test_offline_is_one_line(layout, monkeypatch, capsys):
    def offline(repo, files, sep):
        raise OSError("An error happened while trying to locate the file on the Hub. Please check your connection")

    monkeypatch.setattr(data_files, "_download_text", offline)
    assert data_files.main(["--check"]) == 1
    assert data_files.main([]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: could not download") and "BAIGE_DATA" in err[-1], err
    assert len([line for line in err if line.startswith("error")]) == 1
    assert not (layout[1] / NAMES[0]).exists()


def test_fetch_writes_the_joined_rows(layout, monkeypatch):
    _, cache = layout
    monkeypatch.setattr(data_files, "_download_text", lambda repo, files, sep: sep.join([repo, *files]))
    assert data_files.main([]) == 0
    repo, files, sep, _ = data_files.SOURCES["wikitext-2-raw-test.txt"]
    assert (cache / "wikitext-2-raw-test.txt").read_text() == sep.join([repo, *files])
    assert not list(cache.glob(".*.tmp"))


def test_baige_data_without_the_files_never_downloads(layout, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BAIGE_DATA", str(tmp_path / "nothing"))
    monkeypatch.setattr(data_files, "_download_text", lambda *a: pytest.fail("downloaded"))
    assert data_files.main([]) == 1
    assert "BAIGE_DATA=" in capsys.readouterr().err
