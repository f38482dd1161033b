"""The KV index's serving lookup (KvIndex.serving_entries, every RetrieveAndStage's): answered from the process's
copy while the user's and the header's KV generations hold, and never stale: each change of the entries, made
through this process or through another replica on the same PostgreSQL, is seen by the next lookup."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harness.servers import postgres_server
from inferscale_kv.kv_key import HEADER_FACT_ID, HEADER_OWNER, KvKey
from memory_service.coordination import Coordination
from memory_service.coordination.audits import QuarantinedBlob
from memory_service.coordination.kv_index import KvIndex
from memory_service.coordination.schema import SCHEMA_VERSION
from memory_service.sql import Database, PostgresDatabase, SqliteDatabase

PROFILE, USER, OTHER = "p", "ana", "bob"


def _key(user: str, fact: str, version: int = 1, content: str = "a" * 32) -> KvKey:
    return KvKey(PROFILE, user, fact, version, content)


def _header(content: str = "h" * 32) -> KvKey:
    return KvKey(PROFILE, HEADER_OWNER, HEADER_FACT_ID, 1, content)


def _served(index: KvIndex, user: str = USER, facts: tuple[str, ...] = ("f1", "f2")) -> tuple[dict, str | None]:
    """fact_id -> (version, content id) served, and the header's content id."""
    entries, header = index.serving_entries(PROFILE, user, list(facts))
    return ({fact: (entry.key.version, entry.key.content_id) for fact, entry in entries.items()},
            header.key.content_id if header else None)


def _every_change_is_seen(writer: KvIndex, reader: KvIndex, statements: Callable[[], int]) -> None:
    """Each change through `writer` is what the next lookup on `reader` answers; an unchanged user costs `reader`
    one statement."""
    writer.record_stored(_header(), [1, 2], 10, None, "w1")
    writer.record_stored(_key(USER, "f1"), [3], 10, None, "w1")
    writer.record_stored(_key(OTHER, "f1", content="b" * 32), [3], 10, None, "w1")
    assert _served(reader) == ({"f1": (1, "a" * 32)}, "h" * 32)
    before = statements()
    assert _served(reader) == ({"f1": (1, "a" * 32)}, "h" * 32)
    assert statements() - before == 1  # both generations, in one statement
    assert _served(reader, OTHER, ("f1",)) == ({"f1": (1, "b" * 32)}, "h" * 32)

    writer.record_stored(_key(USER, "f2"), [4], 10, None, "w1")  # a worker's completion
    assert _served(reader) == ({"f1": (1, "a" * 32), "f2": (1, "a" * 32)}, "h" * 32)
    writer.record_stored(_key(USER, "f1", 2, "c" * 32), [5], 10, None, "w2")  # a new version's KV
    assert _served(reader)[0]["f1"] == (2, "c" * 32)
    assert writer.quarantine(_key(USER, "f1", 2, "c" * 32), ["w2"], [QuarantinedBlob("w2", "audit", b"x")])
    assert _served(reader)[0] == {"f2": (1, "a" * 32)}
    writer.forget_facts(USER, ["f2"])  # the fact deleted
    assert _served(reader)[0] == {}
    writer.record_stored(_key(USER, "f1", 3), [6], 10, None, "w1")
    assert _served(reader)[0] == {"f1": (3, "a" * 32)}
    assert writer.forget_entry(_key(USER, "f1", 3))  # a blob found missing
    assert _served(reader)[0] == {}
    writer.record_stored(_key(USER, "f1", 4), [6], 10, None, "w1")
    writer.forget_facts(USER, None)  # the user deleted
    assert _served(reader)[0] == {}

    assert writer.quarantine(_header(), ["w1"], [QuarantinedBlob("w1", "dispute", b"x")])
    assert _served(reader, OTHER, ("f1",)) == ({"f1": (1, "b" * 32)}, None)
    writer.record_stored(_header("i" * 32), [1, 2], 10, None, "w3")
    assert _served(reader, OTHER, ("f1",))[1] == "i" * 32


def _written_by_hand(database: Database) -> Callable[[str, tuple], None]:
    """Statements on kv_entries that no KvIndex method made (an older replica's, an operator's)."""
    def run(sql: str, params: tuple) -> None:
        with database.transaction() as tx:
            tx.run(sql, params)
    return run


def _hand_writes_are_seen(write: Callable[[str, tuple], None], reader: KvIndex) -> None:
    assert _served(reader, OTHER, ("f1",))[0] == {"f1": (1, "b" * 32)}
    write("UPDATE kv_entries SET content_id = ? WHERE user_id = ?", ("d" * 32, OTHER))
    assert _served(reader, OTHER, ("f1",))[0] == {"f1": (1, "d" * 32)}
    write("DELETE FROM kv_entries WHERE user_id = ?", (OTHER,))
    assert _served(reader, OTHER, ("f1",))[0] == {}


def test_a_lookup_is_one_statement_until_a_change_which_the_next_lookup_sees(tmp_path) -> None:
    database = SqliteDatabase(tmp_path / "index.sqlite")
    coordination = Coordination.open(database)
    _every_change_is_seen(coordination.kv_index, coordination.kv_index, lambda: database.round_trips)
    _hand_writes_are_seen(_written_by_hand(database), coordination.kv_index)
    database.close()


def test_a_change_through_one_replica_is_seen_by_the_next_lookup_on_another(tmp_path) -> None:
    with postgres_server(tmp_path / "postgres") as url:
        writer, reader = (Coordination.open(PostgresDatabase(url)) for _ in range(2))
        _every_change_is_seen(writer.kv_index, reader.kv_index, lambda: reader.database.round_trips)
        _hand_writes_are_seen(_written_by_hand(writer.database), reader.kv_index)
        for coordination in (writer, reader):
            coordination.database.close()


def test_the_copy_keeps_at_most_its_capacity(tmp_path) -> None:
    database = SqliteDatabase(tmp_path / "index.sqlite")
    coordination = Coordination.open(database)
    # Each user: its entry (1) and its token (1); the header, absent: 1. Three users and the header do not fit 6.
    index = KvIndex(database, coordination.work_queue, coordination.audits, serving_copy_size=6)
    for user in ("u1", "u2", "u3"):
        index.record_stored(_key(user, "f1"), [1], 10, None, "w")
        _served(index, user, ("f1",))
    before = database.round_trips
    _served(index, "u3", ("f1",))
    assert database.round_trips - before == 1  # still held (u3: 1 fact; the header: 1)
    _served(index, "u1", ("f1",))
    assert database.round_trips - before == 1 + 2  # u1 went: looked up again
    database.close()


def test_a_database_of_a_newer_schema_is_refused(tmp_path) -> None:
    """A replica of this release never writes a database a later release upgraded (its writes could skip what the
    later release relies on)."""
    database = SqliteDatabase(tmp_path / "index.sqlite")
    Coordination.open(database)
    with database.transaction() as tx:
        database.set_schema_version(tx, SCHEMA_VERSION + 1)
    with pytest.raises(RuntimeError, match="newer than this release"):
        Coordination.open(database)
    database.close()
