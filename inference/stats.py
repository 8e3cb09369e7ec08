"""What a generate() call returns: the new tokens, their text, and how decoding went."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    """One sequence's decoding. In a batch, a step's time counts for every row in it: the passes and the drafting
    served them all at once."""

    new_tokens: int = 0
    target_forwards: int = 0  # the prefill included, so plain decoding has mean_accepted == 1
    seconds: float = 0.0  # from the call to this sequence's last token
    target_seconds: float = 0.0  # inside the target's forward passes (host time: exact on CPU)
    draft_seconds: float = 0.0  # inside the drafter (reading what was committed, proposing)
    tree_nodes: int = 0  # tokens verified over all decode steps (roots included, the prefill not)
    time_to_first_token: float = 0.0  # seconds from the call to the first new token (the prefill)
    plain_steps: int = 0  # decode steps the fallback took without drafting (drafting did not pay)
    drafted_to_depth: list[int] = field(default_factory=list)  # [d]: steps whose tree reached depth d + 1
    accepted_to_depth: list[int] = field(default_factory=list)  # [d]: steps that accepted d + 1 draft tokens or more

    @property
    def mean_accepted(self) -> float:
        """Spec-Bench's tau: new tokens per target forward pass."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

    @property
    def time_per_output_token(self) -> float:
        """Seconds per new token after the first (TPOT)."""
        return (self.seconds - self.time_to_first_token) / max(self.new_tokens - 1, 1)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """For each draft depth d: of the steps that drafted d tokens deep, the share that accepted d."""
        return [accepted / drafted for accepted, drafted in zip(self.accepted_to_depth, self.drafted_to_depth)]

    @property
    def engine_seconds(self) -> float:
        """The loop's own work: trees, masks, acceptance, cache compaction."""
        return self.seconds - self.target_seconds - self.draft_seconds

    def count_depths(self, drafted: int, accepted: int) -> None:
        grow = drafted - len(self.drafted_to_depth)
        if grow > 0:
            self.drafted_to_depth += [0] * grow
            self.accepted_to_depth += [0] * grow
        for d in range(drafted):
            self.drafted_to_depth[d] += 1
            self.accepted_to_depth[d] += d < accepted

    def as_dict(self) -> dict:
        keys = (
            "new_tokens",
            "target_forwards",
            "mean_accepted",
            "seconds",
            "tokens_per_second",
            "time_to_first_token",
            "time_per_output_token",
            "target_seconds",
            "draft_seconds",
            "engine_seconds",
            "tree_nodes",
            "plain_steps",
            "acceptance_by_depth",
            "drafted_to_depth",
            "accepted_to_depth",
        )
        return {key: getattr(self, key) for key in keys}


@dataclass
class Generation:
    token_ids: list[int]  # new tokens only, EOS included when generation stopped there
    text: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)
