"""The server's Prometheus metrics (GET /metrics), in a registry of its own, and its one log line a request."""

from __future__ import annotations

import logging
import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..stats import GenerationStats

log = logging.getLogger("inference.serve")

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self, batch_size: int):
        self.registry = CollectorRegistry()
        self.lock = threading.Lock()
        r = self.registry
        self.ttft = Histogram(
            "specheads_time_to_first_token_seconds",
            "from a request's arrival (queueing included) to its first token",
            buckets=LATENCY,
            registry=r,
        )
        self.tpot = Histogram(
            "specheads_time_per_output_token_seconds",
            "a request's time per token after its first",
            buckets=LATENCY,
            registry=r,
        )
        self.queue = Gauge("specheads_queue_length", "requests waiting for a row", registry=r)
        self.rows = Gauge("specheads_batch_rows", "rows decoding now", registry=r)
        Gauge("specheads_batch_size", "rows the server decodes at most (--batch-size)", registry=r).set(batch_size)
        self.occupancy = Histogram(
            "specheads_batch_occupancy",
            "rows decoding at each step",
            buckets=tuple(range(1, batch_size + 1)),
            registry=r,
        )
        self.tau = Histogram(
            "specheads_tokens_per_target_pass",
            "a request's new tokens per target pass (tau; its prefill included)",
            buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8),
            registry=r,
        )
        self.drafted = Counter(
            "specheads_drafted_to_depth",
            "row-steps whose tree reached depth d (1: the first draft)",
            ["depth"],
            registry=r,
        )
        self.accepted = Counter(
            "specheads_accepted_to_depth", "row-steps that accepted d draft tokens or more", ["depth"], registry=r
        )
        self.acceptance = Gauge(
            "specheads_acceptance_by_depth",
            "of the row-steps that drafted d deep, the share that accepted d (since the server started)",
            ["depth"],
            registry=r,
        )
        self.steps = Counter("specheads_row_steps", "decode steps of each row, drafted or plain", ["kind"], registry=r)
        self.fallback = Gauge(
            "specheads_fallback_share",
            "the share of row-steps decoded plainly because drafting did not pay (since the server started)",
            registry=r,
        )
        self.tokens = Counter("specheads_generated_tokens", "new tokens sent", registry=r)
        self.requests = Counter(
            "specheads_requests", "requests answered, by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.depths: list[list[int]] = []  # [d]: (row-steps drafted to depth d + 1, those that accepted it)
        self.plain_steps = self.row_steps = 0

    def step(self, rows: int, waiting: int) -> None:
        """After each decode step (in the decoding thread)."""
        self.rows.set(rows)
        self.queue.set(waiting)
        if rows:
            self.occupancy.observe(rows)

    def answered(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def decoded(self, stats: GenerationStats, new_tokens: int, ttft: float | None, tpot: float | None) -> None:
        """A request that got a row ended: its latency and how its row decoded."""
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        self.tokens.inc(new_tokens)
        if stats.target_forwards:
            self.tau.observe(new_tokens / stats.target_forwards)
        steps = max(stats.target_forwards - 1, 0)  # the prefill is no decode step
        self.steps.labels("plain").inc(stats.plain_steps)
        self.steps.labels("drafted").inc(steps - stats.plain_steps)
        with self.lock:
            self.plain_steps += stats.plain_steps
            self.row_steps += steps
            if self.row_steps:
                self.fallback.set(self.plain_steps / self.row_steps)
            for depth, counts in enumerate(zip(stats.drafted_to_depth, stats.accepted_to_depth)):
                if depth == len(self.depths):
                    self.depths.append([0, 0])
                total = self.depths[depth]
                total[0], total[1] = total[0] + counts[0], total[1] + counts[1]
                label = str(depth + 1)
                self.drafted.labels(label).inc(counts[0])
                self.accepted.labels(label).inc(counts[1])
                self.acceptance.labels(label).set(total[1] / max(total[0], 1))
