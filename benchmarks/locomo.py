"""LoCoMo quality evaluation: what serving memory as injected KV costs against the same facts as text.

    python -m benchmarks.locomo [--data ../shared/data/locomo/locomo-dev6.json] [--conversations 6]
        [--per-category 6] [--k 50] [--windows 0 5 20 50 -1] [--tails 1 2 5 10] [--tail-window 20]
        [--fp8-window 50] [--order-window 50] [--retrieval vector|keyword|hybrid] [--facts observations|turns|both]
    python -m benchmarks.locomo --recall-only --retrieval vector keyword hybrid [--per-category 0]

--recall-only measures retrieval alone, in every mode given (`evaluate_recall`); otherwise the one mode
given (default: the service's) retrieves the facts of every variant. What a full run does:

Ingests LoCoMo conversations (turns, and facts: LoCoMo's observations with their source turns, with --facts turns
every turn as a fact, with --facts both the two) through the real gRPC API into a real memory service, runs the real
precompute worker once per encoding (Context-Window Encoding with w preceding turns, -1 = all; float32 and fp8
storage), then for each question of a stratified subset (categories 1-4):
- retrieval recall@k of the evidence turns (a retrieved fact covers every turn it cites), k = 5, 10, 20, 50, beside
  its ceiling: the share of the evidence turns that some fact cites at all;
- the gold answer's teacher-forced NLL per token under `text` (the serving prompt prefilled) and under `kv`
  (the same prompt with its memory prefix injected: the node's own node-cache fetch and Chunked-RoPE compose over the
  KV fetched from the memory service, all but the last m facts with a recomputed tail of m); lower is better;
- greedy answers under both, scored by token F1 against the gold answer;
- per variant and category, 95% paired bootstrap intervals of kv - text for NLL and F1 (the same questions,
  resampled together), so that a difference is read with its noise.
Text is scored once per exact prompt (token ids): variants whose prompts are equal share it. With w > 0, kv sees
conversation turns text never sees: kv - text is then what the encoding gains or loses, not a fidelity gap.
The prompt is the inference node's (its middleware's memory block, best fact last, the connector's provable
prefix); the model runs in this process (transformers, fp32), so NLLs are exact and comparable. Results are
cached per (variant, question) in the output folder, so an interrupted run resumes; the memory service keeps
its data there too (an output folder holds one --facts set). Writes report.md, results.json and PNGs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import re
import string
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.locomo_data import (
    CATEGORIES,
    DEFAULT_LOCOMO,
    FACT_SETS,
    LocomoConversation,
    LocomoQuestion,
    load_locomo,
)
from inferscale.v1 import memory_pb2 as pb
from inferscale.v1 import memory_pb2_grpc

ANSWER_INSTRUCTION = "Answer the question in a few words, using the facts you remember."
RECALL_AT = (5, 10, 20, 50)


@dataclass(frozen=True)
class Variant:
    """One way of serving the memory: its encoding (profile), the facts' order in the prompt and how many of the
    facts nearest the question are prefilled instead of injected (the node's --recompute-tail-facts)."""

    name: str
    context_window: int
    kv_dtype: str = "float32"
    order: str = "ranked"  # ranked: best fact last (the node's layout); chronological: by source turn
    tail: int = 0

    @property
    def profile_key(self) -> tuple[int, str]:
        return self.context_window, self.kv_dtype


def window_name(window: int) -> str:
    return "w=all" if window == -1 else f"w={window}"


def build_variants(windows: Sequence[int], fp8_window: int | None, order_window: int | None,
                   tails: Sequence[int] = (), tail_window: int | None = None) -> list[Variant]:
    """Each window with no tail, then each tail m at `tail_window`, then the fp8 and chronological variants."""
    variants = [Variant(window_name(w), w) for w in windows]
    if tail_window is not None:
        variants += [Variant(f"{window_name(tail_window)} tail={m}", tail_window, tail=m) for m in tails if m]
    if fp8_window is not None:
        variants.append(Variant(f"{window_name(fp8_window)} fp8", fp8_window, "fp8_e4m3"))
    if order_window is not None:
        variants.append(Variant(f"{window_name(order_window)} chronological", order_window, order="chronological"))
    return variants


# ---------------------------------------------------------------------------------------------- metrics

def normalize_answer(text: str) -> list[str]:
    """SQuAD-style: lower case, no punctuation, no articles, split on white space."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def token_f1(prediction: str, gold: str) -> float:
    predicted, expected = normalize_answer(prediction), normalize_answer(gold)
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def recall_at(ranked_sources: Sequence[Sequence[str]], evidence: Sequence[str], k: int) -> float | None:
    """Share of the evidence turns that the top-k facts cite (ranked_sources[i]: the turns the i-th fact cites;
    None without evidence)."""
    if not evidence:
        return None
    covered = {turn for sources in ranked_sources[:k] for turn in sources}
    return sum(turn in covered for turn in evidence) / len(evidence)


def stratified_subset(questions: Sequence[LocomoQuestion], per_category: int | None, seed: int) -> list[LocomoQuestion]:
    """Up to `per_category` questions of each category (all when None), drawn with a fixed seed, in input order."""
    if per_category is None:
        return list(questions)
    rng = random.Random(seed)
    by_category: dict[int, list[LocomoQuestion]] = defaultdict(list)
    for question in questions:
        by_category[question.category].append(question)
    chosen = {q.question_id for qs in by_category.values() for q in rng.sample(qs, min(per_category, len(qs)))}
    return [q for q in questions if q.question_id in chosen]


def answer_nll(logits: torch.Tensor, answer_ids: Sequence[int]) -> float:
    """Mean NLL per token (nats) of the answer; row i of `logits` [len(answer), vocab] predicts answer token i."""
    scores = torch.log_softmax(logits.float(), dim=-1)
    return float(-scores[torch.arange(len(answer_ids)), torch.tensor(answer_ids)].mean())


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def paired_bootstrap(differences: Sequence[float], resamples: int = 2000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the mean of paired differences (questions resampled with replacement); NaNs
    without differences."""
    import numpy as np

    if not differences:
        return float("nan"), float("nan")
    values = np.asarray(differences, dtype=float)
    picks = np.random.default_rng(seed).integers(0, len(values), size=(resamples, len(values)))
    means = values[picks].mean(axis=1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(means, tail)), float(np.percentile(means, 100 - tail))


# ---------------------------------------------------------------------------------------------- the model side

class Evaluator:
    """Scores one prompt under text prefill and under injected KV with one HF model (fp32, this process)."""

    def __init__(self, model_dir: Path, memory_service: str, max_new_tokens: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from inference_node.connector.kv_source import kv_source
        from inference_node.connector.node_cache import NodeKvCache
        from inference_node.connector.residency import KvResidency
        from inference_node.settings import NodeSettings
        from inferscale_kv.layout import memory_header_ids
        from inferscale_kv.rope import RotaryTables
        from inferscale_kv.shape import KvShape

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        self.header_ids = memory_header_ids(self.tokenizer)
        tables = RotaryTables.from_model(self.model, self.model.config.max_position_embeddings)
        self.cos, self.sin = tables.cos, tables.sin
        settings = NodeSettings(memory_service=memory_service, node_id="locomo-eval", model_dir=str(model_dir),
                                fetch_timeout_s=120.0)
        self.residency = KvResidency(NodeKvCache(), NodeKvCache(), kv_source(settings, self.model.config),
                                     KvShape.from_config(self.model.config))
        self.max_new_tokens = max_new_tokens
        self.stop_ids = {self.tokenizer.eos_token_id, self.tokenizer.convert_tokens_to_ids("<|im_end|>")}

    def prompt(self, facts: list[pb.RetrievedFact], header_content_id: str, question: str, profile_id: str,
               user_id: str, order_key, tail: int = 0):
        """The node's prompt (its middleware's memory block and load plan) with the facts in `order_key` order and
        the last `tail` of them left to prefill."""
        from inference_node.memory_prompt import FactLines, plan_memory, system_content
        from inferscale_kv.stored_text import StoredTextGuard

        plan = plan_memory(facts, self.header_ids, header_content_id, profile_id, user_id, order_key, tail,
                           lines=FactLines(StoredTextGuard.for_tokenizer(self.tokenizer)))
        messages = [{"role": "system", "content": system_content(plan.block_text, "")},
                    {"role": "user", "content": f"{ANSWER_INSTRUCTION}\n{question}"}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False)), plan

    def injected_past(self, prompt_ids: list[int], plan, profile_id: str, user_id: str):
        """The connector's claim on this prompt and the KV it would write: (claimed tokens, DynamicCache)."""
        from transformers import DynamicCache

        from inference_node.connector.compose import ChunkSlice, compose_prefix
        from inference_node.plan import provable_prefix

        proof = provable_prefix(prompt_ids, plan.plan, profile_id)
        end, chunks = proof.end, proof.chunks
        if not end:
            raise LookupError("the connector would claim nothing of this prompt")
        self.residency.fetch(user_id, chunks, torch.device("cpu"), torch.float32, None)
        slices = [ChunkSlice(e.keys, e.values, 0, min(len(c.token_ids), end - c.offset))
                  for c, e in zip(chunks, self.residency.resident(chunks), strict=True) if c.offset < end]
        layers = self.model.config.num_hidden_layers
        keys, values = compose_prefix(slices, 0, self.cos, self.sin, layers, fused=False)
        cache = DynamicCache()
        for layer in range(layers):
            cache.update(keys[layer].transpose(0, 1)[None], values[layer].transpose(0, 1)[None], layer)
        return end, cache

    @torch.no_grad()
    def score(self, prompt_ids: list[int], answer: str, past=None, start: int = 0) -> tuple[float, str]:
        """(gold answer NLL per token, greedy answer) after prefilling prompt_ids[start:] behind `past` (the KV
        of prompt_ids[:start]), or the whole prompt when there is no past."""
        import copy

        from transformers import DynamicCache

        if past is None:
            past, start = DynamicCache(), 0
        last = self._forward(prompt_ids[start:], start, past)[-1]  # past now holds the whole prompt
        answer_ids = list(self.tokenizer.encode(" " + answer.strip(), add_special_tokens=False))
        branch = copy.deepcopy(past)
        forced = self._forward(answer_ids[:-1], len(prompt_ids), branch) if len(answer_ids) > 1 else last[None][:0]
        nll = answer_nll(torch.cat([last[None], forced]), answer_ids)
        generated: list[int] = []
        next_id, position = int(last.argmax()), len(prompt_ids)
        while next_id not in self.stop_ids and len(generated) < self.max_new_tokens:
            generated.append(next_id)
            next_id = int(self._forward([next_id], position, past)[-1].argmax())
            position += 1
        greedy = self.tokenizer.decode(generated, skip_special_tokens=True)
        assert isinstance(greedy, str)  # one sequence decodes to one string
        return nll, greedy.strip()

    def _forward(self, token_ids: list[int], start: int, past) -> torch.Tensor:
        """Logits [len(token_ids), vocab] of tokens at positions start, start + 1, ... behind `past` (extended)."""
        positions = torch.arange(start, start + len(token_ids))[None]
        return self.model(torch.tensor([token_ids]), position_ids=positions, past_key_values=past,
                          use_cache=True).logits[0]


# ---------------------------------------------------------------------------------------------- the run

class ResultCache:
    """One JSON line per finished (variant, question): a rerun skips what is there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[tuple[str, str], dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    row = json.loads(line)
                    self.rows[(row["variant"], row["question_id"])] = row

    def get(self, variant: str, question_id: str) -> dict | None:
        return self.rows.get((variant, question_id))

    def put(self, row: dict) -> None:
        self.rows[(row["variant"], row["question_id"])] = row
        with self.path.open("a") as out:
            out.write(json.dumps(row) + "\n")


def claim_output(output: Path, fact_set: str) -> None:
    """Marks `output` as a run over `fact_set`; SystemExit where it holds a run over another (its memory service's
    facts and cached results would mix in)."""
    marker = output / "facts.txt"
    if marker.exists() and marker.read_text().strip() != fact_set:
        raise SystemExit(f"--output {output}: holds a run with --facts {marker.read_text().strip()}, not {fact_set}: "
                         "pass another --output")
    output.mkdir(parents=True, exist_ok=True)
    marker.write_text(fact_set + "\n")


def ingest(stub, conversations: list[LocomoConversation]) -> None:
    for conversation in tqdm(conversations, desc="ingesting conversations", unit="conv"):
        stub.IngestTurns(pb.IngestTurnsRequest(user_id=conversation.sample_id, turns=conversation.turns))
        for begin in range(0, len(conversation.facts), 100):
            stub.IngestFacts(pb.IngestFactsRequest(user_id=conversation.sample_id,
                                                   facts=conversation.facts[begin : begin + 100]))


def precompute(stub, address: str, model_dir: Path, variant: Variant, total: int, log_path: Path) -> pb.KvProfile:
    """Runs the real worker for the variant's profile until every fact has KV (skipped when a previous run did)."""
    from transformers import AutoTokenizer

    from inferscale_kv.model_profile import build_model_profile
    from precompute_worker.worker import profile_message

    profile = build_model_profile(model_dir, AutoTokenizer.from_pretrained(model_dir), variant.kv_dtype,
                                  variant.context_window)
    done = _done(stub, profile.profile_id)
    if done < total:
        with log_path.open("ab") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "precompute_worker", "--memory-service", address, "--model", str(model_dir),
                 "--context-window", str(variant.context_window), "--kv-dtype", variant.kv_dtype,
                 "--exit-when-idle"], stdout=log, stderr=subprocess.STDOUT)
            with tqdm(total=total, initial=done, desc=f"fact KV, {window_name(variant.context_window)} "
                                                       f"{variant.kv_dtype}", unit="fact") as progress:
                while worker.poll() is None:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        worker.wait(timeout=1.0)
                    now = _done(stub, profile.profile_id)
                    progress.update(now - progress.n)
            if worker.returncode:
                raise RuntimeError(f"precompute worker failed ({worker.returncode}): see {log_path}")
    return profile_message(profile)


