"""What the serving benchmark's modes share (benchmarks/serve.py, benchmarks/fleet.py): the contenders' memory
fields, the simulated users' workloads and their ingestion, one streamed request and its sample, a contender's
summary over its samples, and the loads' arrival times."""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.locomo_data import load_locomo
from benchmarks.stats import percentiles_ms
from benchmarks.synthetic import synthetic_facts, synthetic_queries
from inferscale.v1 import memory_pb2 as pb

# contender -> the request's memory field beside user_id and top_k
CONTENDERS: dict[str, dict] = {"kv": {"mode": "kv", "recompute_tail_facts": 0, "kv_crossover_tokens": 0},
                               "text": {"mode": "text"}, "text-stable": {"mode": "text", "order": "created"},
                               "off": {"mode": "off"}}


@dataclass
class Sample:
    contender: str
    k: int
    query_to_first_token_s: float
    ttft_s: float  # query-to-first-token minus the node's memory step (RetrieveAndStage)
    tpot_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int  # injected by the connector or reused from vLLM's prefix cache
    memory_lost: str | None = None  # why the answer lacks the memory its contender asked for (None: it has it)
    memory_step_s: float = 0.0  # the node's RetrieveAndStage, as its x-inferscale-memory reports it
    prefilled: bool = False  # kv: planned for injection, but vLLM prefilled (part of) it: the node did not load it all
    served_as_text: bool = False  # kv-auto: the node's crossover served the memory as text


def prefilled_instead(summary: dict, memory: dict, cached_tokens: int | None) -> bool:
    """A kv request whose plan's injectable tokens vLLM did not all take from the connector (`cached_tokens`, vLLM's
    count of prompt tokens it did not compute, below them): the node fell back, or its miss policy served the
    request's resident prefix and had vLLM prefill the rest."""
    if memory.get("mode", "kv") != "kv" or summary.get("served_as") == "text" or cached_tokens is None:
        return False
    return cached_tokens < summary.get("injectable_tokens", 0)


def memory_lost(summary: dict, memory: dict, expected_facts: int, cached_tokens: int | None = None,
                prefilled_ok: bool = False) -> str | None:
    """Why a request came back without the memory its contender asked for, read off the node's x-inferscale-memory
    summary: the memory dropped (the memory service failed or was late), fewer facts than the user's top-k, or in kv
    mode facts served as text that the contender wanted injected, or planned for injection but prefilled by vLLM
    (`cached_tokens`, vLLM's count of prompt tokens it did not compute, below the plan's injectable tokens: the
    connector fell back), unless `prefilled_ok` (a node whose miss policy may prefill: counted apart, see
    `prefilled_instead`). None: the request has its memory as asked."""
    mode = memory.get("mode", "kv")
    if mode == "off":
        return None
    if summary.get("memory") == "dropped" or summary.get("error"):
        return summary.get("error") or f"memory dropped ({summary.get('reason')})"
    facts = summary.get("facts", 0)
    if facts < expected_facts:
        return f"{facts} of {expected_facts} facts"
    if mode == "kv" and summary.get("served_as") != "text":  # kv-auto may serve a memory below the crossover as text
        if summary.get("header_kv") == "missing":
            return "no header KV: nothing injected"
        wanted = max(expected_facts - memory.get("recompute_tail_facts", 0), 0)
        if summary.get("kv_facts", 0) < wanted:
            return f"{summary.get('kv_facts', 0)} of {wanted} facts injected"
        injectable = summary.get("injectable_tokens", 0)
        if not prefilled_ok and cached_tokens is not None and cached_tokens < injectable:
            return f"{cached_tokens} of {injectable} injectable tokens loaded (prefilled instead)"
    return None


def one_request(client, model: str, user: str, question: str, memory: dict, k: int, max_tokens: int,
                contender: str = "", expected_facts: int = 0, prefilled_ok: bool = False) -> Sample:
    """One streamed chat request; `expected_facts`: the facts the user's memory holds for it (min(k, facts));
    `prefilled_ok`: a kv memory prefilled instead of loaded is counted (Sample.prefilled), not lost."""
    started = time.perf_counter()
    first = None
    chunks = 0
    usage = None
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True},
        extra_body={"memory": {"user_id": user, "top_k": k, **memory}, "ignore_eos": True},
    ) as response:
        summary = json.loads(response.headers.get("x-inferscale-memory", "{}"))
        for chunk in response.parse():
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason):
                first = first or time.perf_counter()
                chunks += 1
            if chunk.usage:
                usage = chunk.usage
    end = time.perf_counter()
    first = first or end
    stage_s = summary.get("stage_ms", 0.0) / 1000
    details = usage.prompt_tokens_details if usage else None
    generated = usage.completion_tokens if usage else chunks
    cached = (details.cached_tokens or 0) if details else 0
    said_cached = cached if usage else None
    return Sample(contender, k, first - started, first - started - stage_s,
                  (end - first) / max(generated - 1, 1), end - started, usage.prompt_tokens if usage else 0,
                  cached, memory_lost(summary, memory, expected_facts, said_cached, prefilled_ok), stage_s,
                  prefilled_instead(summary, memory, said_cached),
                  memory.get("mode", "kv") == "kv" and summary.get("served_as") == "text")


