"""The server (inference.serve) on a tiny model, through a real uvicorn on a free port: concurrent requests answer
what generate() gives each prompt alone, bad input gets a 400 naming its field while the others decode on, a full
queue answers 429, a client that leaves frees its row; and the loop driven a step at a time."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, load_heads
from inference import DynamicTreeSpec, Sampling, TokenDrafter, generate, load_target
from inference.drafters import NoDrafter, root_only
from inference.fallback import Fallback
from inference.serve import server_app
from inference.serve.app import TextStream
from test_exactness_tiny import random_prompts

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"
WAIT = 60  # seconds: an upper bound on waiting for the server, never a measurement


@contextmanager
def serving(app):
    """`app` under uvicorn in a thread, on a free port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(WAIT)
        sock.close()


@pytest.fixture(scope="module")
def chat_model(tiny_chat):
    model, tokenizer = load_target(str(tiny_chat / "model"), dtype="float32", compile=False)
    return model, tokenizer


def chat_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]


async def post(client: httpx.AsyncClient, path: str, body) -> dict:
    """A request, streamed or not, as (status, the JSON answer or the stream's text and finish, its events)."""
    content = body if isinstance(body, str) else json.dumps(body)
    if not (isinstance(body, dict) and body.get("stream")):
        response = await client.post(path, content=content, headers={"Content-Type": "application/json"})
        return {"status": response.status_code, "json": response.json() if response.content else None}
    text, finish, events = "", None, []
    async with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] == "[DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0] if chunk["choices"] else {}
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            finish = choice.get("finish_reason") or finish
    return {"status": response.status_code, "text": text, "finish": finish, "events": events}


def answer_text(reply: dict) -> tuple[str, str]:
    if "text" in reply:
        return reply["text"], reply["finish"]
    choice = reply["json"]["choices"][0]
    return choice.get("text", choice.get("message", {}).get("content")), choice["finish_reason"]


