"""The coordination store's tables, one family per module of this package, created at open. The layout's version
is recorded in the database (memory_service.sql: `PRAGMA user_version` on SQLite, `schema_meta` on PostgreSQL), so
that a release that changes the layout can tell which one it opens."""

from __future__ import annotations

from memory_service.sql import Database

SCHEMA_VERSION = 1
TABLES = (
    # coordination.profiles
    "CREATE TABLE IF NOT EXISTS profiles (profile_id TEXT PRIMARY KEY, spec TEXT NOT NULL, "
    "first_seen DOUBLE PRECISION NOT NULL, last_seen DOUBLE PRECISION NOT NULL)",
    # coordination.work_queue
    "CREATE TABLE IF NOT EXISTS jobs (profile_id TEXT NOT NULL, user_id TEXT NOT NULL, fact_id TEXT NOT NULL, "
    "version BIGINT NOT NULL, state TEXT NOT NULL, lease_id TEXT, lease_expires DOUBLE PRECISION, "
    "attempts BIGINT NOT NULL DEFAULT 0, enqueued_at DOUBLE PRECISION NOT NULL, last_error TEXT, "
    "PRIMARY KEY (profile_id, user_id, fact_id))",
    "CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (profile_id, state, user_id, enqueued_at)",
    # coordination.kv_index
    "CREATE TABLE IF NOT EXISTS kv_entries (profile_id TEXT NOT NULL, user_id TEXT NOT NULL, fact_id TEXT NOT NULL, "
    "version BIGINT NOT NULL, content_id TEXT NOT NULL, token_ids TEXT NOT NULL, nbytes BIGINT NOT NULL, "
    "stored_at DOUBLE PRECISION NOT NULL, PRIMARY KEY (profile_id, user_id, fact_id))",
    # coordination.users
    "CREATE TABLE IF NOT EXISTS user_generations (user_digest TEXT PRIMARY KEY, generation BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS version_floors (user_digest TEXT PRIMARY KEY, floor BIGINT NOT NULL)",
    # coordination.store_meta
    "CREATE TABLE IF NOT EXISTS store_meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)",
    # coordination.workers
    "CREATE TABLE IF NOT EXISTS workers (worker_id TEXT PRIMARY KEY, profile_id TEXT NOT NULL, "
    "last_seen DOUBLE PRECISION NOT NULL, facts_per_second DOUBLE PRECISION NOT NULL, device TEXT NOT NULL)",
)


def create_schema(database: Database) -> None:
    """Creates the tables that do not exist yet and records SCHEMA_VERSION; idempotent, and safe while other
    replicas start beside this one (`Database.migration`)."""
    with database.migration() as tx:
        for statement in TABLES:
            tx.run(statement)
        database.set_schema_version(tx, SCHEMA_VERSION)