def summarize(samples: list[Sample], wall_s: float) -> dict:
    """A contender's figures over the requests that kept their memory; those that lost it are counted apart
    (`lost_memory`) and never inside a latency, a prompt size or a ratio."""
    kept = [s for s in samples if s.memory_lost is None]
    lost = [s.memory_lost for s in samples if s.memory_lost is not None]
    return {
        "requests": len(kept),
        "lost_memory": len(lost),
        "lost_memory_examples": lost[:3],
        "query_to_first_token_ms": percentiles_ms([s.query_to_first_token_s for s in kept]),
        "ttft_ms": percentiles_ms([s.ttft_s for s in kept]),
        "memory_step_ms": percentiles_ms([s.memory_step_s for s in kept]),
        "tpot_ms": percentiles_ms([s.tpot_s for s in kept]),
        "throughput_rps": len(kept) / wall_s if not lost else math.nan,
        "mean_prompt_tokens": sum(s.prompt_tokens for s in kept) / len(kept) if kept else math.nan,
        "mean_cached_tokens": sum(s.cached_tokens for s in kept) / len(kept) if kept else math.nan,
        "prefilled": sum(s.prefilled for s in kept),
        "served_as_text": sum(s.served_as_text for s in kept),
    }


@dataclass(frozen=True)
class Workload:
    """Per simulated user: the facts to ingest (and turns, for LoCoMo), and the questions they ask."""

    users: list[str]
    facts: dict[str, list[pb.FactInput]]
    turns: dict[str, list[pb.Turn]]
    questions: dict[str, list[str]]
    source: str

    def second_questions(self, jobs: list[tuple[str, str]], rng: random.Random) -> list[tuple[str, str]]:
        """The same users as `jobs`, each asked another of its questions than the one it was asked there (so that
        retrieval picks other facts)."""
        asked: dict[str, set[str]] = {}
        for user, question in jobs:
            asked.setdefault(user, set()).add(question)
        seconds = []
        for user, question in jobs:
            others = [q for q in self.questions[user] if q not in asked[user]] or [
                q for q in self.questions[user] if q != question]
            if not others:
                raise ValueError(f"{user}: no other question to ask")
            seconds.append((user, rng.choice(others)))
            asked[user].add(seconds[-1][1])
        return seconds

    def jobs(self, count: int, rng: random.Random, users: list[str] | None = None) -> list[tuple[str, str]]:
        """`count` (user, question) pairs, users round-robin, each user's questions in a shuffled order without
        repeats until they run out (a repeat would find its whole prompt in vLLM's prefix cache)."""
        users = users or self.users
        queues: dict[str, list[str]] = {user: [] for user in users}
        jobs = []
        for user in itertools.islice(itertools.cycle(users), count):
            if not queues[user]:
                queues[user] = rng.sample(self.questions[user], len(self.questions[user]))
            jobs.append((user, queues[user].pop()))
        return jobs

    def warm_up_questions(self, user: str, count: int, seed: int) -> list[str]:
        """Questions none of the user's measured ones: they bring the user's facts into the node cache without
        putting a measured prompt into vLLM's prefix cache."""
        asked = set(self.questions[user])
        return [q for q in synthetic_queries(count * 4 + 8, seed) if q not in asked][:count]


def synthetic_workload(users: int, facts_per_user: int, clauses: int, prefix: str = "bench-user") -> Workload:
    names = [f"{prefix}-{i}" for i in range(users)]
    return Workload(
        names, {user: [pb.FactInput(text=t) for t in synthetic_facts(facts_per_user, 1000 + n, clauses)]
                for n, user in enumerate(names)},
        {}, {user: synthetic_queries(32, seed=5 + n) for n, user in enumerate(names)},
        f"synthetic facts ({clauses} clause(s) each)")


def locomo_workload(path: Path, users: int, facts_per_user: int | None) -> Workload:
    """User i replays LoCoMo conversation i mod 6 (its first `facts_per_user` observations, all when None, and its
    questions)."""
    conversations = load_locomo(path)
    names, facts, turns, questions = [], {}, {}, {}
    for i in range(users):
        conversation = conversations[i % len(conversations)]
        user = f"bench-{conversation.sample_id}-{i}"
        names.append(user)
        facts[user] = conversation.facts[:facts_per_user]
        turns[user] = conversation.turns
        questions[user] = [q.question for q in conversation.questions]
    return Workload(names, facts, turns, questions, f"LoCoMo ({path.name}) observations and questions")


def ingest(stub, workload: Workload) -> None:
    for user in tqdm(workload.users, desc="ingesting users", unit="user"):
        if workload.turns.get(user):
            stub.IngestTurns(pb.IngestTurnsRequest(user_id=user, turns=workload.turns[user]))
        facts = workload.facts[user]
        for begin in range(0, len(facts), 100):
            stub.IngestFacts(pb.IngestFactsRequest(user_id=user, facts=facts[begin : begin + 100]))


def arrival_offsets(count: int, rate: float, rng: random.Random) -> list[float]:
    """Open-loop arrival times (s from the start) of a Poisson process at `rate` requests/s."""
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


def run_load(ask: Callable[[tuple[str, str]], Sample], jobs: list[tuple[str, str]],
             load: str) -> tuple[list[Sample], float]:
    """The jobs at one load ("c<N>": N in flight; "r<R>": Poisson arrivals at R/s); the samples and the wall time."""
    started = time.perf_counter()
    if load.startswith("c"):
        with ThreadPoolExecutor(max_workers=int(load[1:])) as pool:
            samples = list(pool.map(ask, jobs))
    else:
        offsets = arrival_offsets(len(jobs), float(load[1:]), random.Random(len(jobs)))
        with ThreadPoolExecutor(max_workers=min(len(jobs), 256)) as pool:
            futures = []
            for offset, job in zip(offsets, jobs, strict=True):
                time.sleep(max(0.0, started + offset - time.perf_counter()))
                futures.append(pool.submit(ask, job))
            samples = [future.result() for future in futures]
    return samples, time.perf_counter() - started


def describe(load: str) -> str:
    return f"closed loop, {load[1:]} in flight" if load.startswith("c") else f"open loop, {load[1:]} requests/s"