def metric(text: str, name: str, **labels) -> float:
    """A sample's value in Prometheus's text format (0 when absent)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in labels.items())
    pattern = rf"^{re.escape(name)}{re.escape('{' + wanted + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def ended(page: str, outcomes=("stop", "length", "cancelled")) -> float:
    """Requests that got a row and ended, by the metrics page."""
    return sum(
        metric(page, "specheads_requests_total", endpoint=endpoint, outcome=outcome)
        for endpoint in ("completions", "chat")
        for outcome in outcomes
    )


async def wait_for(client: httpx.AsyncClient, count: int, outcomes=("stop", "length", "cancelled")) -> str:
    """The metrics page once `count` requests ended so (the server notices a closed stream on its own time)."""
    deadline = time.monotonic() + WAIT
    while True:
        page = (await client.get("/metrics")).text
        if ended(page, outcomes) >= count:
            return page
        assert time.monotonic() < deadline, f"{count} requests never ended as {outcomes}"
        await asyncio.sleep(0.05)


async def leave_early(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    """A greedy stream of up to 200 tokens whose client goes away after its first chunk (returned)."""
    body = {**body, "max_tokens": 200, "temperature": 0, "stream": True}
    async with client.stream("POST", path, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])


MALFORMED = [  # (path, body, status, the field the message names)
    ("/v1/completions", '{"prompt": "the cat", "max_tokens": 4', 400, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"prompt": "the cat", "max_tokens": 4, "frequency": 1}, 400, "'frequency'"),
    ("/v1/completions", {"prompt": "   ", "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 999999], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": [5, 6.5], "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "the cat", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "the cat", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "the " * 600, "max_tokens": 1}, 400, "prompt"),
    ("/v1/completions", {"prompt": "the cat", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "the cat", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "the cat", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"prompt": "the cat", "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "the cat", "model": "gpt-5"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "text": "hi"}]}, 400, "messages.0."),
]


def test_concurrent_requests_answer_as_generate_alone_and_bad_input_is_refused(chat_model):
    """Greedy requests of every kind (completions and chat, streamed and whole, text and token ids, a stop string)
    at once through four rows with an EAGLE head, beside malformed requests and a stream whose client leaves: each
    answer is generate()'s for that prompt alone, each bad request a 400 (404 for an unknown model) whose message
    names the field, and the server goes on serving."""
    model, tokenizer = chat_model
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True)).eval()
    tree = DynamicTreeSpec(depth=3, top_k=2, nodes=6)
    app = server_app(model, tokenizer, head, tree=tree, fallback=False, batch_size=4, queue_size=32, name="tiny")
    texts = ["the cat runs over a lazy fox", "red sun", "big old house by the sea", "a quick blue car"]
    cases = []  # (path, body, the reference Generation, stop)
    for number, text in enumerate(texts):
        new = 6 + 9 * number
        reference = generate(model, None, text, tokenizer=tokenizer, max_new_tokens=new)
        cases.append(("/v1/completions", {"prompt": text, "max_tokens": new, "temperature": 0}, reference))
        ids = chat_ids(tokenizer, text)
        reference = generate(model, None, ids, tokenizer=tokenizer, max_new_tokens=new)
        messages = [{"role": "user", "content": text}]
        cases.append(("/v1/chat/completions", {"messages": messages, "max_tokens": new, "temperature": 0}, reference))
    for index, (_, body, _) in enumerate(cases):
        body["stream"] = index % 3 == 1
    ids = tokenizer("green tree")["input_ids"]
    reference = generate(model, None, ids, tokenizer=tokenizer, max_new_tokens=12)
    cases.append(("/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 0}, reference))
    stop_path, stop_body, stop_reference = max(cases, key=lambda case: len(case[2].text.split()))
    stop = stop_reference.text.split()[2]  # the third word of an answer ends it before that word
    stop_body = {**stop_body, "stop": [stop, "zzz"], "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=WAIT) as client:
            calls = [post(client, path, body) for path, body, _ in cases]
            calls += [post(client, path, body) for path, body, _, _ in MALFORMED]
            leaving = leave_early(client, "/v1/completions", {"prompt": "the dog jumps"})
            calls += [post(client, stop_path, stop_body), leaving]
            results = await asyncio.gather(*calls)
            page = await wait_for(client, len(cases) + 2)  # the one whose client left too
            after = await post(client, *cases[0][:2])  # served after all of it
            health = (await client.get("/health")).json()
            models = (await client.get("/v1/models")).json()
        return results, page, after, health, models

    with serving(app) as base:
        results, page, after, health, models = asyncio.run(scenario())
    answers, refusals = results[: len(cases)], results[len(cases) : len(cases) + len(MALFORMED)]
    stopped, first_chunk = results[-2:]
    for (path, body, reference), reply in zip(cases, answers):
        assert reply["status"] == 200, (path, body, reply)
        text, finish = answer_text(reply)
        assert text == reference.text, (path, body)
        ended_at_eos = reference.token_ids[-1] == model.generation_config.eos_token_id
        assert finish == ("stop" if ended_at_eos else "length"), (path, body)
        if "json" in reply:
            assert reply["json"]["usage"]["completion_tokens"] == len(reference.token_ids)
        else:
            assert reply["events"][-1] == "[DONE]"
    for (_, body, status, named), reply in zip(MALFORMED, refusals):
        assert reply["status"] == status, (body, reply)
        error = reply["json"]["error"]
        assert named in error["message"] or named == error["param"], (body, error)
    assert stopped["status"] == 200 and stopped["finish"] == "stop"
    assert stopped["text"] == stop_reference.text[: stop_reference.text.index(stop)]
    assert first_chunk["choices"][0]["finish_reason"] is None
    assert answer_text(after) == answer_text(answers[0])
    assert health["status"] == "ok" and models["data"][0]["id"] == "tiny"
    assert ended(page) == len(cases) + 2  # each once: none lost, none answered twice
    assert ended(page, ("400", "404")) == len(MALFORMED)
    answered = ended(page, ("stop", "length"))  # all but the one whose client left, unless it ended first
    assert answered in (len(cases) + 1, len(cases) + 2)
    assert metric(page, "specheads_drafted_to_depth_total", depth="1") > 0
    for name in ("specheads_time_to_first_token_seconds_count", "specheads_tokens_per_target_pass_count"):
        assert metric(page, name) == answered


class Gate(TokenDrafter):
    """Proposes only the root, after waiting for `opened`: while it waits, the decoding thread is held in a step."""

    def __init__(self):
        self.entered, self.opened, self.calls = threading.Event(), threading.Event(), 0

    def propose(self, tokens, max_depth):
        self.calls += 1
        self.entered.set()
        assert self.opened.wait(WAIT), "the test never opened the gate"
        return root_only(tokens)


def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_row(chat_model):
    """One row, one place in the queue: a request decodes (held inside a step), a second waits, a third gets a 429
    while /health still answers. The first client leaves: its row goes at the next step, and the second, sampled
    with a seed, answers what generate() alone draws."""
    model, tokenizer = chat_model
    first = {"prompt": "the cat", "max_tokens": 100, "temperature": 0, "stream": True}
    assert len(generate(model, None, first["prompt"], tokenizer=tokenizer, max_new_tokens=3).token_ids) == 3
    gate = Gate()
    app = server_app(model, tokenizer, gate, fallback=False, batch_size=1, queue_size=1, warm_batch=False)
    sampled = {"prompt": "a lazy dog", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "seed": 11, "stream": True}
    reference = generate(
        model, None, sampled["prompt"], tokenizer=tokenizer, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=11
    )

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=WAIT) as client:
            async with client.stream("POST", "/v1/completions", json=first) as leaving:
                assert leaving.status_code == 200
                assert await asyncio.to_thread(gate.entered.wait, WAIT)
                async with client.stream("POST", "/v1/completions", json=sampled) as waiting:
                    assert waiting.status_code == 200
                    refused = await client.post("/v1/completions", json={"prompt": "the sun", "max_tokens": 2})
                    health = (await client.get("/health")).json()
                    await leaving.aclose()  # the first client goes away, its row held in a step
                    await wait_for(client, 1, ("cancelled",))
                    gate.opened.set()
                    lines = [line async for line in waiting.aiter_lines() if line.startswith("data: {")]
            later = await client.post("/v1/completions", json={"prompt": "the sun", "max_tokens": 2})
        return refused, health, lines, later

    with serving(app) as base:
        refused, health, lines, later = asyncio.run(scenario())
    assert refused.status_code == 429 and "retry later" in refused.json()["error"]["message"]
    assert health["status"] == "ok" and health["waiting"] == 1
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)
    assert text == reference.text
    # the leaving row took the step it was held in, and at most one more; the sampled row one a token after its first
    assert gate.calls <= 2 + len(reference.token_ids) - 1
    assert later.status_code == 200


def test_the_loop_driven_a_step_at_a_time_admits_cancels_and_stays_exact():
    """Prompts added between steps join the batch, a cancelled row leaves it, every other row is HF's greedy."""
    from inference import loop

    model = tiny_model("llama", eos=None)
    prompts = random_prompts(model.config.vocab_size, 5, seed=3)
    references = [hf_greedy(model, p, 12) for p in prompts]
    state = loop.start(model, NoDrafter(), [], Fallback(enabled=False), batch_size=3)
    seen = []
    with torch.inference_mode():
        rows = [
            loop.add(state, p, 12, Sampling(), on_tokens=lambda tokens, done: seen.append(done)) for p in prompts[:2]
        ]
        assert loop.step(state) and len(state.active) == 2
        rows += [loop.add(state, p, 12, Sampling()) for p in prompts[2:]]
        rows[1].cancelled = True
        assert loop.step(state) and rows[1] not in state.active and len(state.active) == 3  # two joined, one left
        while loop.step(state):
            pass
    for index, (row, reference) in enumerate(zip(rows, references)):
        if index == 1:
            assert row.finish is None and len(row.new_tokens) < 12
        else:
            assert row.new_tokens == reference and row.finish == "length"
    assert seen.count(True) == 1  # the first row's end; the cancelled one never ends


