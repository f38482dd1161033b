"""One SQL dialect, two engines: SQLite (the embedded default, one service process) and PostgreSQL (shared by every
replica). Callers write each statement once, with `?` placeholders and SQL both engines accept (ON CONFLICT upserts,
RETURNING, BIGINT and DOUBLE PRECISION columns); the engine adapts placeholders and supplies what differs: how rows
are claimed by concurrent writers (`claim_clause`), the cross-process per-user lock, and where the schema version
lives. Thread-safe; every `transaction()` commits before it returns, or rolls back on an exception.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

POSTGRES_SCHEMES = ("postgresql://", "postgres://")
_MIGRATION_LOCK = 0x1F5CA1E  # the advisory lock replicas hold while they create or upgrade the schema


class Transaction:
    """Statements inside one database transaction."""

    def __init__(self, cursor: Any, adapt: Callable[[str], str]) -> None:
        self._cursor = cursor
        self._adapt = adapt

    def run(self, sql: str, params: Sequence = ()) -> int:
        """Executes a statement; returns the rows it changed."""
        self._cursor.execute(self._adapt(sql), tuple(params))
        return self._cursor.rowcount

    def rows(self, sql: str, params: Sequence = ()) -> list[tuple]:
        self._cursor.execute(self._adapt(sql), tuple(params))
        return [tuple(row) for row in self._cursor.fetchall()]


class Database(ABC):
    """A SQL engine behind the coordination store."""

    # Other processes (service replicas) write the same database.
    shared: bool = False
    # Which engine: the schema's engine-specific statements (triggers) are chosen by it.
    dialect: str = ""
    # Appended to a SELECT whose rows the transaction is about to claim, so that concurrent transactions skip them.
    claim_clause: str = ""
    # User locks (`user_lock`) that may be held at once.
    lock_slots: int = 1

    def __init__(self) -> None:
        self.round_trips = 0  # statements sent (for the per-call cost figures)

    @abstractmethod
    def transaction(self) -> AbstractContextManager[Transaction]:
        """One transaction: committed when the block ends, rolled back when it raises."""

    def query(self, sql: str, params: Sequence = ()) -> list[tuple]:
        with self.transaction() as tx:
            return tx.rows(sql, params)

    @abstractmethod
    def user_lock(self, name: str) -> AbstractContextManager[None]:
        """Held while one user's facts are written: no other process writes that user meanwhile."""

    @abstractmethod
    def migration(self) -> AbstractContextManager[Transaction]:
        """A transaction that no other process's migration runs beside (replicas starting together)."""

    @abstractmethod
    def schema_version(self, tx: Transaction) -> int: ...

    @abstractmethod
    def set_schema_version(self, tx: Transaction, version: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class SqliteDatabase(Database):
    """One file, one process (the service holds it alone): writers are serialized by BEGIN IMMEDIATE. Statements may
    call inferscale_sha256(text), the text's sha256 in hex (PostgreSQL's encode(sha256(...), 'hex'))."""

    dialect = "sqlite"

    def __init__(self, path: Path) -> None:
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.create_function("inferscale_sha256", 1, sha256_hex, deterministic=True)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._lock = threading.RLock()

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield Transaction(_CountingCursor(self._db.cursor(), self), lambda sql: sql)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def user_lock(self, name: str) -> Iterator[None]:
        yield  # one process: the service's own per-user locks serialize its writes

    def migration(self) -> AbstractContextManager[Transaction]:
        return self.transaction()  # BEGIN IMMEDIATE: one writer at a time

    def schema_version(self, tx: Transaction) -> int:
        return tx.rows("PRAGMA user_version")[0][0]

    def set_schema_version(self, tx: Transaction, version: int) -> None:
        tx.run(f"PRAGMA user_version = {int(version)}")

    def close(self) -> None:
        with self._lock:
            self._db.close()


class PostgresDatabase(Database):
    """A PostgreSQL server shared by every replica: a connection pool, row claims with FOR UPDATE SKIP LOCKED and
    per-user advisory locks."""

    shared = True
    dialect = "postgresql"
    claim_clause = " FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str, max_connections: int = 16) -> None:
        super().__init__()
        from psycopg_pool import ConnectionPool

        self._pool = ConnectionPool(url, min_size=1, max_size=max_connections, open=True,
                                    kwargs={"autocommit": False}, name="inferscale-coordination")
        # A user lock holds a connection for the whole write, and the write needs another for its statements: at
        # most half the pool holds locks, so writes of many users at once cannot take every connection and wait.
        self.lock_slots = max(1, max_connections // 2)
        self._lock_slots = threading.BoundedSemaphore(self.lock_slots)
        self._pool.wait(timeout=30)

    @staticmethod
    def _adapt(sql: str) -> str:
        return sql.replace("?", "%s")

    @contextmanager
    def transaction(self) -> Iterator[Transaction]:
        with self._pool.connection() as connection, connection.transaction(), connection.cursor() as cursor:
            yield Transaction(_CountingCursor(cursor, self), self._adapt)

    @contextmanager
    def user_lock(self, name: str) -> Iterator[None]:
        key = zlib.crc32(name.encode())  # advisory lock ids are 64-bit integers
        with self._lock_slots, self._pool.connection() as connection:
            connection.autocommit = True
            try:
                self.round_trips += 1
                connection.execute("SELECT pg_advisory_lock(%s)", (key,))
                try:
                    yield
                finally:
                    self.round_trips += 1
                    connection.execute("SELECT pg_advisory_unlock(%s)", (key,))
            finally:
                connection.autocommit = False

    @contextmanager
    def migration(self) -> Iterator[Transaction]:
        with self.transaction() as tx:
            tx.rows("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            tx.run("CREATE TABLE IF NOT EXISTS schema_meta (name TEXT PRIMARY KEY, value BIGINT NOT NULL)")
            yield tx

    def schema_version(self, tx: Transaction) -> int:
        rows = tx.rows("SELECT value FROM schema_meta WHERE name = 'version'")
        return rows[0][0] if rows else 0

    def set_schema_version(self, tx: Transaction, version: int) -> None:
        tx.run("INSERT INTO schema_meta VALUES ('version', ?) ON CONFLICT (name) DO UPDATE SET value = ?",
               (version, version))

    def close(self) -> None:
        self._pool.close()


def sha256_hex(text: str) -> str:
    """The text's sha256 in hex: what SQLite's inferscale_sha256 and PostgreSQL's encode(sha256(...), 'hex') give."""
    return hashlib.sha256(text.encode()).hexdigest()


class _CountingCursor:
    """A DB-API cursor that counts the statements it sends."""

    def __init__(self, cursor: Any, database: Database) -> None:
        self._cursor = cursor
        self._database = database

    def execute(self, sql: str, params: Sequence) -> None:
        self._database.round_trips += 1
        self._cursor.execute(sql, params)

    def fetchall(self) -> list:
        return self._cursor.fetchall()

    @property
    def rowcount(self) -> int:
        return self._cursor.rowcount


def open_database(url: str, default_path: Path) -> Database:
    """PostgreSQL for a postgresql:// URL, else SQLite at `default_path` (an empty URL) or at a sqlite:/// path."""
    if url.startswith(POSTGRES_SCHEMES):
        return PostgresDatabase(url)
    if url.startswith("sqlite:///"):
        return SqliteDatabase(Path(url.removeprefix("sqlite:///")))
    if url:
        raise ValueError(f"coordination URL {url!r}: expected postgresql://... or sqlite:///PATH")
    return SqliteDatabase(default_path)
