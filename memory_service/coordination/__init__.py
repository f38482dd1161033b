"""The coordination store: what every service replica must agree on, in one SQL database (memory_service.sql:
SQLite by default, PostgreSQL when replicas share it), one module per table family:

- schema: the tables and the layout's recorded version;
- profiles: announced KV profiles;
- work_queue: the KV work queue with leases;
- kv_index: which KV is stored (its full key, content id included, and token ids);
- users: each user's write generation and version floor, and the per-user lock;
- store_meta: the fact store's embedding model;
- workers: the precompute workers' last reports.

Every call is one transaction, committed before it returns; check-and-record steps (lease completion, delete
cascades) are single transactions. Thread-safe, blocking: the service calls it through memory_service.blocking.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory_service.coordination.kv_index import KvIndex
from memory_service.coordination.profiles import ProfileRegistry
from memory_service.coordination.schema import create_schema
from memory_service.coordination.store_meta import StoreMeta
from memory_service.coordination.users import UserRecords
from memory_service.coordination.work_queue import KvWorkQueue
from memory_service.coordination.workers import WorkerRegistry
from memory_service.sql import Database


@dataclass(frozen=True)
class Coordination:
    """The table families of one coordination database. The database is the caller's to close."""

    database: Database
    profile_registry: ProfileRegistry
    work_queue: KvWorkQueue
    kv_index: KvIndex
    user_records: UserRecords
    store_meta: StoreMeta
    worker_registry: WorkerRegistry

    @classmethod
    def open(cls, database: Database, max_attempts: int = 3) -> Coordination:
        """Creates the tables that are missing; `max_attempts`: leases of one job before it is marked failed."""
        create_schema(database)
        work_queue = KvWorkQueue(database, max_attempts)
        return cls(database, ProfileRegistry(database), work_queue, KvIndex(database, work_queue),
                   UserRecords(database), StoreMeta(database), WorkerRegistry(database))

    @property
    def shared(self) -> bool:
        """Other service replicas write this database too."""
        return self.database.shared