def _done(stub, profile_id: str) -> int:
    stats = stub.GetStats(pb.GetStatsRequest())
    return next((p.done for p in stats.profiles if p.profile_id == profile_id), 0)


def order_key(order: str, seq_of_fact: dict[str, int]):
    """ranked: best last (the node's order); chronological: by the source turn's position in the conversation."""
    from inference_node.memory_prompt import by_rank_descending

    if order == "chronological":
        return lambda fact: seq_of_fact.get(fact.fact_id, 0)
    return by_rank_descending


def score_question(evaluator: Evaluator, stub, profile: pb.KvProfile, conversation: LocomoConversation,
                   question: LocomoQuestion, variant: Variant, k: int, text_scores: dict, retrieval: int) -> dict:
    """One (variant, question) result: retrieval recall, text and kv NLL of the gold answer, greedy answers.
    `text_scores` holds the question's text scores per exact prompt (token ids); `retrieval` is the RetrievalMode."""
    user_id, profile_id = conversation.sample_id, profile.profile_id
    response = stub.RetrieveAndStage(pb.RetrieveAndStageRequest(
        user_id=user_id, query=question.question, top_k=k, profile=profile, node_id="locomo-eval",
        retrieval=retrieval))
    facts = list(response.facts)
    seq_of_turn = {turn.turn_id: turn.seq for turn in conversation.turns}
    seq_of_fact = {fact.fact_id: seq_of_turn.get(fact.source_turn_id, 0) for fact in conversation.facts}
    ranked_sources = [conversation.fact_sources.get(fact.fact_id, ()) for fact in sorted(facts, key=lambda f: f.rank)]
    prompt_ids, plan = evaluator.prompt(facts, response.header_content_id, question.question, profile_id, user_id,
                                        order_key(variant.order, seq_of_fact), variant.tail)
    prompt_key = tuple(prompt_ids)
    if prompt_key not in text_scores:
        text_scores[prompt_key] = evaluator.score(prompt_ids, question.answer)
    text_nll, text_answer = text_scores[prompt_key]
    end, past = evaluator.injected_past(prompt_ids, plan, profile_id, user_id)
    kv_nll, kv_answer = evaluator.score(prompt_ids, question.answer, past, end)
    return {"variant": variant.name, "question_id": question.question_id, "category": question.category,
            "question": question.question, "gold": question.answer, "prompt_tokens": len(prompt_ids),
            "injected_tokens": end,
            "recall": {str(at): recall_at(ranked_sources, question.evidence, at) for at in RECALL_AT},
            "ceiling": conversation.coverage(question),
            "text_nll": text_nll, "kv_nll": kv_nll, "text_answer": text_answer, "kv_answer": kv_answer,
            "text_f1": token_f1(text_answer, question.answer), "kv_f1": token_f1(kv_answer, question.answer)}


