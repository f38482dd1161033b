"""What the fact store was created with (table `store_meta`), e.g. its embedding model: recorded once, then checked
by every replica that opens the store."""

from __future__ import annotations

from memory_service.sql import Database


class StoreMeta:
    def __init__(self, database: Database) -> None:
        self._database = database

    def claim(self, name: str, value: str) -> str:
        """Records `value` under `name` unless one is recorded already; returns the recorded one."""
        with self._database.transaction() as tx:
            tx.run("INSERT INTO store_meta VALUES (?, ?) ON CONFLICT (name) DO NOTHING", (name, value))
            return tx.rows("SELECT value FROM store_meta WHERE name = ?", (name,))[0][0]
