"""Continuous batching over arriving requests: ONE thread runs the decode loop (inference.loop) a step at a time.

Between two steps it moves the requests that arrived into the loop's queue (`loop.add`) and admits them into free
rows (prompts prefilled, first tokens out) before the batch decodes on; a row leaves the batch when it ends or when
its request is cancelled (a client that went away, a stop string). Each row's committed tokens go to its request's
asyncio queue through the event loop that made it. Requests beyond the batch's rows wait, at most `queue_size` of
them: `submit` refuses one more (QueueFull, a 429).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from heads.attention import grouped_attention

from .. import loop
from ..accept import Sampling
from ..fallback import Fallback
from ..generate import Plan
from .metrics import Metrics

log = logging.getLogger("inference.serve")
# seconds: requests arriving closer together than BURST_GAP are admitted as one burst, waiting BURST_WAIT at most
BURST_GAP, BURST_WAIT = 0.003, 0.02
WARM_UP_TOKENS = 128  # each made-up prompt of the warm-up (Batcher.warm_up)


class QueueFull(Exception):
    """No room in the queue of requests waiting for a row."""


class Stopped(Exception):
    """The server is shutting down (or its decoding thread has ended): it takes no more requests."""


class DecodingFailed(Exception):
    """Decoding the batch raised: the requests in it end with this (the traceback is in the server's log)."""


@dataclass
class Job:
    """One request as the decoding thread sees it. `events` receives (tokens, done) as the row commits tokens, or the
    exception that ended its decoding; `row` is set once the request is in the loop's queue."""

    prompt: torch.Tensor
    max_new_tokens: int
    sampling: Sampling
    seed: int | None
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    row: loop.Row | None = None
    cancelled: bool = False

    def put(self, item) -> None:
        """Hand `item` to the request's event loop (from the decoding thread)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # its event loop is closed: nobody is left to read the item
            log.debug("a request's event loop closed before its answer ended")


class Batcher:
    """The decoding thread and the requests it serves; `start`, `submit`, `cancel`, `stop`."""

    def __init__(
        self,
        model,
        plan: Plan,
        eos: list[int],
        batch_size: int,
        queue_size: int,
        metrics: Metrics,
        own_thread: bool = True,
        warm_batch: bool = True,
        prompt_start: list[int] = (),
    ):
        self.model, self.plan, self.eos, self.batch_size, self.queue_size = model, plan, eos, batch_size, queue_size
        self.metrics = metrics
        # own_thread=False: the caller runs `run` itself, on the thread that did the process's first torch work. On
        # a CPU, OpenMP's threads of a second thread's parallel regions outnumber the cores, wait without spinning
        # and ran the loop 2-4x slower (docs/usage.md#the-server).
        self.own_thread, self.warm_batch, self.serving = own_thread, warm_batch, False
        self.prompt_start = list(prompt_start)  # what the server's prompts start with (its chat template's start)
        self.state = loop.start(model, plan.drafter, eos, plan.fallback, batch_size)
        self.lock = threading.Condition()
        self.inbox: list[Job] = []  # submitted, not yet in the loop's queue
        self.jobs: dict[int, Job] = {}  # id(job) -> job, for the requests in the loop (changed under the lock)
        self.stopping = False
        self.thread = threading.Thread(target=self.run, name="specheads-decode", daemon=True)

    def start(self) -> None:
        """Take requests from now on (and start the decoding thread, unless the caller runs `run`)."""
        self.serving = True
        if self.own_thread:
            self.thread.start()

    @property
    def alive(self) -> bool:
        running = self.thread.is_alive() if self.own_thread else True
        return self.serving and running and not self.stopping

    def waiting(self) -> int:
        """Requests that would find no row at the next step."""
        return max(0, len(self.inbox) + len(self.jobs) - self.batch_size)

    def submit(self, job: Job) -> None:
        with self.lock:
            if not self.alive:
                raise Stopped("the server is shutting down and takes no more requests")
            if self.waiting() >= self.queue_size:
                raise QueueFull(
                    f"the server is busy: its {self.batch_size} rows decode and {self.waiting()} requests wait for "
                    f"one (--queue-size {self.queue_size}); retry later"
                )
            self.inbox.append(job)
            self.lock.notify()

    def cancel(self, job: Job) -> None:
        """The request's row leaves the batch (or the queue) at the next step; its tokens are not wanted any more."""
        with self.lock:
            job.cancelled = True
            if job.row is not None:
                job.row.cancelled = True
            self.lock.notify()

    def stop(self) -> None:
        """End the decoding thread after its current step; the requests still in it end with Stopped."""
        with self.lock:
            self.stopping = True
            self.lock.notify()
        if self.own_thread and self.thread.is_alive():
            self.thread.join()

    def run(self) -> None:
        try:
            with torch.inference_mode(), grouped_attention(self.model):
                if self.warm_batch:
                    self.warm_up()
                while self.take_arrivals():
                    try:
                        self.admit_arrivals()
                        loop.step(self.state)
                    except Exception as error:  # a fault in decoding ends the requests in the batch, not the server
                        log.exception("decoding failed; the requests decoding end with an error, the server goes on")
                        self.fail_all(DecodingFailed(f"decoding failed: {type(error).__name__}: {error}"))
                    self.metrics.step(len(self.state.active), self.waiting())
        finally:  # stopped, or the thread itself failed (its traceback follows): no request is left waiting
            self.stopping = True
            self.fail_all(Stopped("the server's decoding thread ended before this request did"))

    def warm_up(self) -> None:
        """Decode a full batch of made-up prompts (WARM_UP_TOKENS each, after `prompt_start`) a few steps, as the
        server's first requests would: the first burst of clients then finds the passes and the memory allocator
        warm (a cold first prefill of a full batch is far slower) and the prompts' shared start computed, and no
        one's decoding pays for it. Its steps do not teach the fallback."""
        start = torch.tensor(self.prompt_start, dtype=torch.long)
        size = max(min(WARM_UP_TOKENS, self.model.config.max_position_embeddings // 2) - len(start), 16)
        generator = torch.Generator().manual_seed(0)
        state = loop.start(self.model, self.plan.drafter, self.eos, Fallback(enabled=False), self.batch_size)
        for _ in range(self.batch_size):
            prompt = torch.cat([start, torch.randint(self.model.config.vocab_size, (size,), generator=generator)])
            loop.add(state, prompt.to(self.model.device), 4, Sampling())
        while loop.step(state):
            pass
        self.state.prefix = state.prefix  # the start prompts share (a chat template's system prompt), computed

    def take_arrivals(self) -> bool:
        """Wait for work, then queue the requests that arrived in the loop; False when the server stops."""
        with self.lock:
            while not (self.inbox or self.state.waiting or self.state.active or self.stopping):
                self.lock.wait()
            self.wait_for_the_burst()
            if self.stopping:
                return False
            for job in self.inbox:
                if not job.cancelled:
                    self.add(job)
            self.inbox.clear()
            self.jobs = {key: job for key, job in self.jobs.items() if not job.cancelled}
            return True

    def wait_for_the_burst(self) -> None:
        """While requests arrive less than BURST_GAP apart and rows are free, wait for the next (BURST_WAIT at most):
        clients that send at once share one prefill instead of each waiting for the prefills started before it."""
        deadline = time.perf_counter() + BURST_WAIT
        while self.inbox and not self.stopping and len(self.jobs) + len(self.inbox) < self.batch_size:
            now = time.perf_counter()
            quiet = min(self.inbox[-1].arrived + BURST_GAP, deadline) - now
            if quiet <= 0:
                return
            self.lock.wait(quiet)

    def admit_arrivals(self) -> None:
        """Prefill the requests that arrived, and those that arrive meanwhile while rows are free, before the batch
        decodes on: their first tokens go out a step sooner, and a burst of requests shares its prefills."""
        while True:
            loop.drop_cancelled(self.state)
            loop.admit(self.state)
            with self.lock:
                more = self.inbox and not self.stopping and len(self.state.active) < self.batch_size
            if not more:
                return
            self.take_arrivals()

    def add(self, job: Job) -> None:
        generator = None
        if job.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(job.seed)

        def on_tokens(tokens: list[int], done: bool) -> None:
            job.put((tokens, done))
            if done:
                with self.lock:
                    self.jobs.pop(id(job), None)

        prompt = job.prompt.to(self.model.device)
        job.row = loop.add(self.state, prompt, job.max_new_tokens, job.sampling, generator, on_tokens)
        self.jobs[id(job)] = job

    def fail_all(self, error: Exception) -> None:
        """Every request in the loop ends with `error`; the loop starts afresh (its cache and drafter rows with it)."""
        with self.lock:
            for job in [*self.jobs.values(), *self.inbox]:
                job.put(error)
            self.jobs.clear()
            self.inbox.clear()
            self.state = loop.start(self.model, self.plan.drafter, self.eos, self.plan.fallback, self.batch_size)