def evaluate(args: argparse.Namespace) -> dict:
    from demo.smollm2 import build_smollm2
    from harness.memory_service import MemoryServiceProcess
    conversations = load_locomo(args.data, fact_set=args.facts)[: args.conversations]
    questions = {c.sample_id: stratified_subset(c.questions, args.per_category, args.seed) for c in conversations}
    variants = build_variants(args.windows, args.fp8_window, args.order_window, args.tails, args.tail_window)
    model_dir = (args.model or build_smollm2()).resolve()
    args.output.mkdir(parents=True, exist_ok=True)
    cache = ResultCache(args.output / "per_question.jsonl")
    service = MemoryServiceProcess(args.output / "memory-service", args.output / "memory_service.log").start()
    try:
        with service.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            ingest(stub, conversations)
            total = sum(len(c.facts) for c in conversations)
            profiles: dict[tuple[int, str], pb.KvProfile] = {}
            for variant in variants:
                if variant.profile_key not in profiles:
                    profiles[variant.profile_key] = precompute(stub, service.address, model_dir, variant, total,
                                                               args.output / "worker.log")
            evaluator = Evaluator(model_dir, service.address, args.max_new_tokens)
            retrieval = RETRIEVAL_MODES[args.retrieval[0]] if args.retrieval else pb.RETRIEVAL_MODE_UNSPECIFIED
            work = [(c, q) for c in conversations for q in questions[c.sample_id]]
            with tqdm(total=len(work) * len(variants), desc="questions x variants", unit="eval") as progress:
                for conversation, question in work:
                    text_scores: dict[tuple[int, ...], tuple[float, str]] = {}  # per exact prompt
                    for variant in variants:
                        if not cache.get(variant.name, question.question_id):
                            cache.put(score_question(evaluator, stub, profiles[variant.profile_key], conversation,
                                                     question, variant, args.k, text_scores, retrieval))
                        progress.update()
    finally:
        service.stop()
    chosen = {q.question_id for qs in questions.values() for q in qs}
    rows = [row for row in cache.rows.values() if row["question_id"] in chosen]
    return {"variants": [asdict(v) for v in variants], "summary": summarize(rows, variants), "rows": len(rows),
            "conversations": [c.sample_id for c in conversations], "k": args.k, "model": model_dir.name,
            "retrieval": args.retrieval[0] if args.retrieval else DEFAULT_RETRIEVAL, "facts": args.facts}


