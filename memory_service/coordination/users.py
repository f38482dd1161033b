"""What the coordination store keeps of each user beyond its facts (tables `user_generations`, `version_floors`,
and the database's per-user lock): the records behind the per-user write protocol (memory_service.user_writes, which
says how they are used). Rows are keyed by a digest of the user id, so a deleted user's id leaves nothing."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager

from memory_service.sql import Database, sha256_hex

_GENERATIONS_PER_QUERY = 500


def user_digest(user_id: str) -> str:
    """The key of a user's rows here and in kv_generations (whose trigger computes the same in SQL)."""
    return sha256_hex(user_id)


class UserRecords:
    def __init__(self, database: Database) -> None:
        self._database = database

    @property
    def lock_slots(self) -> int:
        """User locks that may be held at once (each holds a database connection)."""
        return self._database.lock_slots

    def lock(self, user_id: str) -> AbstractContextManager[None]:
        """Held while the user's facts are written: no other process writes that user meanwhile (blocking)."""
        return self._database.user_lock(user_id)

    # A user's write generation is a sequence lock: odd while a write of the user is under way (or was cut off), even
    # otherwise.

    def write_generation(self, user_id: str) -> int:
        rows = self._database.query("SELECT generation FROM user_generations WHERE user_digest = ?",
                                    (user_digest(user_id),))
        return rows[0][0] if rows else 0

    def write_generations(self, user_ids: Sequence[str]) -> dict[str, int]:
        """write_generation of each user, in one query per 500 users."""
        digests = {user_digest(user): user for user in user_ids}
        generations = dict.fromkeys(user_ids, 0)
        keys = list(digests)
        for begin in range(0, len(keys), _GENERATIONS_PER_QUERY):
            batch = keys[begin : begin + _GENERATIONS_PER_QUERY]
            for digest, generation in self._database.query(
                    f"SELECT user_digest, generation FROM user_generations WHERE "
                    f"user_digest IN ({','.join('?' * len(batch))})", batch):
                generations[digests[digest]] = generation
        return generations

    def _advance_generation(self, user_id: str, step: int) -> int:
        with self._database.transaction() as tx:
            return tx.rows("INSERT INTO user_generations VALUES (?, ?) ON CONFLICT (user_digest) DO UPDATE SET "
                           "generation = user_generations.generation + ? RETURNING generation",
                           (user_digest(user_id), step, step))[0][0]

    def begin_write(self, user_id: str, generation: int) -> int:
        """Makes the generation odd (a write under way); `generation`: the user's write generation, read by the
        caller under the user's lock. Returns the new generation."""
        return self._advance_generation(user_id, 1 if generation % 2 == 0 else 2)

    def end_write(self, user_id: str) -> int:
        """Makes the generation even again once the write committed (or failed). Returns the new generation."""
        return self._advance_generation(user_id, 1)

    def invalidate(self, user_id: str) -> int:
        """Moves the generation by a whole write (parity kept), without a write of facts: every replica looks at
        the user again (e.g. its KV was forgotten). Returns the new generation."""
        return self._advance_generation(user_id, 2)

    def version_floor(self, user_id: str) -> int:
        """The highest fact version the user ever had deleted (0: none)."""
        rows = self._database.query("SELECT floor FROM version_floors WHERE user_digest = ?", (user_digest(user_id),))
        return rows[0][0] if rows else 0

    def raise_version_floor(self, user_id: str, version: int) -> None:
        """Raises the user's version floor to `version` (never lowers it)."""
        with self._database.transaction() as tx:
            tx.run("INSERT INTO version_floors VALUES (?, ?) ON CONFLICT (user_digest) DO UPDATE SET "
                   "floor = CASE WHEN version_floors.floor > excluded.floor THEN version_floors.floor "
                   "ELSE excluded.floor END", (user_digest(user_id), version))
