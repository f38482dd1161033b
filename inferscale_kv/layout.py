"""The memory prompt layout shared by the precompute workers (encoding) and inference nodes (serving).

Serving prompt, as token ids: header | fact_1 | ... | fact_k (best last) | footer. The header is the chat
template's opening up to and including the memory instruction; each fact is its line (`fact_line`: its neutral text
and a newline), tokenized on its own; the footer closes the system message and carries the user's question. Facts
are encoded behind the same header (and, with Context-Window Encoding, behind the conversation turns before them,
each its `turn_line`). Stored text enters every line neutral (`inferscale_kv.stored_text`): never a control token.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from inferscale_kv.stored_text import StoredTextGuard

MEMORY_INSTRUCTION = (
    "You are a helpful assistant with a memory of the user. Facts you remember about the user, one per line:"
)
_SENTINEL = "\u2063MEMORY\u2063"


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def memory_header_text(tokenizer) -> str:
    """The prompt text before the first fact: the chat template's system opening and the instruction."""
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": f"{MEMORY_INSTRUCTION}\n{_SENTINEL}"}], tokenize=False
        )
        return rendered.split(_SENTINEL)[0]
    bos = tokenizer.bos_token or ""
    return f"{bos}{MEMORY_INSTRUCTION}\n"


def memory_header_ids(tokenizer) -> list[int]:
    return _encode(tokenizer, memory_header_text(tokenizer))


def fact_line(guard: StoredTextGuard, text: str) -> str:
    """A fact's line in the memory block, as the node renders it and the worker tokenizes it."""
    return guard.neutral(text.strip()) + "\n"


def turn_line(guard: StoredTextGuard, speaker: str, text: str) -> str:
    """A conversation turn's line before a fact (Context-Window Encoding)."""
    line = guard.neutral(text.strip())
    return f"{guard.neutral(speaker)}: {line}\n" if speaker else line + "\n"


def fact_token_ids(tokenizer, text: str) -> list[int]:
    """A fact's tokens exactly as they stand in the serving prompt: its own line."""
    return _encode(tokenizer, fact_line(StoredTextGuard.for_tokenizer(tokenizer), text))


def turn_token_ids(tokenizer, speaker: str, text: str) -> list[int]:
    """A conversation turn as Context-Window Encoding renders it before a fact."""
    return _encode(tokenizer, turn_line(StoredTextGuard.for_tokenizer(tokenizer), speaker, text))


def token_hash(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]
