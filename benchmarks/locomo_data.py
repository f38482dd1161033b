"""LoCoMo conversations as the memory service's inputs: turns, observation facts with their source turns, and QA.

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


def load_locomo(path: Path = DEFAULT_LOCOMO,
                categories: tuple[int, ...] = tuple(CATEGORIES)) -> list[LocomoConversation]:
    """Every sample of a LoCoMo file: turns in chronological order (seq), facts stamped with their session's date,
    and the questions of the given categories (5, adversarial, has no gold answer of the same kind)."""
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
        for number, _ in sessions:
            by_speaker = sample["observation"].get(f"session_{number}_observation", {})
            for speaker, items in by_speaker.items():
                for text, source in items:
                    sources = evidence_ids(source if isinstance(source, list) else [source])
                    source_id = next((s for s in sources if s in date_of_turn), "")
                    message = pb.FactInput(fact_id=f"obs-{number}-{len(facts)}", text=text, source_turn_id=source_id,
                                           metadata={"speaker": speaker})
                    if source_id:
                        message.timestamp.FromDatetime(date_of_turn[source_id])
                    facts.append(message)
        questions = [
            LocomoQuestion(f"{sample['sample_id']}-q{index}", qa["question"], str(qa["answer"]),
                           evidence_ids(qa.get("evidence", [])), int(qa["category"]))
            for index, qa in enumerate(sample["qa"]) if int(qa["category"]) in categories and "answer" in qa
        ]
        conversations.append(LocomoConversation(sample["sample_id"], turns, facts, questions))
    return conversations