def summarize(rows: list[dict], variants: list[Variant]) -> dict:
    """Per variant, per category and overall: mean NLLs and F1s, kv - text for both with its 95% paired bootstrap
    interval, recall@k and its ceiling (rows cached before the ceiling was recorded count nowhere in it)."""
    summary: dict[str, dict] = {}
    for variant in variants:
        mine = [row for row in rows if row["variant"] == variant.name]
        groups = {str(c): [r for r in mine if r["category"] == c] for c in CATEGORIES} | {"overall": mine}
        summary[variant.name] = {}
        for group, members in groups.items():
            recall = {k: mean([r["recall"][k] for r in members if r["recall"][k] is not None]) for k in
                      map(str, RECALL_AT)}
            ceiling = mean([r["ceiling"] for r in members if r.get("ceiling") is not None])
            nll_gaps = [r["kv_nll"] - r["text_nll"] for r in members]
            f1_gaps = [r["kv_f1"] - r["text_f1"] for r in members]
            summary[variant.name][group] = {
                "questions": len(members), "text_nll": mean([r["text_nll"] for r in members]),
                "kv_nll": mean([r["kv_nll"] for r in members]), "gap": mean(nll_gaps),
                "gap_ci": paired_bootstrap(nll_gaps), "text_f1": mean([r["text_f1"] for r in members]),
                "kv_f1": mean([r["kv_f1"] for r in members]), "f1_gap": mean(f1_gaps),
                "f1_gap_ci": paired_bootstrap(f1_gaps), "recall": recall, "ceiling": ceiling}
    return summary


