"""What a request whose memory is not all in the device tier does (scheduler role): wait for its missing chunks and
load them all, or load at once the prefix of its memory that is resident and let vLLM prefill the rest while the
missing chunks come in the background for the user's next request.

`auto` (the default) weighs bytes, not only tokens: the time to bring the missing bytes, from the host tier and from
the memory service at each one's measured bandwidth, against the time to prefill the tokens that would otherwise be
prefilled, at the engine's measured prefill throughput. It waits only where waiting is faster, so a cold request is
never slower than prefilling its memory. `wait` always waits (SGLang HiCache's `wait_complete`); `best-effort` never
does (its `best_effort`). Measurements are moving averages of what the workers report (bytes and time per tier) and
of the engine's steps (tokens scheduled and the time from a step's metadata to its output), seeded by priors until
the first report.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference_node.settings import MISS_POLICIES

# A fetch's fixed cost beyond its bytes: ordering it, a step to start it, a step to report it settled.
FETCH_LATENCY_S = 0.004
# Steps with fewer scheduled tokens are mostly decode: they say little about prefill throughput.
MIN_PREFILL_STEP_TOKENS = 128
_SMOOTHING = 0.2


@dataclass
class _Rate:
    """A moving average of a rate (units per second), seeded by a prior."""

    per_second: float

    def observe(self, amount: float, seconds: float) -> None:
        if amount > 0 and seconds > 0:
            self.per_second += _SMOOTHING * (amount / seconds - self.per_second)


@dataclass(frozen=True)
class MissDecision:
    wait: bool
    bring_s: float  # estimated time to bring the missing bytes
    prefill_s: float  # estimated time to prefill the tokens a partial load leaves to vLLM


class MissPolicy:
    def __init__(self, mode: str, on_gpu: bool) -> None:
        if mode not in MISS_POLICIES:
            raise ValueError(f"kv miss policy {mode!r}: one of {', '.join(MISS_POLICIES)}")
        self.mode = mode
        # Priors: a pinned host-to-device copy and a fetch on one host; prefill of a ~8B model on an H100, of a
        # ~135M model on two CPU cores.
        self.host_bytes = _Rate(20e9 if on_gpu else 10e9)
        self.source_bytes = _Rate(1e9)
        self.prefill_tokens = _Rate(40_000.0 if on_gpu else 1_000.0)

    def observe_transfers(self, transfer_bytes: dict[str, int], transfer_micros: dict[str, int]) -> None:
        """The workers' report of one step: bytes and microseconds per tier (`host`, `source`)."""
        for tier, rate in (("host", self.host_bytes), ("source", self.source_bytes)):
            rate.observe(transfer_bytes.get(tier, 0), transfer_micros.get(tier, 0) / 1e6)

    def observe_step(self, scheduled_tokens: int, seconds: float) -> None:
        if scheduled_tokens >= MIN_PREFILL_STEP_TOKENS:
            self.prefill_tokens.observe(scheduled_tokens, seconds)

    def decide(self, host_bytes: int, source_bytes: int, prefill_tokens: int) -> MissDecision:
        """Whether a request missing `host_bytes` + `source_bytes` (per rank) of its memory waits for them, rather
        than having `prefill_tokens` prompt tokens prefilled that a full load would have supplied."""
        bring_s = (FETCH_LATENCY_S + host_bytes / self.host_bytes.per_second
                   + source_bytes / self.source_bytes.per_second)
        prefill_s = prefill_tokens / self.prefill_tokens.per_second
        wait = self.mode == "wait" or (self.mode == "auto" and bring_s <= prefill_s)
        return MissDecision(wait, bring_s, prefill_s)
