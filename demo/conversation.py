"""The project's sample conversation, and its conversion into IngestTurns / IngestFacts requests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from inferscale.v1 import memory_pb2 as pb

SAMPLE_PATH = Path(__file__).with_name("sample_conversation.json")


@dataclass(frozen=True)
class Question:
    question: str
    answer: str
    evidence: list[str]


@dataclass(frozen=True)
class Conversation:
    user_id: str
    turns: list[pb.Turn]
    facts: list[pb.FactInput]
    questions: list[Question]


def load_conversation(path: Path = SAMPLE_PATH, user_id: str | None = None) -> Conversation:
    """Turns are numbered chronologically; each fact carries the date of its source turn's session."""
    data = json.loads(path.read_text())
    turns: list[pb.Turn] = []
    session_date_by_turn: dict[str, str] = {}
    for session in data["sessions"]:
        for turn in session["turns"]:
            message = pb.Turn(
                turn_id=turn["turn_id"], seq=len(turns), session_id=session["session_id"],
                speaker=turn["speaker"], text=turn["text"],
            )
            message.timestamp.FromJsonString(session["date"])
            turns.append(message)
            session_date_by_turn[turn["turn_id"]] = session["date"]
    facts: list[pb.FactInput] = []
    for fact in data["facts"]:
        message = pb.FactInput(fact_id=fact["fact_id"], text=fact["text"], source_turn_id=fact["source_turn_id"])
        message.timestamp.FromJsonString(session_date_by_turn[fact["source_turn_id"]])
        facts.append(message)
    questions = [Question(q["question"], q["answer"], q["evidence"]) for q in data["questions"]]
    return Conversation(user_id or data["user_id"], turns, facts, questions)
