"""The shared limits hold together: a node's cap on the facts of one request stays below what one search may ask
the memory service for, so that a service at its defaults never refuses a node at its defaults."""

from inference_node.memory_request import MAX_MEMORY_TOKENS
from inferscale_kv.limits import MAX_MEMORY_TOP_K, MAX_QUERY_CHARS, MAX_SEARCH_TOP_K
from memory_service.config import Limits


def test_a_node_at_its_defaults_never_asks_more_than_a_service_at_its_defaults_takes() -> None:
    assert MAX_MEMORY_TOP_K < MAX_SEARCH_TOP_K == Limits().max_top_k
    assert Limits().max_query_chars == MAX_QUERY_CHARS
    assert MAX_MEMORY_TOKENS > 0
