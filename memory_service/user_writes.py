"""The per-user write protocol: how a user's facts are written so that every reader, on this replica or on another
sharing the store, sees exactly the acknowledged writes, and how a copy of a user's facts kept in memory (the search
cache) stays coherent with them.

The parties: the fact store (LanceDB, the source of truth), each replica's search cache (UserFactsCache: a user's
facts and embeddings, so that a search is a matrix-vector product), and the user's records in the coordination store
(memory_service.coordination.users: the user lock, the write generation and the version floor; shared by every
replica on PostgreSQL). On a store of its own (one replica) only this process writes, and the cross-replica steps
below are skipped.

What a writer does (`UserWrites.write`, a context manager around the write):
1. takes the user's lock: a striped asyncio lock in this process, then (shared store) the user's lock in the
   coordination database, waiting for one of a bounded number of lock slots on the event loop, not on a thread;
2. for a write of facts on a shared store: makes the user's write generation odd (`begin_write`). The generation is
   a sequence lock: while it is odd no replica takes its copy of the user as current, and every copy read before
   stops being current, since the generation it was read at is gone;
3. decides versions: a new fact's first version is one above the user's version floor (`first_version`); a delete
   raises the floor to the highest version it deletes, before the facts go (`retire_versions`), so no version of a
   fact id is ever handed out twice, also across deletes and re-adds;
4. commits to the fact store, then, before acknowledging, applies the write to this replica's copy (`committed`:
   merged in, labelled with the generation the write ends at) or drops the copy (`dropped`);
5. makes the generation even again (`end_write`) and releases the locks.
Writes of turns (`changes_facts=False`) take the locks only: turns are not cached.

What a reader may assume (`UserWrites.read`, and `current_copy` for a writer under the lock): a copy is served only
while it holds exactly the user's committed facts: on a shared store, while the user's generation is even and equal
to the one the copy was read at (or that the write merged into it ended at); in any case, a read of the fact store
that started before a write to the user in this process is never installed after that write. Concurrent readers of
an uncached user share one read of the fact store, unless a write came after it started.

A write cut off midway (an exception, a cancellation): this replica's copy of the user is dropped, since the write may
have committed in part; on a shared store the generation ends even again (`end_write` runs in a finally). A process
that dies mid-write leaves the generation odd: no replica caches the user, every read goes to the fact store
(which holds whatever committed), until the user's next write moves the generation by two and ends it even. The
database releases a dead process's user lock with its connection.

Memory tiers of KV follow the same generations: forgetting a user's KV moves it (`UserRecords.invalidate`), and each
replica's tier sweep (memory_service.kv_store) looks again at the users whose generation moved.
"""

from __future__ import annotations

import asyncio
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np

from memory_service.blocking import run_blocking
from memory_service.coordination.users import UserRecords
from memory_service.steps import step_done
from memory_service.user_facts import FactRow, UserFacts

_USER_LOCK_STRIPES = 64
_LOCAL_WRITE_STRIPES = 4096  # write counters per stripe of users: bounded memory, rare needless misses

UserFactsRead = Callable[[str, int], Awaitable[UserFacts]]
"""Reads a user's facts from the fact store, labelled with the given store generation."""


@dataclass(frozen=True)
class WriteTicket:
    """A write of a user's facts: the user's write generation before the write, and the one the write ends at (both
    0 on a store of its own)."""

    before: int
    after: int


