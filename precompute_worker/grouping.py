"""Turns leased facts into encoding groups: naive (one forward per fact) or shared (one per window anchor)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from inferscale_kv.layout import fact_token_ids, turn_token_ids
from inferscale_kv.profile import window_start
from inferscale_kv.stored_text import StoredTextGuard
from precompute_worker.encoder import EncodingGroup, FactKey, FactSpec


@dataclass(frozen=True)
class ConversationTurn:
    turn_id: str
    speaker: str
    text: str


@dataclass(frozen=True)
class FactJob:
    key: FactKey
    text: str
    source_turn_id: str


# A capped window starts at a multiple of this many turns, so that the facts near one another still share a forward.
CAP_STRIDE_TURNS = 16


class GroupBuilder:
    """Builds encoding groups for one profile (tokenizer, header, context window, window cap)."""

    def __init__(self, tokenizer, header_ids: Sequence[int], context_window: int, max_context_tokens: int,
                 max_group_tokens: int) -> None:
        StoredTextGuard.for_tokenizer(tokenizer)  # refuses, at start, a tokenizer that would undo neutral text
        self.tokenizer = tokenizer
        self.header_ids = list(header_ids)
        self.context_window = context_window
        self.max_context_tokens = max_context_tokens  # 0: no cap
        self.max_group_tokens = max_group_tokens

    def _turn_ids(self, turns: Sequence[ConversationTurn]) -> list[list[int]]:
        return [turn_token_ids(self.tokenizer, turn.speaker, turn.text) for turn in turns]

    def capped_start(self, start: int, source: int, turn_lengths: Sequence[int], fact_length: int) -> int:
        """The window's first turn once turns are dropped from its oldest end until header + window + fact fit
        max_context_tokens (a fact longer than that keeps no turn). The first kept turn is then rounded up to a
        multiple of CAP_STRIDE_TURNS where the window keeps a turn after it, so that capped facts near one another
        share a window (and a forward) instead of each having its own."""
        if not self.max_context_tokens:
            return start
        budget = self.max_context_tokens - len(self.header_ids) - fact_length
        window = sum(turn_lengths[start:source])
        if window <= budget:
            return start
        while start < source and window > budget:
            window -= turn_lengths[start]
            start += 1
        anchor = -(-start // CAP_STRIDE_TURNS) * CAP_STRIDE_TURNS
        return anchor if anchor < source else start

    def _windows(
        self, jobs: Sequence[FactJob], turns_by_user: Mapping[str, Sequence[ConversationTurn]],
        turn_ids: dict[str, list[list[int]]],
    ) -> list[tuple[FactJob, list[int], int, int]]:
        """Per job: (job, fact token ids, window start, source index) with the turns indexed per user."""
        index_by_user = {
            user: {turn.turn_id: index for index, turn in enumerate(turns)} for user, turns in turns_by_user.items()
        }
        lengths = {user: [len(ids) for ids in user_turns] for user, user_turns in turn_ids.items()}
        windows = []
        for job in jobs:
            token_ids = fact_token_ids(self.tokenizer, job.text)
            source = index_by_user.get(job.key.user_id, {}).get(job.source_turn_id) if job.source_turn_id else None
            if source is None or self.context_window == 0:
                start = source = 0  # no known source turn (or w=0): header only
            else:
                start = self.capped_start(window_start(source, self.context_window), source,
                                           lengths[job.key.user_id], len(token_ids))
            windows.append((job, token_ids, start, source))
        return windows

    def naive(self, jobs: Sequence[FactJob],
              turns_by_user: Mapping[str, Sequence[ConversationTurn]]) -> list[EncodingGroup]:
        """One group per fact: header + its window + the fact, as a plain forward would see it."""
        turn_ids = {user: self._turn_ids(turns) for user, turns in turns_by_user.items()}
        groups = []
        for job, token_ids, start, source in self._windows(jobs, turns_by_user, turn_ids):
            context = self.header_ids + [t for turn in turn_ids.get(job.key.user_id, [])[start:source] for t in turn]
            groups.append(EncodingGroup(context, [FactSpec(job.key, token_ids, len(context))]))
        return groups

    def shared(self, jobs: Sequence[FactJob],
               turns_by_user: Mapping[str, Sequence[ConversationTurn]]) -> list[EncodingGroup]:
        """One group per (user, window start): the anchor's turns once, every fact on its own prefix of them."""
        turn_ids = {user: self._turn_ids(turns) for user, turns in turns_by_user.items()}
        by_anchor: dict[tuple[str, int], list[tuple[FactJob, list[int], int]]] = defaultdict(list)
        for job, token_ids, start, source in self._windows(jobs, turns_by_user, turn_ids):
            anchor_user = job.key.user_id if source > start else ""  # header-only facts share across users
            by_anchor[(anchor_user, start if anchor_user else 0)].append((job, token_ids, source))
        groups: list[EncodingGroup] = []
        for (user, start), members in by_anchor.items():
            members.sort(key=lambda member: member[2])
            prefix_lengths = [len(self.header_ids)]  # prefix_lengths[j]: header + turns[start : start + j]
            context = list(self.header_ids)
            for turn in turn_ids.get(user, [])[start : members[-1][2]] if user else []:
                context.extend(turn)
                prefix_lengths.append(len(context))
            group = EncodingGroup(context)
            fact_tokens = 0
            for job, token_ids, source in members:
                # The cap bounds the facts a group adds to its context (which is paid once per group): counting
                # the context too would give every fact its own forward once the context alone exceeds the cap.
                if group.facts and fact_tokens + len(token_ids) > self.max_group_tokens:
                    groups.append(group)
                    group, fact_tokens = EncodingGroup(context), 0
                fact_tokens += len(token_ids)
                visible = prefix_lengths[source - start] if user else len(self.header_ids)
                group.facts.append(FactSpec(job.key, token_ids, visible))
            groups.append(group)
        return groups
