"""The coordination store on a real PostgreSQL (started on loopback): statements that run concurrently from many
replicas must not deadlock each other."""

from __future__ import annotations

import threading

from harness.servers import postgres_server
from memory_service.coordination import Coordination
from memory_service.sql import PostgresDatabase


def test_concurrent_enqueues_of_the_same_facts_in_opposite_orders_do_not_deadlock(tmp_path) -> None:
    """Replicas answering one user's queries enqueue the facts without KV in each query's rank order; two such
    orders used to take row locks in opposite orders (PostgreSQL: "deadlock detected", an INTERNAL to the node)."""
    with postgres_server(tmp_path / "postgres") as url:
        replicas = [Coordination.open(PostgresDatabase(url)) for _ in range(2)]
        facts = [("u", f"f{index:03d}", 1) for index in range(60)]
        errors: list[BaseException] = []

        def enqueue_repeatedly(coordination: Coordination, order: list[tuple[str, str, int]]) -> None:
            try:
                for _ in range(40):
                    coordination.work_queue.enqueue(["p"], order)
            except BaseException as error:  # reported by the assertion below
                errors.append(error)

        threads = [threading.Thread(target=enqueue_repeatedly, args=(replicas[0], facts)),
                   threading.Thread(target=enqueue_repeatedly, args=(replicas[1], facts[::-1]))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for coordination in replicas:
            coordination.database.close()
        assert errors == []


def test_a_late_enqueue_of_an_older_version_never_replaces_the_newer_job(tmp_path) -> None:
    """A replica that retrieved a fact before it changed may enqueue the old version after another replica enqueued
    the new one; the job must stay on the new version (else the new version's KV is never computed)."""
    with postgres_server(tmp_path / "postgres") as url:
        coordination = Coordination.open(PostgresDatabase(url))
        coordination.profile_registry.add("p", {})
        coordination.work_queue.enqueue(["p"], [("u", "f", 2)])
        coordination.work_queue.enqueue(["p"], [("u", "f", 1)])
        _, _, jobs = coordination.work_queue.lease("p", max_facts=10, lease_seconds=60)
        coordination.database.close()
    assert [(job.fact_id, job.version) for job in jobs] == [("f", 2)]
