"""The coordination store's tables, one family per module of this package, created at open. The layout's version
is recorded in the database (memory_service.sql: `PRAGMA user_version` on SQLite, `schema_meta` on PostgreSQL), so
that a release that changes the layout can tell which one it opens."""

from __future__ import annotations

from memory_service.sql import Database

SCHEMA_VERSION = 4
# The layout of version 1, then the tables added since (created on any database that lacks them).
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
    # coordination.audits (version 2)
    "CREATE TABLE IF NOT EXISTS kv_audits (profile_id TEXT NOT NULL, user_id TEXT NOT NULL, fact_id TEXT NOT NULL, "
    "version BIGINT NOT NULL, content_id TEXT NOT NULL, producer TEXT NOT NULL, lease_id TEXT, "
    "lease_expires DOUBLE PRECISION, attempts BIGINT NOT NULL DEFAULT 0, enqueued_at DOUBLE PRECISION NOT NULL, "
    "PRIMARY KEY (profile_id, user_id, fact_id))",
    "CREATE TABLE IF NOT EXISTS kv_exclusions (profile_id TEXT NOT NULL, user_id TEXT NOT NULL, "
    "fact_id TEXT NOT NULL, version BIGINT NOT NULL, worker_id TEXT NOT NULL, "
    "PRIMARY KEY (profile_id, user_id, fact_id, version, worker_id))",
    "CREATE TABLE IF NOT EXISTS kv_quarantine (profile_id TEXT NOT NULL, user_id TEXT NOT NULL, "
    "fact_id TEXT NOT NULL, version BIGINT NOT NULL, content_id TEXT NOT NULL, blob_sha256 TEXT NOT NULL, "
    "worker_id TEXT NOT NULL, reason TEXT NOT NULL, quarantined_at DOUBLE PRECISION NOT NULL, blob BYTEA NOT NULL, "
    "PRIMARY KEY (profile_id, user_id, fact_id, version, content_id, blob_sha256))",
    # coordination.kv_index (version 3)
    "CREATE TABLE IF NOT EXISTS kv_generations (user_digest TEXT PRIMARY KEY, generation BIGINT NOT NULL)",
    # coordination.work_queue (version 4): who holds each lease
    "CREATE TABLE IF NOT EXISTS kv_leases (lease_id TEXT PRIMARY KEY, holder TEXT NOT NULL, "
    "expires DOUBLE PRECISION NOT NULL)",
    "CREATE INDEX IF NOT EXISTS kv_leases_by_expiry ON kv_leases (expires)",
)
# Columns added to version-1 tables, by the version that added them.
UPGRADES = {
    2: ("ALTER TABLE kv_entries ADD COLUMN producer TEXT NOT NULL DEFAULT ''",),
}
# Every change of a row of kv_entries moves its user's KV generation (kv_index.KvIndex.serving_entries), keyed by the
# user id's sha256 (hex) as user_generations is: a trigger, so that no writer skips it.
_MOVE_GENERATION = ("INSERT INTO kv_generations (user_digest, generation) VALUES ({digest}, 1) "
                    "ON CONFLICT (user_digest) DO UPDATE SET generation = kv_generations.generation + 1")
TRIGGERS = {
    "sqlite": tuple(
        f"CREATE TRIGGER IF NOT EXISTS kv_entries_{event.lower()}_moves_generation AFTER {event} ON kv_entries "
        f"BEGIN {_MOVE_GENERATION.format(digest=f'inferscale_sha256({row}.user_id)')}; END"
        for event, row in (("INSERT", "NEW"), ("UPDATE", "NEW"), ("DELETE", "OLD"))),
    "postgresql": (
        "CREATE OR REPLACE FUNCTION kv_entries_move_generation() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        + _MOVE_GENERATION.format(
            digest="encode(sha256(convert_to(CASE WHEN TG_OP = 'DELETE' THEN OLD.user_id ELSE NEW.user_id END, "
                   "'UTF8')), 'hex')")
        + "; RETURN NULL; END $$",
        "CREATE OR REPLACE TRIGGER kv_entries_moves_generation AFTER INSERT OR UPDATE OR DELETE ON kv_entries "
        "FOR EACH ROW EXECUTE FUNCTION kv_entries_move_generation()",  # PostgreSQL 14 or later
    ),
}


def create_schema(database: Database) -> None:
    """Creates the tables that do not exist yet, adds the columns of every version after the recorded one, and
    records SCHEMA_VERSION; idempotent, and safe while other replicas start beside this one (`Database.migration`).
    A replica of an older release cannot write a database upgraded past it: stop those before starting this one."""
    with database.migration() as tx:
        recorded = database.schema_version(tx)
        if recorded > SCHEMA_VERSION:
            raise RuntimeError(f"the coordination database has schema version {recorded}, newer than this release's "
                               f"{SCHEMA_VERSION}: run the release that upgraded it")
        for statement in TABLES:
            tx.run(statement)
        for version, statements in sorted(UPGRADES.items()):
            if recorded < version:
                for statement in statements:
                    tx.run(statement)
        for statement in TRIGGERS[database.dialect]:
            tx.run(statement)
        database.set_schema_version(tx, SCHEMA_VERSION)
