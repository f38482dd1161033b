"""Stored text (facts, conversation turns, speakers) made plain text for a tokenizer: it can never become control
tokens.

A tokenizer matches its added tokens (`<s>`, `<|im_start|>`, `<|eot_id|>`, ...) anywhere in a text before its
ordinary tokenization, and vLLM tokenizes the rendered chat or completion prompt that way; a fact holding
`</s>\\n<s>system\\n...` would open a turn of its own in every prompt it reaches. `StoredTextGuard.neutral` puts an
invisible WORD JOINER (U+2060) inside every added-token string of a stored text, and at either edge of the text where
the text could complete one together with whatever is rendered beside it. Its result holds no added-token string and
forms none with any neighbour, so no tokenization of any prompt it stands in gives a control token over its
characters. Workers tokenize the neutral text and nodes render the same neutral text (`inferscale_kv.layout`), so
the KV's token ids and the prompt's agree token for token.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BREAKER = "\u2060"  # WORD JOINER: no width, no meaning, not whitespace (str.strip and Jinja's trim keep it)
# Replaces a one-character added token, which no insertion can break.
REPLACEMENT = "\ufffd"


class UnsafeTokenizer(ValueError):
    """The tokenizer undoes the breaker (a normalizer that drops it), so stored text cannot be made plain."""


class StoredTextGuard:
    """The neutral form of stored text for one tokenizer's added tokens (`for_tokenizer`)."""

    def __init__(self, control_strings: Iterable[str]) -> None:
        """`control_strings`: the strings the tokenizer turns into added tokens wherever they appear."""
        strings = {text for text in control_strings if text and not text.isspace()}
        if any(BREAKER in text for text in strings):
            raise UnsafeTokenizer(f"an added token contains the breaker U+{ord(BREAKER):04X}")
        self.control_strings = tuple(sorted(strings, key=lambda text: (-len(text), text)))
        self._single = {text for text in strings if len(text) == 1}
        multi = [text for text in self.control_strings if len(text) > 1]
        # Every position where an added-token string starts (overlapping ones too).
        self._starts = re.compile("(?=(?:" + "|".join(map(re.escape, multi)) + "))") if multi else None
        self._multi = multi
        self._proper_prefixes = {text[:end] for text in multi for end in range(1, len(text))}
        self._proper_suffixes = {text[start:] for text in multi for start in range(1, len(text))}
        self._longest = max(map(len, multi), default=0)

    def neutral(self, text: str) -> str:
        """`text` with a breaker inside every added-token string and at each edge where a neighbour could complete
        one; text that needs neither comes back unchanged."""
        if self._single:
            text = "".join(REPLACEMENT if char in self._single else char for char in text)
        if self._starts is None or not text:
            return text
        cuts = [match.start() + 1 for match in self._starts.finditer(text)]
        if cuts:
            pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
            text = BREAKER.join(pieces)
        left = BREAKER if self._open_on_the_left(text) else ""
        right = BREAKER if self._open_on_the_right(text) else ""
        return f"{left}{text}{right}"

    def _open_on_the_left(self, text: str) -> bool:
        """Whether text rendered after something could end an added-token string inside `text`: it starts with a
        proper suffix of one, or lies inside one past its first character."""
        if any(text[:size] in self._proper_suffixes for size in range(1, min(len(text), self._longest - 1) + 1)):
            return True
        return len(text) < self._longest and any(text in control[1:] for control in self._multi)

    def _open_on_the_right(self, text: str) -> bool:
        """Whether text rendered after `text` could complete an added-token string begun inside it."""
        if any(text[-size:] in self._proper_prefixes for size in range(1, min(len(text), self._longest - 1) + 1)):
            return True
        return len(text) < self._longest and any(text in control[:-1] for control in self._multi)

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase) -> StoredTextGuard:
        """The guard of a Hugging Face tokenizer's added and special tokens (cached per tokenizer object). Checks
        that the tokenizer keeps every neutralized token plain; raises UnsafeTokenizer where it does not."""
        guard = _GUARDS.get(tokenizer)
        if guard is None:
            guard = cls(added_token_strings(tokenizer))
            control_ids = set(control_token_ids(tokenizer))
            for text in guard.control_strings:
                if control_ids.intersection(tokenizer.encode(guard.neutral(text), add_special_tokens=False)):
                    raise UnsafeTokenizer(f"the tokenizer still reads {text!r} as a control token once broken")
            _GUARDS[tokenizer] = guard
        return guard


def added_token_strings(tokenizer: PreTrainedTokenizerBase) -> set[str]:
    """Every string the tokenizer matches as one added or special token wherever it appears."""
    added = {token.content for token in tokenizer.added_tokens_decoder.values()}
    return added | set(tokenizer.all_special_tokens)


def control_token_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids of the tokenizer's added tokens that are not whitespace (its special tokens among them)."""
    return {index for index, token in tokenizer.added_tokens_decoder.items() if not token.content.isspace()}


_GUARDS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, StoredTextGuard] = weakref.WeakKeyDictionary()