# ------------------------------------------------------------------------------- recall per retrieval mode

RETRIEVAL_MODES = {"vector": pb.RETRIEVAL_MODE_VECTOR, "keyword": pb.RETRIEVAL_MODE_KEYWORD,
                   "hybrid": pb.RETRIEVAL_MODE_HYBRID}
DEFAULT_RETRIEVAL = "the service's default"
COMPARED_AT = (20, 50)  # the recall@k each mode is compared with the first at


def ranked_sources(stub: memory_pb2_grpc.MemoryServiceStub, conversation: LocomoConversation,
                   question: LocomoQuestion, mode: str, k: int) -> list[tuple[str, ...]]:
    """The turns each of the user's top-k facts for the question cites, best first."""
    response = stub.SearchFacts(pb.SearchFactsRequest(user_id=conversation.sample_id, query=question.question,
                                                      top_k=k, retrieval=RETRIEVAL_MODES[mode]))
    return [conversation.fact_sources.get(scored.fact.fact_id, ()) for scored in response.facts]


def measure_recall(stub: memory_pb2_grpc.MemoryServiceStub, work: Sequence[tuple[LocomoConversation, LocomoQuestion]],
                   modes: Sequence[str], recall_at_k: Sequence[int]) -> list[dict]:
    """One row per (mode, question with evidence): its category, recall at each k and its ceiling (the share of its
    evidence turns that some fact cites)."""
    rows = []
    for conversation, question in tqdm(work, desc="questions", unit="q"):
        if not question.evidence:
            continue
        for mode in modes:
            sources = ranked_sources(stub, conversation, question, mode, max(recall_at_k))
            rows.append({"mode": mode, "question_id": question.question_id, "category": question.category,
                         "recall": {str(k): recall_at(sources, question.evidence, k) for k in recall_at_k},
                         "ceiling": conversation.coverage(question)})
    return rows


