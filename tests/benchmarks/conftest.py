"""A LoCoMo-shaped file made by the tests (the real data is not shipped): two small conversations with the
schema's quirks (a date key without a session, a list-valued fact source, malformed evidence, category 5)."""

from __future__ import annotations

import json

import pytest


def locomo_sample(sample_id: str, pet: str) -> dict:
    return {
        "sample_id": sample_id,
        "conversation": {
            "speaker_a": "Ana", "speaker_b": "Bo",
            "session_1_date_time": "1:56 pm on 8 May, 2023",
            "session_1": [
                {"speaker": "Ana", "dia_id": "D1:1", "text": "Hi Bo, how was your week?"},
                {"speaker": "Bo", "dia_id": "D1:2", "text": f"Great, I adopted a {pet}!",
                 "blip_caption": f"a photo of a {pet}"},
            ],
            "session_2_date_time": "10:00 am on 9 June, 2023",
            "session_2": [
                {"speaker": "Ana", "dia_id": "D2:1", "text": "I started pottery classes."},
                {"speaker": "Bo", "dia_id": "D2:2", "text": "Nice, I went hiking in the Alps."},
            ],
            "session_3_date_time": "9:00 am on 1 July, 2023",
        },
        "observation": {
            "session_1_observation": {"Bo": [[f"Bo adopted a {pet} in May 2023.", "D1:2"]]},
            "session_2_observation": {
                "Ana": [["Ana started pottery classes.", ["D2:1"]]],
                "Bo": [["Bo went hiking in the Alps.", "D2:2"]],
            },
        },
        "qa": [
            {"question": "What did Bo adopt?", "answer": f"a {pet}", "evidence": ["D1:2"], "category": 4},
            {"question": "When did Ana start pottery?", "answer": 2023, "evidence": ["D2:1; D1:1"], "category": 2},
            {"question": "What did Ana adopt?", "adversarial_answer": "a cat", "evidence": [], "category": 5},
        ],
    }


@pytest.fixture
def locomo_file(tmp_path):
    path = tmp_path / "locomo-test.json"
    path.write_text(json.dumps([locomo_sample("conv-a", "dog"), locomo_sample("conv-b", "parrot")]))
    return path
