"""An OpenAI-compatible server over the decode loop, with continuous batching: `python -m inference.serve`.

ONE thread decodes (inference.serve.batcher): between two steps it queues the requests that arrived, the loop
admits them into free rows at the next step and retires a row when it ends or its client goes away; each row has
its own max_tokens, sampling and seed, and its tokens stream back to its request. The HTTP side (FastAPI, uvicorn,
sse-starlette: inference.serve.app) checks and tokenizes requests and turns tokens into OpenAI's responses; metrics
are Prometheus's (inference.serve.metrics). Greedy answers in float32 are what generate() gives each prompt alone.
"""

from __future__ import annotations

import torch

from ..compiled_heads import warm_up
from ..generate import check_model, eos_ids, plan
from ..prefix import shared_length
from .app import create_app
from .batcher import Batcher
from .metrics import Metrics

__all__ = ["server_app"]


def server_app(
    model,
    tokenizer,
    heads=None,
    *,
    tree=None,
    lookup: bool | None = None,
    fallback: bool = True,
    batch_size: int = 8,
    queue_size: int = 64,
    name: str | None = None,
    decoding_thread: bool = True,
    warm_batch: bool = True,
):
    """The ASGI app serving `model` (and its `heads`, as generate() takes them) to at most `batch_size` requests at
    once, `queue_size` more waiting; its lifespan starts and stops the decoding thread (run it with uvicorn).
    decoding_thread=False: no thread of its own; the caller runs `app.state.batcher.run()` (python -m inference.serve
    does, on the main thread, with uvicorn in another): on a CPU, a decoding thread beside the thread that did the
    process's torch work runs 2-4x slower (batcher.Batcher says why). warm_batch: decode a full batch of made-up
    prompts before the first request (Batcher.warm_up)."""
    for option, value in (("batch_size", batch_size), ("queue_size", queue_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{option} must be a positive integer, got {value!r}")
    check_model(model)
    warm_up(model, heads)
    # the plan generate() makes for a batch of that many rows (one row: for one prompt)
    chosen = plan(model, heads, tree, lookup, fallback, batch=None if batch_size == 1 else (batch_size, batch_size))
    metrics, start = Metrics(batch_size), chat_start(tokenizer)
    batcher = Batcher(
        model, chosen, eos_ids(model), batch_size, queue_size, metrics, decoding_thread, warm_batch, start
    )
    return create_app(batcher, tokenizer, name or model.config._name_or_path)


def chat_start(tokenizer) -> list[int]:
    """The tokens every chat prompt starts with (the template's system prompt, the user's turn), [] without one."""
    if getattr(tokenizer, "chat_template", None) is None:
        return []
    one, other = (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        for messages in ([{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}])
    )
    return one[: shared_length([torch.tensor(one), torch.tensor(other)])]
