"""The OpenAI-compatible HTTP API over the batcher: requests checked field by field (pydantic, unknown fields
refused), tokenized here, decoded by the batcher's thread, answered whole or as server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Literal

import jinja2
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from ..accept import Sampling
from .batcher import Batcher, DecodingFailed, Job, QueueFull, Stopped
from .metrics import Metrics

log = logging.getLogger("inference.serve")
COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions; chat's is the rest of the context


# --- requests ----------------------------------------------------------------------------------------------------


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


StopStrings = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=4)]


class Sampled(Strict):
    """What both endpoints take besides the prompt (OpenAI's names and defaults)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)  # 0: greedy
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: Annotated[str, Field(min_length=1)] | StopStrings | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)  # one answer a request
    user: str | None = None


class CompletionRequest(Sampled):
    prompt: str | list[Annotated[int, Field(ge=0)]]


class Message(Strict):
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None


class ChatRequest(Sampled):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class BadRequest(Exception):
    """A request the server refuses: `status`, the field at fault (`param`) and what to do."""

    def __init__(self, param: str | None, message: str, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
    """OpenAI's error shape, which its clients raise as the matching exception."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status_code=status)


UNIONS = {  # what a field of several types takes, said once (pydantic's error names each type it tried)
    "prompt": "text, or a list of token ids (integers >= 0)",
    "stop": "a non-empty string, or a list of 1 to 4 of them",
}


def validation_message(error: dict, fields: list[str], body) -> tuple[str | None, str]:
    """(the field at fault, a sentence) for one of pydantic's errors about a request body."""
    loc = [str(part) for part in error["loc"][1:]]  # the first is "body"
    if error["type"] == "json_invalid":
        return None, f"the request body is not valid JSON ({error.get('ctx', {}).get('error', error['msg'])})"
    if not loc:
        return None, f"the request body must be a JSON object with the request's fields ({error['msg']})"
    param = loc[0]
    if error["type"] == "extra_forbidden":
        return param, f"unknown field {'.'.join(loc)!r}: this endpoint takes {', '.join(fields)}"
    if error["type"] == "missing":
        return param, f"{'.'.join(loc)} is required"
    if param in UNIONS:
        given = body.get(param) if isinstance(body, dict) else None
        return param, f"{param} must be {UNIONS[param]} (got {given!r})"
    return param, f"{'.'.join(loc)}: {error['msg']} (got {error.get('input')!r})"


# --- turning tokens into text ------------------------------------------------------------------------------------


@dataclass
class TextStream:
    """A row's tokens as text deltas: the whole answer decoded each time (a token's text may depend on the tokens
    around it), the end held back while it may be the start of a stop string or an incomplete character."""

    tokenizer: object
    stop: list[str]
    tokens: list[int] = field(default_factory=list)
    sent: int = 0  # characters already handed out

    def push(self, tokens: list[int], done: bool) -> tuple[str, bool]:
        """(the next delta, whether a stop string ended the answer)."""
        self.tokens += tokens
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        found = [at for at in (text.find(stop) for stop in self.stop) if at >= 0]
        if found:
            end = min(found)
        elif done:
            end = len(text)
        else:
            end = len(text) - max((len(stop) - 1 for stop in self.stop), default=0)
            end = min(end, len(text.rstrip("\ufffd")))
        delta, self.sent = text[self.sent : max(end, self.sent)], max(end, self.sent)
        return delta, bool(found)


@dataclass
class Answer:
    """One request from submission to its end: what it sent, when, and how it ended (for the metrics and the log)."""

    job: Job
    text: TextStream
    new_tokens: int = 0
    first: float | None = None
    last: float | None = None
    finish: str | None = None  # "stop", "length"; None while going or when cut short
    ended: bool = False  # its end was recorded

    async def deltas(self, batcher: Batcher) -> AsyncIterator[str]:
        """The answer's text deltas until it ends (self.finish set); a decoding fault raises here."""
        while True:
            item = await self.job.events.get()
            if isinstance(item, Exception):
                raise item
            tokens, done = item
            self.last = time.perf_counter()
            self.first = self.first or self.last
            self.new_tokens += len(tokens)
            delta, stopped = self.text.push(tokens, done)
            if stopped:
                batcher.cancel(self.job)  # its row leaves the batch at the next step
            if stopped or done:
                self.finish = "stop" if stopped or self.job.row.finish == "stop" else "length"
            if delta or self.finish:
                yield delta
            if self.finish:
                return

    def usage(self) -> dict:
        prompt = int(self.job.prompt.shape[0])
        return {"prompt_tokens": prompt, "completion_tokens": self.new_tokens, "total_tokens": prompt + self.new_tokens}


# --- the app -----------------------------------------------------------------------------------------------------


def create_app(batcher: Batcher, tokenizer, name: str) -> FastAPI:
    """The API over a batcher (not started yet: the app's lifespan starts and stops its thread)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        try:
            yield
        finally:
            batcher.stop()

    app = FastAPI(title="specheads", lifespan=lifespan)
    app.state.batcher = batcher
    metrics: Metrics = batcher.metrics
    config = batcher.model.config
    context = getattr(config, "max_position_embeddings", None)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        body = ChatRequest if request.url.path.endswith("/chat/completions") else CompletionRequest
        param, message = validation_message(error.errors()[0], list(body.model_fields), error.body)
        return refused(request, 400, message, param)

    @app.exception_handler(BadRequest)
    async def bad(request: Request, error: BadRequest):
        return refused(request, error.status, str(error), error.param)

    @app.exception_handler(QueueFull)
    async def full(request: Request, error: QueueFull):
        response = refused(request, 429, str(error), None, "rate_limit_exceeded")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(Stopped)
    async def stopped(request: Request, error: Stopped):
        return refused(request, 503, str(error), None, "server_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        return refused(request, error.status_code, str(error.detail), None)

    def refused(request: Request, status: int, message: str, param: str | None, kind: str = "invalid_request_error"):
        path = request.url.path  # any other path is "other": a label per URL tried would grow without end
        endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}.get(path, "other")
        metrics.answered(endpoint, str(status))
        log.info("%s refused %d: %s", path, status, message)
        return error_response(status, message, param, kind)

    @app.get("/health")
    async def health():
        if not batcher.alive:
            return error_response(503, "the decoding thread is not running", kind="server_error")
        return {"status": "ok", "rows": len(batcher.state.active), "waiting": batcher.waiting()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "specheads"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str):
            if not body.prompt.strip():
                raise BadRequest("prompt", "the prompt is empty: give at least one token of text")
            ids = tokenizer(body.prompt)["input_ids"]
        else:
            ids = body.prompt
        if not ids:
            raise BadRequest("prompt", "the prompt is empty: give at least one token")
        if max(ids) >= config.vocab_size:
            raise BadRequest("prompt", f"token ids must be in [0, {config.vocab_size}), got {max(ids)}")
        budget = tokens_to_generate(len(ids), body.max_tokens, "max_tokens", "prompt", COMPLETION_DEFAULT_TOKENS)
        return await answer(request, body, ids, budget, "completions")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if getattr(tokenizer, "chat_template", None) is None:
            raise BadRequest("messages", "this model has no chat template: use /v1/completions with a prompt")
        if not any(message.content.strip() for message in body.messages):
            raise BadRequest("messages", "every message is empty: give at least one token of text")
        if body.max_tokens is not None and body.max_completion_tokens not in (None, body.max_tokens):
            raise BadRequest("max_completion_tokens", "max_tokens and max_completion_tokens differ: give one")
        messages = [message.model_dump(exclude_none=True) for message in body.messages]
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        except jinja2.TemplateError as error:
            raise BadRequest("messages", f"the model's chat template refuses these messages: {error}") from None
        requested = body.max_completion_tokens or body.max_tokens
        field_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        budget = tokens_to_generate(len(ids), requested, field_name, "messages", None)
        return await answer(request, body, ids, budget, "chat")

    def tokens_to_generate(prompt: int, requested: int | None, field_name: str, prompt_field: str, default) -> int:
        """The request's max_new_tokens, checked against the model's context."""
        if context is None:
            return requested or default or COMPLETION_DEFAULT_TOKENS
        if prompt >= context:
            raise BadRequest(
                prompt_field,
                f"the prompt has {prompt} tokens and the model's context is {context}: no room for a new token; "
                "shorten it",
            )
        if requested is None:
            return min(default or context, context - prompt)
        if prompt + requested > context:
            raise BadRequest(
                field_name,
                f"prompt ({prompt} tokens) + {field_name} ({requested}) exceeds the model's context of {context} "
                f"positions; lower {field_name} or shorten the prompt",
            )
        return requested

    async def answer(request: Request, body: Sampled, ids: list[int], budget: int, endpoint: str):
        if body.model is not None and body.model != name:
            raise BadRequest("model", f"model {body.model!r} is not served here; GET /v1/models lists {name!r}", 404)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        sampling = Sampling(temperature=body.temperature, top_p=body.top_p)
        job = Job(torch.tensor(ids), budget, sampling, body.seed, asyncio.Queue(), asyncio.get_running_loop())
        batcher.submit(job)
        reply = Answer(job, TextStream(tokenizer, stop))
        chunk = Chunks(endpoint, name)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            # the background task records the end of a stream whose client left before it started
            return EventSourceResponse(
                streamed(reply, chunk, usage, endpoint), background=BackgroundTask(ended, reply, endpoint)
            )
        return await whole(request, reply, chunk, endpoint)

    async def streamed(reply: Answer, chunk: Chunks, usage: bool, endpoint: str):
        try:
            if endpoint == "chat":
                yield {"data": json.dumps(chunk.delta({"role": "assistant", "content": ""}, None))}
            async for delta in reply.deltas(batcher):
                yield {"data": json.dumps(chunk.delta(delta, reply.finish))}
            if usage:
                yield {"data": json.dumps(chunk.usage(reply.usage()))}
            yield {"data": "[DONE]"}
        except (Stopped, DecodingFailed) as error:  # the decoding failed (its traceback is in the log)
            yield {"data": json.dumps({"error": {"message": str(error), "type": "server_error", "param": None}})}
        finally:
            ended(reply, endpoint)

    async def whole(request: Request, reply: Answer, chunk: Chunks, endpoint: str):
        async def collect() -> str:
            return "".join([delta async for delta in reply.deltas(batcher)])

        try:
            text = await until_disconnected(request, collect())
        except (Stopped, DecodingFailed) as error:
            return error_response(500, f"decoding this request failed: {error}", kind="server_error")
        finally:
            ended(reply, endpoint)
        if text is None:
            return Response(status_code=499)  # nobody is listening
        return chunk.whole(text, reply.finish, reply.usage())

    def ended(reply: Answer, endpoint: str) -> None:
        """A request's end (once): its row freed if it still decodes, its metrics and its log line."""
        if reply.ended:
            return
        reply.ended = True
        if reply.finish is None:
            batcher.cancel(reply.job)
        outcome = reply.finish or "cancelled"
        metrics.answered(endpoint, outcome)
        ttft = None if reply.first is None else reply.first - reply.job.arrived
        tpot = None if reply.new_tokens < 2 else (reply.last - reply.first) / (reply.new_tokens - 1)
        stats = reply.job.row.stats if reply.job.row is not None else None
        if stats is not None and reply.finish is not None:
            metrics.decoded(stats, reply.new_tokens, ttft, tpot)
        log.info(
            "%s %s prompt=%d new=%d ttft=%s tpot=%s tau=%s",
            endpoint,
            outcome,
            reply.job.prompt.shape[0],
            reply.new_tokens,
            "-" if ttft is None else f"{ttft:.3f}s",
            "-" if tpot is None else f"{1e3 * tpot:.1f}ms",
            f"{reply.new_tokens / stats.target_forwards:.2f}" if stats is not None and stats.target_forwards else "-",
        )

    return app


async def until_disconnected(request: Request, work):
    """`work`'s result, or None (work cancelled) when the client goes away first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watch):
            if not pending.done():
                pending.cancel()
    return task.result() if task in done else None


@dataclass
class Chunks:
    """OpenAI's response objects for one request, whole or as stream chunks."""

    endpoint: str
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _object(self, kind: str, choices: list, **extra) -> dict:
        prefix = "chatcmpl-" if self.endpoint == "chat" else "cmpl-"
        return {
            "id": prefix + self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def delta(self, delta, finish: str | None) -> dict:
        if self.endpoint == "chat":
            content = delta if isinstance(delta, dict) else ({"content": delta} if delta else {})
            choice = {"index": 0, "delta": content, "logprobs": None, "finish_reason": finish}
            return self._object("chat.completion.chunk", [choice])
        return self._object("text_completion", [{"index": 0, "text": delta, "logprobs": None, "finish_reason": finish}])

    def usage(self, usage: dict) -> dict:
        kind = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return self._object(kind, [], usage=usage)

    def whole(self, text: str, finish: str | None, usage: dict) -> dict:
        if self.endpoint == "chat":
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
            return self._object("chat.completion", [choice], usage=usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._object("text_completion", [choice], usage=usage)
