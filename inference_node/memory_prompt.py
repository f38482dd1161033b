"""What the middleware puts in a request: the memory block (one fact per line, best last) as text, and as the
prompt's token ids (`MemoryTokens`: on /v1/completions the prompt itself, on /v1/chat/completions the ids of the
rendered chat prompt beside its messages), and for kv mode the load plan (inference_node.plan) that the connector
verifies against the prompt's actual token ids."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from inference_node.plan import LoadPlan, PlanFact, PlanHeader
from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.layout import MEMORY_INSTRUCTION, fact_line, fact_token_ids, memory_header_ids, memory_header_text
from inferscale_kv.stored_text import StoredTextGuard


@dataclass(frozen=True)
class MemoryPlan:
    facts: list[pb.RetrievedFact]  # in prompt order
    block_text: str
    plan: LoadPlan  # unsigned
    injectable_tokens: int
    kv_facts: int


def has_kv(fact: pb.RetrievedFact) -> bool:
    return fact.kv_ready and bool(fact.token_ids) and bool(fact.content_id)


def by_rank_descending(fact: pb.RetrievedFact) -> int:
    return -fact.rank


def by_creation(fact: pb.RetrievedFact) -> tuple[int, int, str]:
    """A user's facts in the order they were first stored: the same relative order in every request, so that
    consecutive text prompts of a user share their longest common prefix (vLLM's prefix cache can hit)."""
    return fact.created_at.seconds, fact.created_at.nanos, fact.fact_id


FACT_ORDERS: dict[str, Callable[[pb.RetrievedFact], Any]] = {"ranked": by_rank_descending, "created": by_creation}


def order_facts(facts: list[pb.RetrievedFact],
                key: Callable[[pb.RetrievedFact], Any] = by_rank_descending) -> list[pb.RetrievedFact]:
    """Prompt order: facts with KV first, then the rest (prefilled), each part sorted by `key` (default: best
    ranked last, the node's order).

    Only a prompt prefix can be loaded, so facts to be prefilled go after the injectable ones; text mode
    uses the same order so that both modes see the same prompt.
    """
    ready = sorted((f for f in facts if has_kv(f)), key=key)
    other = sorted((f for f in facts if not has_kv(f)), key=key)
    return ready + other


class FactLines:
    """Each fact's line in the memory block (inferscale_kv.layout.fact_line: its neutral form for `guard`), remembered
    per fact text (least recently used out past `capacity_chars` characters of texts and lines): a user's facts come
    back request after request, and making a long text neutral costs most for hostile text packed with added-token
    strings, on vLLM's event loop. Not thread-safe (the middleware's event loop owns it)."""

    def __init__(self, guard: StoredTextGuard, capacity_chars: int = 16 << 20) -> None:
        self.guard = guard
        self.capacity_chars = capacity_chars
        self._lines: OrderedDict[str, str] = OrderedDict()
        self._chars = 0

    def line(self, text: str) -> str:
        """The fact's line: the same string `fact_line(guard, text)` gives."""
        line = self._lines.get(text)
        if line is not None:
            self._lines.move_to_end(text)
            return line
        line = fact_line(self.guard, text)
        self._lines[text] = line
        self._chars += len(text) + len(line)
        while self._chars > self.capacity_chars and len(self._lines) > 1:
            forgotten, forgotten_line = self._lines.popitem(last=False)
            self._chars -= len(forgotten) + len(forgotten_line)
        return line


def plan_memory(facts: list[pb.RetrievedFact], header_ids: list[int], header_content_id: str, profile_id: str,
                user_id: str, key: Callable[[pb.RetrievedFact], Any] = by_rank_descending,
                recompute_tail_facts: int = 0, *, lines: FactLines) -> MemoryPlan:
    """The memory block and load plan for retrieved facts in `order_facts(facts, key)` order: each fact's line as
    the worker tokenized it (`lines`: of the node's tokenizer's guard). Without header KV (`header_content_id`
    empty) nothing can be injected: every fact is text.

    `recompute_tail_facts` = m leaves the last m facts with KV (in the ranked order, the m nearest the question)
    out of the plan: vLLM prefills them after the injected ones, so they attend to the header and every fact
    before them. The prompt is the same whatever m is; only what is injected changes."""
    if not header_content_id:
        facts = [pb.RetrievedFact(fact_id=f.fact_id, version=f.version, text=f.text, score=f.score, rank=f.rank,
                                  created_at=f.created_at) for f in facts]
    ordered = order_facts(facts, key)
    block = "".join(lines.line(fact.text) for fact in ordered)
    injected = [PlanFact(f.fact_id, f.version, f.content_id, tuple(f.token_ids)) for f in ordered if has_kv(f)]
    injected = injected[: max(len(injected) - recompute_tail_facts, 0)]
    plan = LoadPlan(profile_id, user_id, PlanHeader(header_content_id, tuple(header_ids)), tuple(injected))
    tokens = len(header_ids) + sum(len(fact.token_ids) for fact in injected) if header_content_id else 0
    return MemoryPlan(ordered, block, plan, tokens, len(injected))


def system_content(block: str, client_system: str) -> str:
    content = f"{MEMORY_INSTRUCTION}\n{block}"
    return f"{content}{client_system}" if client_system else content


# Where a fact line meets what follows it in a prompt: the next fact's first word, a space, a digit, punctuation, a
# line break, code.
_BOUNDARY_SAMPLES = ("Ana visited Lisbon in May 2023.", " leading space", "42 is a number", "(note) it, too!",
                     "\nline", "def answer(question):", "Qu'est-ce que c'est ?")


# The longest prompt (tokens) MemoryTokens tokenizes where the node does not say its model's.
DEFAULT_MAX_PROMPT_TOKENS = 1 << 17


class MemoryTokens:
    """A memory prompt as token ids, the layout's own tokenization (inferscale_kv.layout: the header, then each fact
    line tokenized on its own, then the rest), with each fact line's ids remembered (least recently used out past
    `capacity`): a user's facts come back request after request, so vLLM need not tokenize thousands of memory
    tokens per request. Kv and text modes get the same ids, and the connector still proves the plan against them.

    `concatenative` says whether this tokenizer gives the same ids for the prompt's text as a whole, and
    `chat_concatenative` whether its chat template's rendering does too (`rendered_prompt`); where not, the node keeps
    sending text (vLLM tokenizes it)."""

    def __init__(self, tokenizer: Any, capacity: int = 100_000,
                 max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> None:
        self._tokenizer = tokenizer
        self.capacity = capacity
        # The most characters of prompt text tokenized here per request: what vLLM lets through its own length check
        # (the longest prompt in tokens times the longest token in characters); a longer text goes to vLLM as text.
        self.max_prompt_chars = max_prompt_tokens * max(map(len, tokenizer.get_vocab()))
        self.header_ids = memory_header_ids(tokenizer)
        self._guard = StoredTextGuard.for_tokenizer(tokenizer)
        self._facts: OrderedDict[str, list[int]] = OrderedDict()
        self.header_text = header = memory_header_text(tokenizer)
        self.concatenative = all(
            self._encode(header + fact_line(self._guard, first) + rest)
            == [*self.header_ids, *fact_token_ids(tokenizer, first), *self._encode(rest)]
            for first in _BOUNDARY_SAMPLES for rest in _BOUNDARY_SAMPLES)
        self.chat_concatenative = self.concatenative and self._renders_chat_in_pieces()

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat prompt's text as vLLM renders it for messages of string content (HF's template, no tokenizing)."""
        return self._tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=add_generation_prompt)

    def _renders_parts_otherwise(self, messages: list[dict[str, str]], rendered: str) -> bool:
        """Whether the template takes the messages' content as text parts and renders them into other text than
        `rendered` (vLLM hands its parts to a template that iterates over content). A template that fails on parts,
        or writes the list out as it is (a memory's lines then appear escaped), takes strings: vLLM gives it those,
        as here."""
        as_parts = [{"role": message["role"], "content": [{"type": "text", "text": message["content"]}]}
                    for message in messages]
        try:
            with_parts = self._tokenizer.apply_chat_template(as_parts, tokenize=False, add_generation_prompt=True)
        except Exception:  # the template's own failure on parts: a template of string content
            return False
        return with_parts != rendered and all(message["content"] in with_parts for message in messages)

    def _renders_chat_in_pieces(self) -> bool:
        """Whether, for sample memories, the chat template renders them as vLLM would whichever content format it
        detects, and `rendered_prompt`'s ids are the tokenizer's for the whole rendered text."""
        if not getattr(self._tokenizer, "chat_template", None):
            return False
        lines = FactLines(self._guard)
        try:
            for first in _BOUNDARY_SAMPLES:
                facts = [pb.RetrievedFact(text=text) for text in (first, *_BOUNDARY_SAMPLES[:2])]
                block = "".join(lines.line(fact.text) for fact in facts)
                for question in _BOUNDARY_SAMPLES:
                    messages = [{"role": "system", "content": system_content(block, "")},
                                {"role": "user", "content": question}]
                    rendered = self.render_chat(messages)
                    if (self._renders_parts_otherwise(messages, rendered)
                            or self.rendered_prompt(facts, lines, rendered) != self._encode(rendered)):
                        return False
            return True
        finally:
            self._facts.clear()

    def _remember(self, facts: Sequence[pb.RetrievedFact]) -> None:
        """Tokenizes the lines of the facts not remembered yet."""
        missing = list(dict.fromkeys(fact.text for fact in facts if fact.text not in self._facts))
        if missing:
            lines = self._tokenizer([fact_line(self._guard, text) for text in missing],
                                    add_special_tokens=False)["input_ids"]
            self._facts.update(zip(missing, map(list, lines), strict=True))

    def _forget_least_recent(self) -> None:
        while len(self._facts) > self.capacity:
            self._facts.popitem(last=False)

    def within_budget(self, facts: Sequence[pb.RetrievedFact], max_tokens: int) -> list[pb.RetrievedFact]:
        """The best-ranked of `facts` whose lines take at most `max_tokens` tokens together: in rank order, each fact
        that still fits is kept (a long one left out does not stop a shorter one after it)."""
        self._remember(facts)
        kept, used = [], 0
        for fact in sorted(facts, key=lambda fact: fact.rank):
            size = len(self._facts[fact.text])
            if used + size <= max_tokens:
                kept.append(fact)
                used += size
        self._forget_least_recent()
        return kept

    def prompt(self, facts: Sequence[pb.RetrievedFact], lines: FactLines, rest: str) -> list[int] | None:
        """header | each fact's line | `rest`, as token ids (`_spliced`); None where it must go as text."""
        return self._spliced(facts, lines, f"{self.header_text}{''.join(lines.line(f.text) for f in facts)}{rest}")

    def rendered_prompt(self, facts: Sequence[pb.RetrievedFact], lines: FactLines, rendered: str) -> list[int] | None:
        """The token ids of `rendered`, a chat prompt as the template wrote it around the memory (the header, then
        `facts`' lines in order, then the rest; a template that trims its content leaves the last line short of its
        newline), by `_spliced`; None where it must go as text."""
        return self._spliced(facts, lines, rendered)

    def _spliced(self, facts: Sequence[pb.RetrievedFact], lines: FactLines, text: str) -> list[int] | None:
        """The token ids of `text`, which starts with the header and then as many of `facts`' lines as it holds
        whole, in order: the header's and those lines' ids remembered, but the last of them tokenized again with what
        follows (where the rest starts with whitespace, a tokenizer may merge a line's closing newline into it; the
        plan then proves that fact no more). None, for the text to go as it is (vLLM renders, checks and tokenizes
        it), where `text` does not start with the header, where what is tokenized here is longer than any prompt
        the model takes (`max_prompt_chars`), or where the tokenizer refuses it."""
        if not text.startswith(self.header_text):
            return None
        self._remember(facts)
        ids: list[int] = []
        last, at = self.header_ids, len(self.header_text)
        last_at = 0
        for fact in facts:
            line = lines.line(fact.text)
            if not text.startswith(line, at):
                break
            ids += last
            last, last_at = self._facts[fact.text], at
            self._facts.move_to_end(fact.text)
            at += len(line)
        self._forget_least_recent()
        if len(text) - last_at > self.max_prompt_chars:
            return None
        try:
            return ids + self._encode(text[last_at:])
        except Exception:  # text the tokenizer refuses (a lone surrogate): vLLM answers it
            return None