def summarize_recall(rows: list[dict], modes: Sequence[str], recall_at_k: Sequence[int]) -> dict:
    """Per mode and category (and overall): questions, mean recall@k, its ceiling (mean share of the evidence turns
    some fact cites), and against the first mode the mean paired difference at COMPARED_AT with its 95% bootstrap
    interval."""
    baseline = {row["question_id"]: row for row in rows if row["mode"] == modes[0]}
    summary: dict[str, dict] = {}
    for mode in modes:
        mine = [row for row in rows if row["mode"] == mode]
        groups = {str(c): [r for r in mine if r["category"] == c] for c in CATEGORIES} | {"overall": mine}
        summary[mode] = {}
        for group, members in groups.items():
            entry: dict = {"questions": len(members),
                           "recall": {str(k): mean([r["recall"][str(k)] for r in members]) for k in recall_at_k},
                           "ceiling": mean([r["ceiling"] for r in members])}
            for k in COMPARED_AT:
                gaps = [r["recall"][str(k)] - baseline[r["question_id"]]["recall"][str(k)] for r in members]
                entry[f"vs_first@{k}"] = (mean(gaps), paired_bootstrap(gaps))
            summary[mode][group] = entry
    return summary


def recall_report(summary: dict, modes: Sequence[str], recall_at_k: Sequence[int], conversations: list[str],
                  fact_set: str = "observations") -> str:
    lines = [f"# LoCoMo retrieval recall of the evidence turns per retrieval mode, facts: {fact_set} "
             f"({', '.join(conversations)})", "",
             "Ceiling: the share of the evidence turns that some fact cites, which no retrieval of these facts can "
             "pass. "
             f"Each mode against {modes[0]}: mean paired difference of recall@k over the same questions, with its 95% "
             "bootstrap interval.", "",
             "| mode | category | questions | " + " | ".join(f"recall@{k}" for k in recall_at_k) + " | "
             + " | ".join(f"@{k} vs {modes[0]} [95% CI]" for k in COMPARED_AT) + " | ceiling |",
             "|---|---|---:|" + "---:|" * len(recall_at_k) + "---|" * len(COMPARED_AT) + "---:|"]
    for mode in modes:
        for group, row in summary[mode].items():
            label = f"{group} {CATEGORIES[int(group)]}" if group != "overall" else "**overall**"
            gaps = [f"{fmt(row[f'vs_first@{k}'][0], 3)} {interval(row[f'vs_first@{k}'][1], 3)}" for k in COMPARED_AT]
            lines.append(f"| {mode} | {label} | {row['questions']} | "
                         + " | ".join(fmt(row["recall"][str(k)], 3) for k in recall_at_k) + " | "
                         + " | ".join(gaps) + f" | {fmt(row['ceiling'], 3)} |")
    return "\n".join(lines) + "\n"