def test_text_is_held_back_while_it_may_start_a_stop_string():
    class Characters:  # one character a token
        def decode(self, tokens, skip_special_tokens=True):
            return "".join(map(chr, tokens))

    stream = TextStream(Characters(), ["o w"])
    pieces = [stream.push([ord(c) for c in part], False) for part in ("he", "llo", " ", "wor")]
    assert pieces == [("", False), ("hel", False), ("l", False), ("", True)]
    plain = TextStream(Characters(), [])
    assert plain.push([ord("a")], False) == ("a", False) and plain.push([ord("b")], True) == ("b", False)


class FailsOnce(TokenDrafter):
    """Raises at its first proposal (a drafter's bug), then proposes only the root."""

    def __init__(self):
        self.failed = False

    def propose(self, tokens, max_depth):
        if not self.failed:
            self.failed = True
            raise RuntimeError("a drafter's bug")
        return root_only(tokens)


def test_a_fault_in_decoding_ends_its_requests_with_an_error_and_the_server_goes_on(chat_model):
    model, tokenizer = chat_model
    app = server_app(model, tokenizer, FailsOnce(), fallback=False, batch_size=2, warm_batch=False)
    body = {"prompt": "the old moon", "max_tokens": 5, "temperature": 0}
    reference = generate(model, None, body["prompt"], tokenizer=tokenizer, max_new_tokens=5)
    assert len(reference.token_ids) > 1  # so its row drafts

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=WAIT) as client:
            failed = await client.post("/v1/completions", json=body)
            answered = await client.post("/v1/completions", json=body)
            health = await client.get("/health")
        return failed, answered, health

    with serving(app) as base:
        failed, answered, health = asyncio.run(scenario())
    assert failed.status_code == 500 and "a drafter's bug" in failed.json()["error"]["message"]
    assert answered.status_code == 200 and answered.json()["choices"][0]["text"] == reference.text
    assert health.status_code == 200


