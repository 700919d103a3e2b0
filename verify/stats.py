"""Per-request decoding statistics."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    """Counters and timings of one generate() call.

    ``tau`` is committed tokens per target forward, the prefill's first token and every
    recovered or bonus token included, so plain decoding has tau = 1.
    ``drafted_by_depth[d - 1]`` counts verification steps whose draft reached depth d;
    ``tried_by_depth[d - 1]`` counts steps that tested a node at depth d (the accepted
    path reached depth d - 1 and the draft continued below it);
    ``accepted_by_depth[d - 1]`` counts steps that accepted at least d draft tokens.
    """

    target_forwards: int = 0
    new_tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    drafted_by_depth: list[int] = field(default_factory=list)
    tried_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    ttft: float = 0.0

    @property
    def tau(self) -> float:
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after the first."""
        return (self.total_time - self.ttft) / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    def record_step(self, draft_depth: int, num_nodes: int, num_accepted: int, recovered: bool) -> None:
        """Count one verification step (``recovered``: a node below the accepted path was rejected)."""
        self.steps += 1
        self.drafted_tokens += num_nodes
        self.accept_lengths.append(num_accepted)
        _bump(self.drafted_by_depth, draft_depth)
        _bump(self.tried_by_depth, num_accepted + int(recovered))
        _bump(self.accepted_by_depth, num_accepted)

    def acceptance_by_depth(self) -> tuple[list[float], list[float]]:
        """(unconditional, conditional) acceptance rate at each draft depth.

        Unconditional at depth d: steps accepting >= d tokens / steps drafting depth >= d.
        Conditional at depth d: the same / steps that tested a node at depth d.
        """
        uncond, cond = [], []
        for d, drafted in enumerate(self.drafted_by_depth):
            accepted = _get(self.accepted_by_depth, d)
            tried = _get(self.tried_by_depth, d)
            uncond.append(accepted / drafted if drafted else 0.0)
            cond.append(accepted / tried if tried else 0.0)
        return uncond, cond

    def to_dict(self) -> dict:
        uncond, cond = self.acceptance_by_depth()
        return {
            **asdict(self),
            "tau": self.tau,
            "tpot": self.tpot,
            "tokens_per_second": self.tokens_per_second,
            "acceptance_by_depth": uncond,
            "conditional_acceptance_by_depth": cond,
        }


def _bump(counts: list[int], depth: int) -> None:
    """Add 1 to counts[0..depth-1], growing the list as needed."""
    if len(counts) < depth:
        counts.extend([0] * (depth - len(counts)))
    for d in range(depth):
        counts[d] += 1


def _get(counts: list[int], d: int) -> int:
    return counts[d] if d < len(counts) else 0
