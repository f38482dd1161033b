"""Fuzzing the OpenAI request's `memory` field (hypothesis): any JSON value is either a valid memory request
or a MemoryRequestError naming the field (HTTP 400), never another exception (HTTP 500)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from inference_node.memory_prompt import FACT_ORDERS
from inference_node.memory_request import MEMORY_FIELDS, MODES, RETRIEVAL_MODES, MemoryRequestError, parse_memory
from inference_node.settings import NodeSettings
from inferscale_kv.ids import is_valid_id

SETTINGS = NodeSettings(memory_service="127.0.0.1:1", node_id="n", model_dir="/nonexistent", profile={})
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12)
memory_fields = json_values | st.fixed_dictionaries(
    {}, optional={"user_id": json_values | st.text(max_size=300), "top_k": json_values | st.integers(),
                  "mode": json_values | st.sampled_from([*MODES, "KV", ""]),
                  "order": json_values | st.sampled_from([*FACT_ORDERS, "Ranked"]),
                  "recompute_tail_facts": json_values | st.integers(),
                  "kv_crossover_tokens": json_values | st.integers(),
                  "retrieval": json_values | st.sampled_from([*RETRIEVAL_MODES, "Hybrid", ""]),
                  "max_tokens": json_values | st.integers()})


@settings(max_examples=500, deadline=None, derandomize=True, database=None)
@given(memory=memory_fields)
def test_any_memory_value_parses_or_is_a_400_naming_the_memory_field(memory):
    memory = json.loads(json.dumps(memory, allow_nan=True))  # exactly what a request body can carry
    try:
        parsed = parse_memory(memory, SETTINGS)
    except MemoryRequestError as error:
        assert str(error).startswith("memory")
        return
    assert isinstance(parsed.user_id, str) and is_valid_id(parsed.user_id) and set(memory) <= set(MEMORY_FIELDS)
    assert 1 <= parsed.top_k <= SETTINGS.max_top_k and parsed.mode in MODES and parsed.order in FACT_ORDERS
    assert 0 <= parsed.recompute_tail_facts <= SETTINGS.max_top_k and parsed.kv_crossover_tokens >= 0
    assert parsed.retrieval in ("", *RETRIEVAL_MODES) and parsed.max_tokens >= 0
