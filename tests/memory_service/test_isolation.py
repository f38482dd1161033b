"""No call for one user ever returns another user's facts (25 users, unique markers)."""

from concurrent.futures import ThreadPoolExecutor

from inferscale.v1 import memory_pb2 as pb
from inferscale_kv.profile import kv_profile_id
from tests.stacks import Users

user = Users(__name__)
USERS = [user(f"iso-user-{i:02d}") for i in range(25)]
TOPICS = ["hiking trip", "favourite food", "pet", "job", "hometown", "hobby"]


def _marker(user_id: str) -> str:
    return f"MARK{user_id.replace('-', '')}"


def _ingest_all(stub) -> None:
    def ingest(user_id: str) -> None:
        facts = [
            # Identical wording across users: only the marker tells them apart, so ranking can't.
            pb.FactInput(fact_id=f"t{i}", text=f"{_marker(user_id)} talked about their {topic}.")
            for i, topic in enumerate(TOPICS)
        ]
        stub.IngestFacts(pb.IngestFactsRequest(user_id=user_id, facts=facts))

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(ingest, USERS))


def test_search_list_and_retrieve_return_only_the_callers_facts(stub) -> None:
    _ingest_all(stub)
    profile = pb.KvProfile(model="m", model_hash="h", kv_dtype="float32", tokenizer_hash="t", header_hash="h",
                           recipe="r", recipe_version=1)
    profile.profile_id = kv_profile_id(profile)

    def audit(user_id: str) -> list[str]:
        leaks: list[str] = []
        other = USERS[(USERS.index(user_id) + 1) % len(USERS)]
        searched = stub.SearchFacts(pb.SearchFactsRequest(user_id=user_id, query=f"{_marker(other)} pet", top_k=50))
        texts = [scored.fact.text for scored in searched.facts]
        texts += [fact.text for fact in stub.ListFacts(pb.ListFactsRequest(user_id=user_id)).facts]
        retrieved = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
            user_id=user_id, query=f"{_marker(other)} job", top_k=50, profile=profile, node_id="n"))
        texts += [fact.text for fact in retrieved.facts]
        assert len(texts) == 3 * len(TOPICS)
        leaks += [text for text in texts if not text.startswith(_marker(user_id) + " ")]
        return leaks

    with ThreadPoolExecutor(max_workers=8) as pool:
        leaks = [leak for user_leaks in pool.map(audit, USERS) for leak in user_leaks]
    assert leaks == []


def test_deleting_one_user_leaves_every_other_user_intact(stub) -> None:
    _ingest_all(stub)
    stub.DeleteUser(pb.DeleteUserRequest(user_id=USERS[0]))
    assert stub.GetStats(pb.GetStatsRequest(user_id=USERS[0])).facts == 0
    for user_id in USERS[1:]:
        assert stub.GetStats(pb.GetStatsRequest(user_id=user_id)).facts == len(TOPICS)
