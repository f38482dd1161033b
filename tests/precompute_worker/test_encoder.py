"""Exactness of stored fact KV (float32, tiny random Llama): Chunked RoPE + Context-Window Encoding."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from inferscale_kv.layout import fact_token_ids, memory_header_ids, turn_token_ids
from inferscale_kv.rope import RotaryTables, apply_rope
from precompute_worker.encoder import EncodingGroup, FactEncoder, FactKey, FactSpec
from precompute_worker.grouping import ConversationTurn, FactJob, GroupBuilder

TOLERANCE = 1e-4
TURNS = [ConversationTurn(f"D1:{i}", "Ana" if i % 2 else "Ben", f"turn number {i} about the garden and the sea")
         for i in range(9)]


def _load(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _plain_forward_kv(model, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE keys and values [layers, tokens, kv_heads, head_dim] of a plain causal forward."""
    with torch.no_grad():
        cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    keys = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])
    values = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])
    return keys, values


def _assert_matches_plain_forward(model, tokenizer, context_ids: list[int], fact_text: str) -> None:
    fact_ids = fact_token_ids(tokenizer, fact_text)
    (encoded,) = FactEncoder(model).encode([EncodingGroup(context_ids, [FactSpec(FactKey("u", "f", 1), fact_ids,
                                                                                   len(context_ids))])])
    tables = RotaryTables.from_model(model, 512)
    rotated = apply_rope(encoded.keys, len(context_ids), tables.cos, tables.sin)
    plain_keys, plain_values = _plain_forward_kv(model, context_ids + fact_ids)
    assert (rotated - plain_keys[:, len(context_ids):]).abs().max() <= TOLERANCE
    assert (encoded.values - plain_values[:, len(context_ids):]).abs().max() <= TOLERANCE


def test_fact_behind_the_header_reproduces_plain_prefill_keys_and_values(tiny_llama_dir) -> None:
    model, tokenizer = _load(tiny_llama_dir)
    _assert_matches_plain_forward(model, tokenizer, memory_header_ids(tokenizer), "Ana keeps bees on her roof.")


def test_fact_behind_a_window_of_turns_reproduces_plain_prefill(tiny_llama_dir) -> None:
    model, tokenizer = _load(tiny_llama_dir)
    context = memory_header_ids(tokenizer)
    for turn in TURNS[:5]:
        context += turn_token_ids(tokenizer, turn.speaker, turn.text)
    _assert_matches_plain_forward(model, tokenizer, context, "Ana keeps bees on her roof.")


def test_llama3_rope_scaling_uses_the_models_own_tables(tiny_llama3_scaled_dir) -> None:
    model, tokenizer = _load(tiny_llama3_scaled_dir)
    context = memory_header_ids(tokenizer)
    for turn in TURNS:
        context += turn_token_ids(tokenizer, turn.speaker, turn.text)
    assert len(context) > 64  # past the original max positions, where llama3 scaling bends the frequencies
    _assert_matches_plain_forward(model, tokenizer, context, "Ben sails every summer.")


def test_tables_from_config_equal_tables_from_the_loaded_model(tiny_llama3_scaled_dir) -> None:
    model, _ = _load(tiny_llama3_scaled_dir)
    from_model = RotaryTables.from_model(model, 300)
    from_config = RotaryTables.from_config(model.config, 300)
    assert torch.equal(from_model.cos, from_config.cos) and torch.equal(from_model.sin, from_config.sin)