def evaluate_recall(data: Path, conversations_count: int, per_category: int | None, seed: int, modes: Sequence[str],
                    recall_at_k: Sequence[int], output: Path, fact_set: str = "observations") -> tuple[dict, str]:
    """Ingests the conversations (their `fact_set` as facts: locomo_data.load_locomo) into a fresh memory service
    under `output` and measures every mode: (result, markdown report)."""
    from harness.memory_service import MemoryServiceProcess

    conversations = load_locomo(data, fact_set=fact_set)[:conversations_count]
    work = [(c, q) for c in conversations for q in stratified_subset(c.questions, per_category, seed)]
    output.mkdir(parents=True, exist_ok=True)
    service = MemoryServiceProcess(output / "memory-service", output / "memory_service.log").start()
    try:
        with service.channel() as channel:
            stub = memory_pb2_grpc.MemoryServiceStub(channel)
            ingest(stub, conversations)
            rows = measure_recall(stub, work, modes, recall_at_k)
    finally:
        service.stop()
    summary = summarize_recall(rows, modes, recall_at_k)
    names = [c.sample_id for c in conversations]
    result = {"modes": list(modes), "facts": fact_set, "conversations": names, "summary": summary, "rows": rows}
    return result, recall_report(summary, modes, recall_at_k, names, fact_set)


# ---------------------------------------------------------------------------------------------- report

