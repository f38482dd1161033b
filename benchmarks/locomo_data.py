"""LoCoMo conversations as the memory service's inputs: turns, facts (LoCoMo's observations with their source turns,
or the turns themselves) and QA.

The data is evaluation data that the project does not ship; callers pass its path (default below).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from inferscale.v1 import memory_pb2 as pb

DEFAULT_LOCOMO = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "locomo" / "locomo-dev6.json"
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
FACT_SETS = ("observations", "turns", "both")
_DIA_ID = re.compile(r"D\d+:\d+")
_SESSION = re.compile(r"session_(\d+)$")


@dataclass(frozen=True)
class LocomoQuestion:
    question_id: str
    question: str
    answer: str
    evidence: tuple[str, ...]
    category: int


@dataclass(frozen=True)
class LocomoConversation:
    sample_id: str
    turns: list[pb.Turn]
    facts: list[pb.FactInput]
    questions: list[LocomoQuestion]
    # fact_id -> every turn the fact cites, its source_turn_id first (a FactInput holds only that one).
    fact_sources: dict[str, tuple[str, ...]]

    def coverage(self, question: LocomoQuestion) -> float | None:
        """Share of the question's evidence turns that some fact cites: the recall no retrieval of these facts can
        pass (None without evidence)."""
        if not question.evidence:
            return None
        cited = {turn for sources in self.fact_sources.values() for turn in sources}
        return sum(turn in cited for turn in question.evidence) / len(question.evidence)


def parse_session_date(text: str) -> datetime:
    """LoCoMo's session dates ("1:56 pm on 8 May, 2023"), as UTC."""
    return datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC)


def evidence_ids(raw: list[str]) -> tuple[str, ...]:
    """Turn ids of a question's evidence; tolerates the malformed entries ("D8:6; D9:17", "D:11:26" → "D11:26")."""
    ids: list[str] = []
    for item in raw:
        for match in _DIA_ID.findall(str(item).replace("D:", "D")):
            if match not in ids:
                ids.append(match)
    return tuple(ids)


def turn_text(turn: dict) -> str:
    caption = turn.get("blip_caption")
    return f"{turn['text']} [shares a photo: {caption}]" if caption else turn["text"]


def load_locomo(path: Path = DEFAULT_LOCOMO, categories: tuple[int, ...] = tuple(CATEGORIES),
                fact_set: str = "observations") -> list[LocomoConversation]:
    """Every sample of a LoCoMo file: turns in chronological order (seq), facts stamped with their session's date,
    and the questions of the given categories (5, adversarial, has no gold answer of the same kind).

    fact_set "observations": LoCoMo's observations, each citing the turns it was drawn from (source_turn_id: the
    first); "turns": every turn as a fact ("<speaker>: <text>", its own source); "both": the two together."""
    if fact_set not in FACT_SETS:
        raise ValueError(f"fact_set: one of {FACT_SETS}, not {fact_set!r}")
    conversations = []
    for sample in json.loads(Path(path).read_text()):
        dialogue = sample["conversation"]
        sessions = sorted((int(m.group(1)), key) for key in dialogue if (m := _SESSION.match(key)))
        turns: list[pb.Turn] = []
        date_of_turn: dict[str, datetime] = {}
        for _, key in sessions:
            date = parse_session_date(dialogue[f"{key}_date_time"])
            for turn in dialogue[key]:
                message = pb.Turn(turn_id=turn["dia_id"], seq=len(turns), session_id=key, speaker=turn["speaker"],
                                  text=turn_text(turn))
                message.timestamp.FromDatetime(date)
                turns.append(message)
                date_of_turn[turn["dia_id"]] = date
        facts: list[pb.FactInput] = []
        fact_sources: dict[str, tuple[str, ...]] = {}
        if fact_set in ("observations", "both"):
            facts, fact_sources = observation_facts(sample["observation"], sessions, date_of_turn)
        if fact_set in ("turns", "both"):
            more_facts, more_sources = turn_facts(turns)
            facts, fact_sources = [*facts, *more_facts], {**fact_sources, **more_sources}
        questions = [
            LocomoQuestion(f"{sample['sample_id']}-q{index}", qa["question"], str(qa["answer"]),
                           evidence_ids(qa.get("evidence", [])), int(qa["category"]))
            for index, qa in enumerate(sample["qa"]) if int(qa["category"]) in categories and "answer" in qa
        ]
        conversations.append(LocomoConversation(sample["sample_id"], turns, facts, questions, fact_sources))
    return conversations


def observation_facts(observations: dict, sessions: list[tuple[int, str]], date_of_turn: dict[str, datetime]
                      ) -> tuple[list[pb.FactInput], dict[str, tuple[str, ...]]]:
    """LoCoMo's observations as facts stamped with their first source turn's date, and each one's source turns
    (those of the conversation it cites, in order)."""
    facts: list[pb.FactInput] = []
    fact_sources: dict[str, tuple[str, ...]] = {}
    for number, _ in sessions:
        for speaker, items in observations.get(f"session_{number}_observation", {}).items():
            for text, source in items:
                cited = evidence_ids(source if isinstance(source, list) else [source])
                sources = tuple(turn for turn in cited if turn in date_of_turn)
                message = pb.FactInput(fact_id=f"obs-{number}-{len(facts)}", text=text,
                                       source_turn_id=sources[0] if sources else "", metadata={"speaker": speaker})
                if sources:
                    message.timestamp.FromDatetime(date_of_turn[sources[0]])
                facts.append(message)
                fact_sources[message.fact_id] = sources
    return facts, fact_sources


def turn_facts(turns: list[pb.Turn]) -> tuple[list[pb.FactInput], dict[str, tuple[str, ...]]]:
    """Every turn as a fact ("<speaker>: <text>", the text with its photo caption), stamped with its session's date,
    its own source."""
    facts = []
    for turn in turns:
        message = pb.FactInput(fact_id=f"turn-{turn.turn_id}", text=f"{turn.speaker}: {turn.text}",
                               source_turn_id=turn.turn_id, metadata={"speaker": turn.speaker})
        message.timestamp.CopyFrom(turn.timestamp)
        facts.append(message)
    return facts, {fact.fact_id: (fact.source_turn_id,) for fact in facts}
