"""The `memory` field of an OpenAI request, the node's contract with its clients: where it is served, what it may
say (parsed and checked here, MemoryRequestError naming the first field that is wrong) and the question its memory
is retrieved for.

    "memory": {"user_id": "...", "top_k": 20, "mode": "kv" | "text" | "off",
               "order": "ranked" | "created", "recompute_tail_facts": m, "kv_crossover_tokens": n,
               "retrieval": "vector" | "keyword" | "hybrid", "max_tokens": t}

order "ranked" (default) puts the best fact last, nearest the question; "created" keeps a user's facts in the order
they were stored, so that text prompts of consecutive requests share a prefix vLLM's prefix cache can reuse.
recompute_tail_facts (default: the node's --recompute-tail-facts) prefills the last m facts of kv mode as text.
retrieval (default: the memory service's --retrieval-mode) says how the facts are ranked. max_tokens (default 0: no
cap) caps the memory's tokens: the best-ranked facts whose lines (as the prompt tokenizes them) fit in t tokens
together are kept, the rest left out, in kv and text mode alike.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from inference_node.memory_prompt import FACT_ORDERS
from inference_node.settings import NodeSettings
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.ids import ID_RULE, is_valid_id
from inferscale_kv.limits import MAX_QUERY_CHARS

MEMORY_PATHS = {"/v1/chat/completions", "/v1/completions"}
MODES = ("kv", "text", "off")
MEMORY_FIELDS = ("user_id", "top_k", "mode", "order", "recompute_tail_facts", "kv_crossover_tokens", "retrieval",
                 "max_tokens")
RETRIEVAL_MODES = {"vector": pb.RETRIEVAL_MODE_VECTOR, "keyword": pb.RETRIEVAL_MODE_KEYWORD,
                   "hybrid": pb.RETRIEVAL_MODE_HYBRID}
MAX_MEMORY_TOKENS = 1 << 20  # the largest memory.max_tokens (and kv_crossover_tokens) a request may give


def leading_field(message: str) -> str:
    """The field a refusal's message starts with (`memory.top_k: ...` -> `memory`; `query: ...` -> `query`)."""
    return re.split(r"[.\[:]", message, maxsplit=1)[0]


class RequestRefused(ValueError):
    """A request the middleware answers itself, with HTTP `status` (400 unless said); the message starts with the
    field it is about."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class MemoryRequestError(RequestRefused):
    """The `memory` field is malformed (HTTP 400)."""


@dataclass(frozen=True)
class MemoryRequest:
    """A request's `memory` field, validated."""

    user_id: str
    top_k: int
    mode: str  # kv | text | off
    order: str  # FACT_ORDERS: ranked (best last) | created (stable per user)
    recompute_tail_facts: int  # kv mode: facts nearest the question prefilled as text
    kv_crossover_tokens: int  # kv mode: a shorter injectable memory is served as text
    retrieval: str = ""  # RETRIEVAL_MODES, or "": the memory service's default
    max_tokens: int = 0  # the most tokens the facts' lines may take together; 0: no cap
    user_token: str = ""  # the gateway's token for the user (--user-token-header), not a field of `memory`


def _int_field(memory: dict, name: str, default: int, low: int, high: int) -> int:
    value = memory.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise MemoryRequestError(f"memory.{name}: must be an integer in [{low}, {high}]")
    return value


def parse_memory(memory: Any, settings: NodeSettings) -> MemoryRequest:
    """The validated `memory` field; MemoryRequestError naming the first field that is unknown or wrong."""
    if not isinstance(memory, dict):
        raise MemoryRequestError("memory: must be an object")
    unknown = sorted(set(memory) - set(MEMORY_FIELDS))
    if unknown:
        raise MemoryRequestError(f"memory.{unknown[0][:64]}: unknown field (memory takes {', '.join(MEMORY_FIELDS)})")
    user_id = memory.get("user_id")
    if not isinstance(user_id, str) or not is_valid_id(user_id):
        shown = f"{user_id[:40]!r} is not a valid id" if isinstance(user_id, str) else "must be a string"
        raise MemoryRequestError(f"memory.user_id: {shown} ({ID_RULE})")
    mode = memory.get("mode", "kv")
    if not isinstance(mode, str) or mode not in MODES:
        raise MemoryRequestError(f"memory.mode: must be one of {', '.join(MODES)}")
    order = memory.get("order", "ranked")
    if not isinstance(order, str) or order not in FACT_ORDERS:
        raise MemoryRequestError(f"memory.order: must be one of {', '.join(FACT_ORDERS)}")
    top_k = _int_field(memory, "top_k", settings.default_top_k, 1, settings.max_top_k)
    tail = _int_field(memory, "recompute_tail_facts", settings.recompute_tail_facts, 0, settings.max_top_k)
    crossover = _int_field(memory, "kv_crossover_tokens", settings.kv_crossover_tokens, 0, MAX_MEMORY_TOKENS)
    retrieval = memory.get("retrieval", "")
    if retrieval != "" and (not isinstance(retrieval, str) or retrieval not in RETRIEVAL_MODES):
        raise MemoryRequestError(f"memory.retrieval: must be one of {', '.join(RETRIEVAL_MODES)}")
    max_tokens = _int_field(memory, "max_tokens", 0, 0, MAX_MEMORY_TOKENS)
    return MemoryRequest(user_id, top_k, mode, order, tail, crossover, retrieval, max_tokens)


def text_of(content: Any, field: str) -> str:
    """The text of a message's content (a string, or text parts); RequestRefused naming `field` for any other."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [part.get("text", "") for part in content if isinstance(part, dict)]
        if all(isinstance(text, str) for text in texts):
            return " ".join(texts)
    raise RequestRefused(f"{field}: with memory, must be a string or a list of parts whose text is a string")


def question_of(payload: dict, path: str, memory: MemoryRequest) -> str:
    """The question the memory is retrieved for (the last user message's text, or the completion prompt), as the
    memory service's query: without NUL characters, trimmed, at most MAX_QUERY_CHARS. RequestRefused naming the
    field where the request has no question in a retrieving mode, or a prompt the memory cannot be put before."""
    if path == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list):
            raise RequestRefused("messages: with memory, must be a list of messages")
        users = [index for index, message in enumerate(messages)
                 if isinstance(message, dict) and message.get("role") == "user"]
        field = f"messages[{users[-1]}].content" if users else "messages"
        text = text_of(messages[users[-1]].get("content"), field) if users else ""
        if messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
            # What the memory's system message takes: tokenized with it, so Unicode throughout.
            _unicode(text_of(messages[0].get("content"), "messages[0].content"), "messages[0].content")
    else:
        field, text = "prompt", payload.get("prompt", "")
        if not isinstance(text, str):
            raise RequestRefused("prompt: with memory, must be one string (not token ids or a list)")
    query = _unicode(text, field).replace("\x00", "").strip()[:MAX_QUERY_CHARS]
    if memory.mode != "off" and not query:
        raise RequestRefused(f"{field}: with memory, the question must be text that is not empty or whitespace")
    return query


def _unicode(text: str, field: str) -> str:
    """`text`, whole, if it is Unicode text: the node tokenizes all of it (a completions prompt), not only the
    memory service's query."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise RequestRefused(f"{field}: must be Unicode text (it holds a lone surrogate escape)") from None
    return text
