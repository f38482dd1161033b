"""The neutral form of stored text: it holds no added-token string, and forms none with whatever is rendered beside
it; a tokenizer that would undo it is refused. (Per tokenizer family, through the real prompt:
tests/inference_node/test_hostile_memory_prompt.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from harness.tiny_llama import LLAMA3_SPECIAL_TOKENS
from inferscale_kv.stored_text import BREAKER, REPLACEMENT, StoredTextGuard, UnsafeTokenizer

# Llama-3's, ChatML's and Llama-2's, and tokens that end and start alike or hold a newline, and one character long.
CONTROLS = (*LLAMA3_SPECIAL_TOKENS, "<|im_start|>", "<|im_end|>", "<s>", "</s>", "[INST]", "[/INST]", "aba", "a\nb",
            "\n\n", "#")
GUARD = StoredTextGuard(CONTROLS)
# Texts and neighbours made of pieces of the tokens, so that occurrences across the edges are likely.
PIECES = sorted({control[start:end] for control in CONTROLS for start in range(len(control))
                 for end in range(start + 1, len(control) + 1)} | {" ", "\n", "x", "system", BREAKER})
texts = st.lists(st.sampled_from(PIECES), max_size=8).map("".join)


def _occurrences(text: str, control: str) -> list[int]:
    found, index = [], text.find(control)
    while index >= 0:
        found.append(index)
        index = text.find(control, index + 1)
    return found


@settings(max_examples=3000, deadline=None, derandomize=True, database=None)
@given(left=texts, text=texts, right=texts)
def test_no_added_token_string_covers_a_character_of_neutral_text_whatever_its_neighbours(left, text, right):
    neutral = GUARD.neutral(text)
    rendered = left + neutral + right
    start, end = len(left), len(left) + len(neutral)
    for control in GUARD.control_strings:
        for index in _occurrences(rendered, control):
            assert max(index, start) >= min(index + len(control), end), (left, text, right, control)  # disjoint


@settings(max_examples=1000, deadline=None, derandomize=True, database=None)
@given(text=texts)
def test_neutral_text_reads_as_the_text_without_breakers(text):
    neutral = GUARD.neutral(text)
    assert neutral.replace(BREAKER, "") == text.replace(BREAKER, "").replace("#", REPLACEMENT)
    assert GUARD.neutral(neutral) == neutral  # already neutral: unchanged


def test_text_without_added_token_pieces_at_its_edges_is_unchanged() -> None:
    for text in ("Maya has a cat named Pimenta.", "x < y and y > z", "line one\n\nline two", ""):
        assert GUARD.neutral(text) == text.replace("#", REPLACEMENT)
    assert GUARD.neutral("<s>") == f"<{BREAKER}s>"
    assert GUARD.neutral("see <|eot_id") == f"see <|eot_id{BREAKER}"  # what follows could complete it
    assert GUARD.neutral("im_end|> said") == f"{BREAKER}im_end|> said"  # what precedes could begin it
    assert GUARD.neutral("eot") == f"{BREAKER}eot{BREAKER}"  # inside one: either side could complete it
    assert GUARD.neutral("x\n\ny") == "x\n\ny"  # a whitespace added token is formatting, not control


def test_a_tokenizer_whose_normalizer_drops_the_breaker_is_refused() -> None:
    vocab = {char: index for index, char in enumerate(["[UNK]", "<", ">", "s", "a", BREAKER])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.normalizer = normalizers.Replace(BREAKER, "")
    backend.add_special_tokens([AddedToken("<s>", normalized=True, special=True)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")
    with pytest.raises(UnsafeTokenizer, match="'<s>'"):
        StoredTextGuard.for_tokenizer(tokenizer)