def test_keys_rotated_to_a_later_position_match_a_shifted_encoding(tiny_llama_dir) -> None:
    """Pre-RoPE storage is position-free: rotating to p equals encoding the same chunk at p."""
    model, tokenizer = _load(tiny_llama_dir)
    fact_ids = fact_token_ids(tokenizer, "Ben sails every summer.")
    (at_zero,) = FactEncoder(model).encode([EncodingGroup([], [FactSpec(FactKey("u", "f", 1), fact_ids, 0)])])
    tables = RotaryTables.from_model(model, 512)
    shift = 137
    layer0_rotated = apply_rope(at_zero.keys[0], shift, tables.cos, tables.sin)
    with torch.no_grad():
        embedded = model.model.embed_tokens(torch.tensor([fact_ids]))
        normed = model.model.layers[0].input_layernorm(embedded)
        raw = model.model.layers[0].self_attn.k_proj(normed)[0].view(len(fact_ids), -1, layer0_rotated.shape[-1])
        cos, sin = model.model.rotary_emb(embedded, torch.arange(shift, shift + len(fact_ids))[None])
    expected = raw * cos[0][:, None] + torch.cat((-raw[..., raw.shape[-1] // 2:], raw[..., : raw.shape[-1] // 2]),
                                                  -1) * sin[0][:, None]
    assert (layer0_rotated - expected).abs().max() <= TOLERANCE


def test_shared_grouping_keeps_facts_together_when_the_context_alone_exceeds_the_group_cap(tiny_llama_dir) -> None:
    _, tokenizer = _load(tiny_llama_dir)
    builder = GroupBuilder(tokenizer, memory_header_ids(tokenizer), -1, max_context_tokens=0, max_group_tokens=40)
    jobs = [FactJob(FactKey("alice", f"f{i}", 1), f"fact {i}", TURNS[-1].turn_id) for i in range(6)]
    groups = builder.shared(jobs, {"alice": TURNS})
    assert len(groups[0].context_ids) > 40  # all turns before the last one
    assert sum(len(g.facts) for g in groups) == 6 and len(groups) < 6
    assert all(sum(len(f.token_ids) for f in g.facts) <= 40 for g in groups)


@pytest.mark.parametrize("context_window", [0, 2, 3, -1])
def test_shared_conversation_encoding_equals_naive_per_fact_encoding(tiny_llama_dir, context_window) -> None:
    model, tokenizer = _load(tiny_llama_dir)
    builder = GroupBuilder(tokenizer, memory_header_ids(tokenizer), context_window, max_context_tokens=0,
                           max_group_tokens=400)
    jobs = [FactJob(FactKey(user, f"f{i}", 1), f"{user} fact {i}: likes item {i * 7}", TURNS[i].turn_id)
            for user in ("alice", "bob") for i in range(1, 9)]
    jobs.append(FactJob(FactKey("alice", "orphan", 1), "A fact without a source turn.", ""))
    turns = {"alice": TURNS, "bob": TURNS[::-1]}
    encoder = FactEncoder(model, max_tokens_per_forward=600)
    naive = {e.spec.key: e for e in encoder.encode(builder.naive(jobs, turns))}
    shared_groups = builder.shared(jobs, turns)
    shared = {e.spec.key: e for e in encoder.encode(shared_groups)}
    assert naive.keys() == shared.keys() == {job.key for job in jobs}
    assert len(shared_groups) < len(jobs)
    for key in naive:
        assert naive[key].spec.prefix_length == shared[key].spec.prefix_length
        assert (naive[key].keys - shared[key].keys).abs().max() <= TOLERANCE
        assert (naive[key].values - shared[key].values).abs().max() <= TOLERANCE


@pytest.fixture(scope="module")
def few_positions_dir(tmp_path_factory):
    """The tiny Llama with 96 positions: shorter than header + every turn of TURNS + a fact."""
    from harness.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("few-positions"), max_positions=96)


@pytest.mark.parametrize("context_window", [-1, 8])
def test_a_window_is_capped_from_its_oldest_end_to_the_models_positions(few_positions_dir, context_window) -> None:
    from inferscale_kv.model_profile import build_model_profile

    model, tokenizer = _load(few_positions_dir)
    profile = build_model_profile(few_positions_dir, tokenizer, "float32", context_window)
    assert profile.max_context_tokens == 96  # recorded in the profile (and so in its id)
    header = memory_header_ids(tokenizer)
    builder = GroupBuilder(tokenizer, header, context_window, profile.max_context_tokens, max_group_tokens=400)
    jobs = [FactJob(FactKey("alice", f"f{i}", 1), f"fact {i}: likes item {i * 7}", TURNS[i].turn_id)
            for i in range(1, 9)]
    turn_ids = [turn_token_ids(tokenizer, turn.speaker, turn.text) for turn in TURNS]
    assert len(header) + sum(map(len, turn_ids[:8])) > 96  # uncapped, the late windows would not fit
    encoder = FactEncoder(model)
    naive = {e.spec.key: e for e in encoder.encode(builder.naive(jobs, {"alice": TURNS}))}
    shared = {e.spec.key: e for e in encoder.encode(builder.shared(jobs, {"alice": TURNS}))}
    dropped = 0
    for index, job in enumerate(jobs, start=1):
        fact = naive[job.key]
        assert len(fact.context_ids) + len(fact.spec.token_ids) <= 96
        window = fact.context_ids[len(header):]
        kept = next(start for start in range(index + 1)
                    if [t for ids in turn_ids[start:index] for t in ids] == list(window))
        dropped += kept > 0
        if kept:  # only as many turns as needed: one more would not have fitted
            assert len(header) + sum(map(len, turn_ids[kept - 1 : index])) + len(fact.spec.token_ids) > 96
        assert (shared[job.key].keys - fact.keys).abs().max() <= TOLERANCE
    assert dropped > 0


def test_a_capped_window_starts_on_a_stride_so_that_nearby_facts_share_it(tiny_llama_dir) -> None:
    _, tokenizer = _load(tiny_llama_dir)
    builder = GroupBuilder(tokenizer, [0] * 40, -1, max_context_tokens=500, max_group_tokens=400)
    lengths = [10] * 100  # the budget (500 - 40 - 10) holds 45 turns
    assert builder.capped_start(0, 30, lengths, 10) == 0  # fits whole
    assert [builder.capped_start(0, source, lengths, 10) for source in (90, 91, 93)] == [48, 48, 48]
    assert builder.capped_start(0, 47, lengths, 10) == 16
    assert builder.capped_start(0, 47, lengths, 420) == 43  # the stride would leave no turn: exactly 4 kept
    assert builder.capped_start(0, 90, lengths, 600) == 90  # a fact past the cap keeps no turn