def fmt(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def interval(bounds: Sequence[float], digits: int = 3) -> str:
    return f"[{fmt(bounds[0], digits)}, {fmt(bounds[1], digits)}]"


def markdown_report(result: dict, plots: list[str]) -> str:
    summary = result["summary"]
    names = list(summary)
    lines = [f"# LoCoMo quality: memory as injected KV vs as text ({result['model']}, k={result['k']}, "
             f"retrieval: {result.get('retrieval', DEFAULT_RETRIEVAL)}, facts: {result.get('facts', 'observations')})",
             "",
             (f"Conversations {', '.join(result['conversations'])}; {result['rows']} (variant, question) results. "
              "NLL: the gold answer's teacher-forced negative log-likelihood per token (nats; lower is better). "
              "F1: greedy answers' token F1 against gold. kv - text with its 95% paired bootstrap interval "
              "(questions resampled together): an interval that holds 0 is no measured difference. With w > 0 kv "
              "also sees conversation turns that text does not; tail=m prefills the m facts nearest the question."),
             "", "| variant | questions | text NLL | kv NLL | kv - text NLL [95% CI] | text F1 | kv F1 | "
                 "kv - text F1 [95% CI] |", "|---|---:|---:|---:|---|---:|---:|---|"]
    for name in names:
        row = summary[name]["overall"]
        lines.append(f"| {name} | {row['questions']} | {fmt(row['text_nll'])} | {fmt(row['kv_nll'])} | "
                     f"{fmt(row['gap'])} {interval(row['gap_ci'])} | {fmt(row['text_f1'])} | {fmt(row['kv_f1'])} | "
                     f"{fmt(row['f1_gap'])} {interval(row['f1_gap_ci'])} |")
    for metric, label in (("gap", "kv - text NLL (nats/token)"), ("f1_gap", "kv - text F1")):
        lines += ["", f"{label} per category, with 95% paired bootstrap intervals:", "",
                  "| variant | " + " | ".join(f"{c} {n}" for c, n in CATEGORIES.items()) + " | overall |",
                  "|---|" + "---|" * (len(CATEGORIES) + 1)]
        for name in names:
            cells = [f"{fmt(summary[name][group][metric])} {interval(summary[name][group][metric + '_ci'], 2)}"
                     for group in [*map(str, CATEGORIES), "overall"]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    first = summary[names[0]]
    lines += ["", "Retrieval recall of the evidence turns (same retrieval for every variant), beside its ceiling (the "
              "share of the evidence turns that some fact cites):", "",
              "| category | questions | " + " | ".join(f"recall@{k}" for k in RECALL_AT) + " | ceiling |",
              "|---|---:|" + "---:|" * (len(RECALL_AT) + 1)]
    for group in [*map(str, CATEGORIES), "overall"]:
        row = first[group]
        label = f"{group} {CATEGORIES[int(group)]}" if group != "overall" else "overall"
        lines.append(f"| {label} | {row['questions']} | "
                     + " | ".join(fmt(row["recall"][str(k)], 2) for k in RECALL_AT)
                     + f" | {fmt(row.get('ceiling', math.nan), 2)} |")
    lines += ["", *[f"![{Path(p).stem}]({Path(p).name})" for p in plots], ""]
    return "\n".join(lines)


def plot(result: dict, output: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    names = list(summary)
    figure, axis = plt.subplots(figsize=(8, 4))
    gaps = [summary[n]["overall"]["gap"] for n in names]
    bounds = [summary[n]["overall"]["gap_ci"] for n in names]
    axis.bar(names, gaps, color="tab:blue",
             yerr=[[g - lo for g, (lo, _) in zip(gaps, bounds, strict=True)],
                   [hi - g for g, (_, hi) in zip(gaps, bounds, strict=True)]],
             capsize=3)
    axis.axhline(0, color="black", linewidth=0.8)
    axis.set_ylabel("kv - text NLL (nats/token), 95% CI")
    axis.set_title(f"LoCoMo, {result['model']}, k={result['k']}: injected memory against text", fontsize=9)
    axis.tick_params(axis="x", rotation=30)
    axis.grid(alpha=0.3, axis="y")
    figure.tight_layout()
    paths = [str(output / "fidelity_gap.png")]
    figure.savefig(paths[-1], dpi=120)
    figure, axis = plt.subplots(figsize=(6, 4))
    first = summary[names[0]]
    for group in [*map(str, CATEGORIES), "overall"]:
        axis.plot(RECALL_AT, [first[group]["recall"][str(k)] for k in RECALL_AT], marker="o",
                  label=CATEGORIES.get(int(group), group) if group != "overall" else "overall")
    axis.set_xlabel("k")
    axis.set_ylabel("recall of evidence turns")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    paths.append(str(output / "recall_at_k.png"))
    figure.savefig(paths[-1], dpi=120)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--conversations", type=int, default=6, help="the first N conversations of the file")
    parser.add_argument("--per-category", type=int, default=6,
                        help="stratified subset: questions per category per conversation (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--windows", type=int, nargs="+", default=[0, 5, 20, 50, -1])
    parser.add_argument("--tails", type=int, nargs="*", default=[1, 2, 5, 10],
                        help="recomputed tails m swept at --tail-window")
    parser.add_argument("--tail-window", type=int, default=20, help="the window the tails are swept at (-2: none)")
    parser.add_argument("--fp8-window", type=int, default=50, help="the encoding also stored in fp8 (-2: none)")
    parser.add_argument("--order-window", type=int, default=50,
                        help="the encoding also served in chronological fact order (-2: none)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--model", type=Path, default=None, help="HF model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--output", type=Path, default=Path("results/locomo"))
    parser.add_argument("--retrieval", nargs="+", choices=list(RETRIEVAL_MODES), default=[],
                        help="retrieval mode (with --recall-only: each mode measured, the first the baseline)")
    parser.add_argument("--recall-only", action="store_true", help="retrieval recall alone, no model")
    parser.add_argument("--facts", choices=FACT_SETS, default="observations",
                        help="the facts ingested: LoCoMo's observations, every dialogue turn as a fact, or both")
    args = parser.parse_args()
    args.per_category = args.per_category or None
    args.fp8_window = None if args.fp8_window == -2 else args.fp8_window
    args.order_window = None if args.order_window == -2 else args.order_window
    args.tail_window = None if args.tail_window == -2 else args.tail_window
    if not args.data.exists():
        raise SystemExit(f"{args.data}: no LoCoMo file (pass --data PATH)")
    claim_output(args.output, args.facts)
    if args.recall_only:
        modes = args.retrieval or list(RETRIEVAL_MODES)
        recall, report = evaluate_recall(args.data, args.conversations, args.per_category, args.seed, modes,
                                         RECALL_AT, args.output, args.facts)
        (args.output / "recall.json").write_text(json.dumps(recall, indent=2))
        (args.output / "recall.md").write_text(report)
        print(report)
        return
    if len(args.retrieval) > 1:
        raise SystemExit("--retrieval: one mode for a full run (several with --recall-only)")
    result = evaluate(args)
    plots = plot(result, args.output)
    report = markdown_report(result, plots)
    (args.output / "results.json").write_text(json.dumps(result, indent=2))
    (args.output / "report.md").write_text(report)
    print(report)
    print(f"\nreport: {args.output / 'report.md'}")


if __name__ == "__main__":
    main()
