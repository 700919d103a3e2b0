"""Per-request decoding statistics, counted so that the acceptance rates add up to tau."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class AcceptanceRates:
    """Acceptance rate at each draft depth d (list index d - 1), named by its denominator.

    The numerator is always A_d, the steps that emitted at least d accepted draft tokens.
    None marks a rate whose denominator is 0.

    Args:
        given_reached: A_d / T_d, T_d the steps whose verification tested a node at depth d
            (conditional acceptance: the path got to depth d - 1 and the draft went on).
        given_drafted: A_d / D_d, D_d the steps whose draft reached depth d.
        per_step: A_d / S, S every verification step; ``1 + sum(per_step)`` is the mean
            number of tokens a step emits when no step is truncated.
    """

    given_reached: list[float | None]
    given_drafted: list[float | None]
    per_step: list[float]


@dataclass
class DecodeStats:
    """Counters and timings of one generate() call, or of several merged with ``merged``.

    Only *emitted* tokens count: when EOS or ``max_new_tokens`` cuts a step's committed
    tokens, the step counts the accepted draft tokens that were emitted, and it is a
    truncated step when its recovered / bonus token was not emitted.

    ``requests`` R counts generate() calls (each prefill emits one token); ``steps`` S
    the verification steps (one target forward each); ``truncated_steps`` the steps cut
    before their recovered / bonus token. Per draft depth d (index d - 1):
    ``drafted_by_depth`` D_d, steps whose draft reached depth d; ``reached_by_depth`` T_d,
    steps that tested a node at depth d (the accepted path reached depth d - 1 and the
    draft went on below it; for a truncated step only the depths it emitted);
    ``accepted_by_depth`` A_d, steps that emitted at least d accepted draft tokens.
    ``accept_lengths`` holds each step's emitted accepted draft tokens.
    ``steps_by_source`` / ``accepted_by_source``: for drafts that name their source
    (``Draft.source``, a composite's member), the steps each source drafted and the
    accepted draft tokens it emitted.
    ``planned_plain_steps``: steps the speculation controller planned as plain steps (no
    draft asked for); ``drafted_tokens`` / ``steps`` is the mean of the nodes verified.
    Timings (seconds): ``draft_time`` the proposer's calls (and the controller's planning); ``verify_time`` the rest of
    each step (the target's forward, acceptance, commit, observe), of which ``score_time``
    is the target's forward alone; ``total_time`` the whole request; ``ttft`` up to the
    first token; ``controller_time`` the controller's own work (included in the others).
    """

    requests: int = 0
    target_forwards: int = 0
    new_tokens: int = 0
    steps: int = 0
    truncated_steps: int = 0
    drafted_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    drafted_by_depth: list[int] = field(default_factory=list)
    reached_by_depth: list[int] = field(default_factory=list)
    accepted_by_depth: list[int] = field(default_factory=list)
    steps_by_source: dict[str, int] = field(default_factory=dict)
    accepted_by_source: dict[str, int] = field(default_factory=dict)
    planned_plain_steps: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    score_time: float = 0.0
    total_time: float = 0.0
    ttft: float = 0.0
    controller_time: float = 0.0

    @property
    def tau(self) -> float:
        """Emitted tokens per target forward, the prefill's first token and every recovered or bonus token included."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def tau_from_rates(self) -> float:
        """tau rebuilt from the counters: (R + S - truncated + S * sum_d per_step[d]) / (R + S).

        new_tokens = R + sum over steps of (emitted accepted tokens + the recovered / bonus
        token unless truncated), and target_forwards = R + S, so this equals ``tau``.
        """
        forwards = self.requests + self.steps
        if not forwards:
            return 0.0
        per_step = self.acceptance_by_depth().per_step
        return (self.requests + self.steps - self.truncated_steps + self.steps * sum(per_step)) / forwards

    @property
    def tau_iid(self) -> float | None:
        """Tokens per step if every draft token were accepted independently with the pooled rate.

        (1 - a^(K + 1)) / (1 - a) (Leviathan et al. 2023), a = sum_d A_d / sum_d T_d the
        pooled conditional acceptance, K = sum_d D_d / D_1 the mean depth of the steps
        that drafted; K + 1 when a = 1, None when nothing was drafted.
        """
        drafted = _get(self.drafted_by_depth, 0)
        reached = sum(self.reached_by_depth)
        if not drafted or not reached:
            return None
        a = sum(self.accepted_by_depth) / reached
        depth = sum(self.drafted_by_depth) / drafted
        return depth + 1 if a == 1 else (1 - a ** (depth + 1)) / (1 - a)

    @property
    def tpot(self) -> float:
        """Mean seconds per output token after each request's first."""
        after_first = self.new_tokens - max(self.requests, 1)
        return (self.total_time - self.ttft) / after_first if after_first > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    def record_step(
        self, draft_depth: int, num_nodes: int, num_accepted: int, recovered: bool, emitted: int, source: str | None = None
    ) -> None:
        """Count one verification step.

        Args:
            draft_depth: depth of the draft as verified (0 for an empty draft).
            num_nodes: draft nodes scored.
            num_accepted: draft tokens the verifier accepted.
            recovered: a node below the accepted path was rejected (so depth
                ``num_accepted + 1`` was tested).
            emitted: the step's tokens actually emitted (1 to ``num_accepted + 1``;
                fewer than committed when EOS or the output limit cut them).
            source: the draft's ``Draft.source`` (None: not counted per source).
        """
        assert 1 <= emitted <= num_accepted + 1 <= draft_depth + 1, (emitted, num_accepted, draft_depth)
        truncated = emitted <= num_accepted
        accepted = min(num_accepted, emitted)
        self.steps += 1
        self.truncated_steps += int(truncated)
        self.drafted_tokens += num_nodes
        self.accept_lengths.append(accepted)
        _bump(self.drafted_by_depth, draft_depth)
        # A cut step's tests below what it emitted decided nothing that came out.
        _bump(self.reached_by_depth, accepted if truncated else num_accepted + int(recovered))
        _bump(self.accepted_by_depth, accepted)
        if source is not None:
            self.steps_by_source[source] = self.steps_by_source.get(source, 0) + 1
            self.accepted_by_source[source] = self.accepted_by_source.get(source, 0) + accepted

    def acceptance_by_depth(self) -> AcceptanceRates:
        """Acceptance rate at each draft depth, given reached, given drafted and per step."""
        given_reached, given_drafted, per_step = [], [], []
        for d, drafted in enumerate(self.drafted_by_depth):
            accepted = _get(self.accepted_by_depth, d)
            reached = _get(self.reached_by_depth, d)
            given_reached.append(accepted / reached if reached else None)
            given_drafted.append(accepted / drafted if drafted else None)
            per_step.append(accepted / self.steps)
        return AcceptanceRates(given_reached, given_drafted, per_step)

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "tau": self.tau,
            "tau_from_rates": self.tau_from_rates,
            "tau_iid": self.tau_iid,
            "tpot": self.tpot,
            "tokens_per_second": self.tokens_per_second,
            "acceptance_by_depth": asdict(self.acceptance_by_depth()),
        }

    @staticmethod
    def merged(parts: list[DecodeStats]) -> DecodeStats:
        """Every counter and timing summed over ``parts`` (depth counters by depth; accept lengths concatenated)."""
        total = DecodeStats()
        for part in parts:
            for f in fields(DecodeStats):
                mine, theirs = getattr(total, f.name), getattr(part, f.name)
                if f.name.endswith("_by_depth"):
                    mine.extend([0] * (len(theirs) - len(mine)))
                    for d, count in enumerate(theirs):
                        mine[d] += count
                elif isinstance(mine, dict):
                    for key, count in theirs.items():
                        mine[key] = mine.get(key, 0) + count
                elif isinstance(mine, list):
                    mine.extend(theirs)
                else:
                    setattr(total, f.name, mine + theirs)
        return total


def _bump(counts: list[int], depth: int) -> None:
    """Add 1 to counts[0..depth-1], growing the list as needed."""
    if len(counts) < depth:
        counts.extend([0] * (depth - len(counts)))
    for d in range(depth):
        counts[d] += 1


def _get(counts: list[int], d: int) -> int:
    return counts[d] if d < len(counts) else 0
