"""The node's fact-KV cache and the scheduler's residency hint of it."""

from __future__ import annotations

from inference_node.node_cache import ResidencyHint
from memory_service.kv_tiers import KvKey


def _key(fact: int) -> KvKey:
    return KvKey("kvp-p", "u", f"f{fact}", 1)


def test_residency_hint_forgets_the_least_recently_loaded_chunks_beyond_its_budget() -> None:
    hint = ResidencyHint(budget_bytes=300, bytes_per_token=10)  # 30 tokens
    for fact in range(3):
        hint.record(_key(fact), 10)
    hint.record(_key(0), 10)  # used again: now the most recent
    hint.record(_key(3), 10)
    assert _key(1) not in hint
    assert all(_key(fact) in hint for fact in (0, 2, 3))
