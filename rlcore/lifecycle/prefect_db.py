"""Keep Prefect's ephemeral server startable when its default database belongs to another Prefect.

Prefect's ephemeral mode (no server configured) starts a local server on the SQLite database in
PREFECT_HOME (~/.prefect/prefect.db), which is shared by every Prefect on the machine. Once a newer
Prefect has migrated it, this one's server refuses to start ("Can't locate revision ...") and the
pipeline cannot run. Then the pipeline uses a database of its own Prefect version under
~/.cache/rlcore/prefect/ instead, and says so. Explicit settings (a server URL, a database URL)
are always left alone. Runs before Prefect is imported: its settings are read at import.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import sqlite3
import sys
from pathlib import Path

DB_URL_VAR = "PREFECT_SERVER_DATABASE_CONNECTION_URL"
_EXPLICIT = ("PREFECT_API_URL", DB_URL_VAR, "PREFECT_API_DATABASE_CONNECTION_URL")


def known_revisions() -> set[str]:
    """Alembic revisions of the installed Prefect's SQLite migrations (read from its files)."""
    spec = importlib.util.find_spec("prefect")
    if spec is None or not spec.submodule_search_locations:
        return set()
    folder = Path(spec.submodule_search_locations[0]) / "server" / "database" / "_migrations" / "versions" / "sqlite"
    pattern = re.compile(r'^revision = "([0-9a-f]+)"', re.MULTILINE)
    return {m for f in folder.glob("*.py") for m in pattern.findall(f.read_text(errors="replace"))}


def database_revision(path: Path) -> str | None:
    """The alembic revision a Prefect SQLite database was migrated to; None if there is none."""
    if not path.is_file():
        return None
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as conn:
            row = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        return None
    return row[0] if row else None


def use_own_database_if_foreign(cache_root: Path | None = None) -> Path | None:
    """Point the ephemeral server at rlcore's own database when the default one was migrated by a
    Prefect this one does not know. Returns the database now used, or None when nothing changed."""
    if any(os.environ.get(k) for k in _EXPLICIT):
        return None
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser()
    revision = database_revision(home / "prefect.db")
    known = known_revisions()
    if revision is None or not known or revision in known:
        return None
    version = importlib.metadata.version("prefect")
    root = cache_root or Path.home() / ".cache" / "rlcore" / "prefect"
    own = root / version / "prefect.db"
    own.parent.mkdir(parents=True, exist_ok=True)
    os.environ[DB_URL_VAR] = f"sqlite+aiosqlite:///{own}"
    print(f"rlcore: {home / 'prefect.db'} was migrated by another Prefect (revision {revision}, unknown to "
          f"Prefect {version}); this run's ephemeral Prefect uses {own} (set {DB_URL_VAR} to choose)",
          file=sys.stderr)
    return own
