"""Announced KV profiles (table `profiles`): every profile some worker or node serves, with its fields."""

from __future__ import annotations

import json
import time

from memory_service.sql import Database


class ProfileRegistry:
    def __init__(self, database: Database) -> None:
        self._database = database

    def add(self, profile_id: str, spec: dict) -> bool:
        """Records a profile (or that it was seen again); True when it is new."""
        now = time.time()
        with self._database.transaction() as tx:
            added = tx.run("INSERT INTO profiles VALUES (?, ?, ?, ?) ON CONFLICT (profile_id) DO NOTHING",
                           (profile_id, json.dumps(spec), now, now))
            if not added:
                tx.run("UPDATE profiles SET last_seen = ? WHERE profile_id = ?", (now, profile_id))
        return added == 1

    def all(self) -> dict[str, dict]:
        """profile_id -> the profile's fields, for every announced profile."""
        return {profile_id: json.loads(spec)
                for profile_id, spec in self._database.query("SELECT profile_id, spec FROM profiles")}
