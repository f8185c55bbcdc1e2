"""The pipeline's ephemeral Prefect keeps working when the shared ~/.prefect database was migrated
by another (newer) Prefect: it switches to a database of its own Prefect version and says so;
explicit settings and healthy databases are left alone."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from rlcore.lifecycle import prefect_db


def _database(home: Path, revision: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(home / "prefect.db") as conn:
        conn.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        conn.execute("INSERT INTO alembic_version VALUES (?)", (revision,))


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for key in prefect_db._EXPLICIT:  # set, then removed: monkeypatch restores them (and drops ours) after
        monkeypatch.setenv(key, "x")
        monkeypatch.delenv(key)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "home"))
    return tmp_path


def test_known_revisions_are_read_from_the_installed_prefect():
    revisions = prefect_db.known_revisions()
    assert len(revisions) > 50 and all(len(r) == 12 for r in revisions)


def test_a_database_from_an_unknown_prefect_is_swapped_for_our_own(clean_env, monkeypatch, capsys):
    _database(clean_env / "home", "27d8f4e1a6c9")  # a Prefect 3.9 revision, unknown to the pinned one
    assert "27d8f4e1a6c9" not in prefect_db.known_revisions()
    own = prefect_db.use_own_database_if_foreign(cache_root=clean_env / "cache")
    assert own is not None and own.parent.is_dir() and own.parent.parent == clean_env / "cache"
    assert prefect_db.os.environ[prefect_db.DB_URL_VAR] == f"sqlite+aiosqlite:///{own}"
    assert "27d8f4e1a6c9" in capsys.readouterr().err


def test_a_database_of_this_prefect_is_kept(clean_env, monkeypatch):
    _database(clean_env / "home", sorted(prefect_db.known_revisions())[0])
    assert prefect_db.use_own_database_if_foreign(cache_root=clean_env / "cache") is None
    assert prefect_db.DB_URL_VAR not in prefect_db.os.environ


def test_no_database_yet_and_explicit_settings_are_left_alone(clean_env, monkeypatch):
    assert prefect_db.use_own_database_if_foreign(cache_root=clean_env / "cache") is None  # fresh home
    _database(clean_env / "home", "ffffffffffff")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")  # a real server: no ephemeral DB
    assert prefect_db.use_own_database_if_foreign(cache_root=clean_env / "cache") is None
    assert prefect_db.DB_URL_VAR not in prefect_db.os.environ