@pytest.mark.slow
def test_the_default_target_under_16_clients_answers_as_generate_alone(shared_dir):
    """SmolLM2-135M in float32 with the shipped EAGLE head: 16 dev questions at once, through chat completions, some
    streamed, beside two streams whose clients leave after their first chunk: each answer is what generate() gives
    that prompt alone, token for token (the usage's count too), and none is lost or answered twice."""
    model, tokenizer = load_target(dtype="float32", compile=False)
    head = load_heads(str(CHECKPOINTS / "smollm2-135m-instruct-eagle"), model)
    tree = DynamicTreeSpec(depth=5, top_k=8, nodes=16)
    app = server_app(model, tokenizer, head, tree=tree, fallback=False, batch_size=16, queue_size=16, name="smollm2")
    lines = (shared_dir / "data" / "eval" / "dev.jsonl").read_text().splitlines()[:18]
    questions = [json.loads(line)["turns"][0] for line in lines]
    new = 40
    references = [
        generate(model, None, chat_ids(tokenizer, q), tokenizer=tokenizer, max_new_tokens=new) for q in questions[:16]
    ]

    async def scenario():
        async with httpx.AsyncClient(base_url=base, timeout=10 * WAIT) as client:
            calls = [
                post(
                    client,
                    "/v1/chat/completions",
                    {
                        "messages": [{"role": "user", "content": question}],
                        "max_tokens": new,
                        "temperature": 0,
                        "stream": number % 2 == 1,
                    },
                )
                for number, question in enumerate(questions[:16])
            ]
            calls += [
                leave_early(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": question}]})
                for question in questions[16:]
            ]
            results = await asyncio.gather(*calls)
            return results, await wait_for(client, 18)

    with serving(app) as base:
        results, page = asyncio.run(scenario())
    for reference, reply in zip(references, results[:16]):
        assert reply["status"] == 200 and answer_text(reply)[0] == reference.text
        if "json" in reply:
            assert reply["json"]["usage"]["completion_tokens"] == len(reference.token_ids)
    assert ended(page) == 18 and ended(page, ("stop", "length")) >= 16


def test_a_server_whose_caller_runs_the_decode_loop_serves_and_stops(chat_model):
    """decoding_thread=False (python -m inference.serve: the loop on the main thread, uvicorn in another): the app
    takes no thread of its own, the caller's run() answers requests exactly, and it returns when the server stops."""
    model, tokenizer = chat_model
    app = server_app(model, tokenizer, None, batch_size=2, queue_size=4, name="tiny", decoding_thread=False)
    batcher = app.state.batcher
    decoding = threading.Thread(target=batcher.run)  # stands in for the main thread
    decoding.start()
    reference = generate(model, None, "the cat runs", tokenizer=tokenizer, max_new_tokens=8)

    async def ask():
        async with httpx.AsyncClient(base_url=base, timeout=WAIT) as client:
            body = {"prompt": "the cat runs", "max_tokens": 8, "temperature": 0}
            return await post(client, "/v1/completions", body)

    with serving(app) as base:
        assert not batcher.thread.is_alive(), "no thread of its own"
        reply = asyncio.run(ask())
    assert reply["status"] == 200 and answer_text(reply)[0] == reference.text
    decoding.join(WAIT)  # the server's shutdown (its lifespan) ended the caller's loop
    assert not decoding.is_alive() and not batcher.alive


class Delivered(list):
    """Stands in for a request's event loop and queue: what the decoding thread hands it, at once, in order."""

    def call_soon_threadsafe(self, put, item):
        put(item)

    def put_nowait(self, item):
        self.append(item)


def test_requests_that_arrive_during_a_prefill_get_their_first_token_before_the_batch_decodes(chat_model):
    from inference.serve.batcher import Job

    model, tokenizer = chat_model
    app = server_app(model, tokenizer, None, batch_size=3, queue_size=4, name="tiny", decoding_thread=False)
    batcher = app.state.batcher
    batcher.start()
    jobs = []

    def submit(text: str) -> Job:
        events = Delivered()
        job = Job(torch.tensor(chat_ids(tokenizer, text)), 6, Sampling(), None, events, events)
        batcher.submit(job)
        jobs.append(job)
        return job

    first = submit("the old moon")
    prefill = model.forward

    def arriving_during_the_first_prefill(*args, **kwargs):  # two requests arrive while the first is prefilled
        if len(jobs) == 1:
            submit("a river")
            submit("three small birds")
        return prefill(*args, **kwargs)

    model.forward = arriving_during_the_first_prefill
    try:
        with torch.inference_mode():
            assert batcher.take_arrivals()
            batcher.admit_arrivals()
    finally:
        del model.forward
    assert len(batcher.state.active) == 3
    for job in jobs:  # each has its first token, and no row has decoded a step yet
        assert [len(tokens) for tokens, done in job.events] == [1]
        assert job.row.length == job.row.prompt_length + 1
    assert first.row is batcher.state.active[0]
    batcher.stop()


def test_the_warm_up_computes_what_chat_prompts_start_with(chat_model):
    from inference.generate import eos_ids, plan
    from inference.serve import chat_start
    from inference.serve.batcher import Batcher
    from inference.serve.metrics import Metrics

    model, tokenizer = chat_model
    start = chat_start(tokenizer)
    assert start and start == chat_ids(tokenizer, "a river")[: len(start)]
    start = list(range(4, 24))  # a longer system prompt than the tiny template's
    chosen = plan(model, None, None, None, True, batch=(2, 2))
    batcher = Batcher(model, chosen, eos_ids(model), 2, 4, Metrics(2), own_thread=False, prompt_start=start)
    with torch.inference_mode():
        batcher.warm_up()
    assert batcher.state.prefix.tokens.tolist() == start
