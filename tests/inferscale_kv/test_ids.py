"""One id rule: what the node admits as `memory.user_id` is exactly what the memory service accepts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from inferscale_kv.ids import MAX_ID_CHARS, is_valid_id
from memory_service.errors import InvalidArgument
from memory_service.validation import validate_id

ids = st.text(alphabet=st.sampled_from("aZ09._:@+/=-;'\" \n\u00e9\u2060"), max_size=MAX_ID_CHARS + 2) | st.text()


@settings(max_examples=2000, deadline=None, derandomize=True, database=None)
@given(value=ids)
def test_the_node_and_the_memory_service_accept_the_same_ids(value):
    try:
        validate_id(value, "user_id")
        accepted = True
    except InvalidArgument:
        accepted = False
    assert is_valid_id(value) == accepted


def test_the_rule_admits_tenant_ids_and_refuses_quotes_dots_first_and_separators():
    assert is_valid_id("acme/maya") and is_valid_id("u-1.2:3@x+y=z") and is_valid_id("a" * MAX_ID_CHARS)
    for bad in ("", "a" * (MAX_ID_CHARS + 1), "..", "../x", "a;b", "a'b", 'a"b', "a b", "_profile", "maya\n"):
        assert not is_valid_id(bad), bad