class UserFactsCache:
    """The search cache: an LRU of UserFacts bounded by bytes. A user larger than the budget is marked until the next
    write to it and searched in the fact store meanwhile (`may_hold` is False), so its facts are not read whole for
    every query.

    Writers call `upsert(user, ...)` or `invalidate(user)` after committing and before acknowledging; readers take
    `generation(user)` (this process's count of writes to the user's stripe) before reading the fact store and pass
    it to `put`, which drops the entry if a write came in between.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[str, UserFacts] = OrderedDict()
        self._generations = [0] * _LOCAL_WRITE_STRIPES
        self._oversize: set[str] = set()
        self._bytes = 0

    def get(self, user_id: str) -> UserFacts | None:
        entry = self._entries.get(user_id)
        if entry is not None:
            self._entries.move_to_end(user_id)
        return entry

    def may_hold(self, user_id: str) -> bool:
        return self.budget_bytes > 0 and user_id not in self._oversize

    def generation(self, user_id: str) -> int:
        return self._generations[self._stripe(user_id)]

    def put(self, user_id: str, entry: UserFacts, generation: int) -> bool:
        """Installs `entry` if no write to the user came since `generation` was taken and it fits the budget."""
        if generation != self.generation(user_id):
            return False
        if entry.nbytes > self.budget_bytes:
            self._oversize.add(user_id)
            return False
        self._drop(user_id)
        self._entries[user_id] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def upsert(self, user_id: str, rows: list[FactRow], vectors: np.ndarray, store_generation_before: int = 0,
               store_generation_after: int = 0) -> None:
        """Applies a committed write of `rows` (new facts, or replacing those with their fact_ids) to the user's
        entry, if cached, so that a write does not cost the next query a reload; like `invalidate`, drops reads in
        flight. On a shared store the merged entry reflects the write's generation (`..._after`) only if the entry
        reflected the one before it; otherwise it is left unlabelled (reloaded before use)."""
        entry = self._entries.get(user_id)
        self.invalidate(user_id)
        if entry is None:
            return
        current = store_generation_after if entry.store_generation == store_generation_before else -1
        self.put(user_id, entry.merged(rows, vectors, current), self.generation(user_id))

    def invalidate(self, user_id: str) -> None:
        self._generations[self._stripe(user_id)] += 1
        self._oversize.discard(user_id)
        self._drop(user_id)

    @staticmethod
    def _stripe(user_id: str) -> int:
        return zlib.crc32(user_id.encode()) % _LOCAL_WRITE_STRIPES

    def _drop(self, user_id: str) -> None:
        entry = self._entries.pop(user_id, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    @property
    def bytes_used(self) -> int:
        return self._bytes


class UserWrites:
    """The protocol above, for one process. `shared`: other replicas write the same fact store and coordination
    database. `close` once no write is under way."""

    def __init__(self, user_records: UserRecords, shared: bool, search_cache_bytes: int) -> None:
        self.shared = shared
        self.search_cache = UserFactsCache(search_cache_bytes)
        self._user_records = user_records
        self._locks = [asyncio.Lock() for _ in range(_USER_LOCK_STRIPES)]
        # A user's write holds a coordination connection for its lock and needs another for its statements: writes
        # wait for a slot here, on the event loop, and take and release the lock on threads of their own, so waiting
        # writers never occupy the threads that running writes need.
        self._lock_slots = asyncio.Semaphore(user_records.lock_slots)
        self._lock_executor = ThreadPoolExecutor(max_workers=user_records.lock_slots, thread_name_prefix="user-lock")
        self._reads: dict[str, tuple[tuple[int, int], asyncio.Task[UserFacts]]] = {}

    # ------------------------------------------------------------------ writers

    @asynccontextmanager
    async def write(self, user_id: str, changes_facts: bool = True) -> AsyncIterator[WriteTicket]:
        """Steps 1, 2 and 5 around the caller's write (steps 3 and 4); a write that fails drops the user's copy."""
        async with self._locks[zlib.crc32(user_id.encode()) % _USER_LOCK_STRIPES]:
            if not self.shared:
                step_done("lock")
                try:
                    yield WriteTicket(0, 0)
                except BaseException:
                    self.search_cache.invalidate(user_id)
                    raise
                finally:
                    step_done("write")
                return
            async with self._lock_slots:  # waiters wait here, on the event loop, not on a thread
                lock = self._user_records.lock(user_id)
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._lock_executor, lock.__enter__)
                step_done("lock")
                try:
                    ticket = WriteTicket(0, 0)
                    if changes_facts:
                        before = await run_blocking(self._user_records.write_generation, user_id)
                        during = await run_blocking(self._user_records.begin_write, user_id, before)
                        ticket = WriteTicket(before, during + 1)
                        step_done("begin_write")
                    try:
                        yield ticket
                    except BaseException:
                        self.search_cache.invalidate(user_id)
                        raise
                    finally:
                        step_done("write")
                        if changes_facts:
                            await run_blocking(self._user_records.end_write, user_id)
                            step_done("end_write")
                finally:
                    await loop.run_in_executor(self._lock_executor, lock.__exit__, None, None, None)
                    step_done("unlock")

    def current_copy(self, user_id: str, ticket: WriteTicket) -> UserFacts | None:
        """For a writer holding the user's lock: the cached copy, if it holds exactly the user's committed facts."""
        return self._current(user_id, ticket.before)

    async def first_version(self, user_id: str) -> int:
        """The version of a fact id the user does not have (step 3)."""
        return await run_blocking(self._user_records.version_floor, user_id) + 1

    async def retire_versions(self, user_id: str, up_to: int) -> None:
        """Before facts of the user are deleted: their versions up to `up_to` are never handed out again (step 3)."""
        await run_blocking(self._user_records.raise_version_floor, user_id, up_to)

    def committed(self, user_id: str, rows: list[FactRow], vectors: np.ndarray, ticket: WriteTicket) -> None:
        """After `rows` (with their `vectors`) committed: merged into the user's copy, if cached (step 4)."""
        self.search_cache.upsert(user_id, rows, vectors, ticket.before, ticket.after)

    def dropped(self, user_id: str) -> None:
        """After facts of the user were deleted: the user's copy goes (step 4)."""
        self.search_cache.invalidate(user_id)

    # ------------------------------------------------------------------ readers

    async def read(self, user_id: str, read_store: UserFactsRead) -> UserFacts | None:
        """The user's facts: the cached copy when current, else read with `read_store` into the cache (one read per
        user at a time, a cancelled caller leaving it to the others); None when the user is too large for the cache
        (the caller searches the fact store)."""
        store_generation = await run_blocking(self._user_records.write_generation, user_id) if self.shared else 0
        cached = self._current(user_id, store_generation)
        if cached is None and self.search_cache.may_hold(user_id):
            cached = await asyncio.shield(self._shared_read(user_id, store_generation, read_store))
        return cached

    def _current(self, user_id: str, store_generation: int) -> UserFacts | None:
        """The user's cached copy if it reflects `store_generation`, the user's latest (shared stores: it must be
        even, no write under way, and the one the copy was read at)."""
        cached = self.search_cache.get(user_id)
        if cached is None or not self.shared:
            return cached
        if store_generation % 2 or cached.store_generation != store_generation:
            self.search_cache.invalidate(user_id)
            return None
        return cached

    def _shared_read(self, user_id: str, store_generation: int, read_store: UserFactsRead) -> asyncio.Task[UserFacts]:
        """The read of the user's facts into the cache: one per user at a time. A search joins a read in flight only
        if no write to the user came since it started, here or (shared store) on any replica (a later write needs a
        read that sees it), so a cold user under many concurrent queries costs one read, not one per query."""
        generation = (self.search_cache.generation(user_id), store_generation)
        in_flight = self._reads.get(user_id)
        if in_flight is not None and in_flight[0] == generation:
            return in_flight[1]
        read = asyncio.get_running_loop().create_task(self._read_into_cache(user_id, *generation, read_store))
        self._reads[user_id] = (generation, read)

        def finished(task: asyncio.Task[UserFacts]) -> None:
            if self._reads.get(user_id, (generation, None))[1] is task:
                del self._reads[user_id]
            if not task.cancelled():
                task.exception()  # retrieved here: every waiter may have been cancelled

        read.add_done_callback(finished)
        return read

    async def _read_into_cache(self, user_id: str, generation: int, store_generation: int,
                               read_store: UserFactsRead) -> UserFacts:
        # Read while a write is under way (odd), the copy's generation is unknown: it is reloaded before use.
        facts = await read_store(user_id, -1 if store_generation % 2 else store_generation)
        self.search_cache.put(user_id, facts, generation)
        return facts

    def close(self) -> None:
        self._lock_executor.shutdown(wait=False, cancel_futures=True)
