"""Section 3 of scripts/gpu_check.py, the engine at scale: a Llama-3.1-8B-shaped model with random weights, driven by
a drafter that replays a trained head's accepted lengths against HF greedy's continuation; the speedup over HF
generate() on the same model, and where the loop's time goes. Its random-weight Llamas serve the dry run too.
"""

from __future__ import annotations

import gc
import random
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig

from common import Run, Tally, hf_greedy, synchronize, table, timed, while_time_allows
from inference import Tree, generate
from inference.drafters import TokenDrafter
from inference.target import dtype_name

# ACCEPTED_LENGTHS[n]: how many drafting steps accepted exactly n drafted tokens in
# docs/results/dev2-aoti-head-default-bf16-epyc (the CPU stage-2 EAGLE head through the default call, bfloat16,
# compiled; 38 turns), from the record's accepted_to_depth counts: 2.18 drafts accepted a step on average.
ACCEPTED_LENGTHS = (278, 633, 191, 87, 49, 70, 8, 18, 22, 8, 94)
REPLAY_DEPTH = len(ACCEPTED_LENGTHS) - 1  # deep enough for the longest accepted length recorded
REPLAY_ROUNDS = 4  # runs of a prompt at most, until the loop reproduces the continuation it replays


SHAPE_KEYS = (
    "hidden_size num_hidden_layers num_attention_heads num_key_value_heads intermediate_size vocab_size".split()
)


def llama_shape(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> dict:
    """LlamaConfig's size arguments."""
    sizes = (hidden, layers, heads, kv_heads, intermediate, vocab)
    return dict(zip(SHAPE_KEYS, sizes, strict=True))


LLAMA_8B_SHAPE = llama_shape(4096, 32, 32, 8, 14336, 128256)  # Llama-3.1-8B's (its config.json)


def random_llama(shape: dict, device, dtype: torch.dtype, *, seed: int, eos: int | None, init: float = 0.02):
    """A Llama of `shape` with random weights, created on `device` in `dtype` (no float32 copy on the host first:
    an 8B model would need 32 GB of it). Without `eos` it decodes to max_new_tokens, as a benchmark wants."""
    pad = eos if eos is not None else 0
    config = LlamaConfig(
        **shape,
        max_position_embeddings=4096,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    return model.eval()


def random_prompts(vocab_size: int, count: int, length: int, low: int = 0) -> list[torch.Tensor]:
    """`count` prompts of random token ids in [low, vocab_size), of `length` tokens or a little fewer."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(low, vocab_size, (length - i % 3,), generator=generator) for i in range(count)]


class ReplayDrafter(TokenDrafter):
    """Replays accepted lengths: a chain of `depth` tokens a step whose first n are the true continuation and the rest
    wrong, n drawn from `lengths` (lengths[n]: how often n were accepted). A random-weight model has no trained head,
    but the target then accepts exactly n drafts a step, as with one, so the engine runs at a head's pace. Like
    OracleDrafter it knows the answer: `continuation` is the whole expected sequence, prompt included."""

    def __init__(self, continuation: torch.Tensor, depth: int, vocab_size: int, lengths=ACCEPTED_LENGTHS, seed=0):
        self.continuation, self.depth, self.vocab_size = continuation, depth, vocab_size
        self.lengths, self.seed = tuple(lengths), seed
        self.reset()

    def reset(self, rows: int = 1) -> None:
        self.draws = random.Random(self.seed)  # every run of a prompt replays the same lengths, step by step

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        position = tokens.shape[0]
        truth = self.continuation[position : position + min(self.depth, max_depth)]
        right = min(self.draws.choices(range(len(self.lengths)), weights=self.lengths)[0], truth.shape[0])
        wrong = (truth[right:] + 1) % self.vocab_size  # never the target's own next token after a right prefix
        return Tree.chain(torch.cat([tokens[-1:], truth[:right], wrong]))


def expected_accepted(lengths: Sequence[int], depth: int) -> float:
    """Mean drafts accepted a step when n is drawn from `lengths` and a chain holds `depth`."""
    return sum(min(n, depth) * count for n, count in enumerate(lengths)) / sum(lengths)


@contextmanager
def passes_synchronised(model) -> Iterator[None]:
    """Each forward pass of `model` waits for the device before it returns, so that GenerationStats.target_seconds
    holds the pass's device time rather than its launches (the loop waits at every step anyway)."""
    handle = model.register_forward_hook(lambda module, inputs, output: synchronize())
    try:
        yield
    finally:
        handle.remove()


def replayed_run(model, prompt: torch.Tensor, reference: list[int], depth: int, max_new_tokens: int, seed: int):
    """(our loop's output replaying accepted lengths on `prompt`, its seconds, runs, whether it reproduced what it
    replayed). A bfloat16 pass over a chain does not round like HF's one-token passes, so the loop may part from HF's
    continuation at a near-tie, after which every replayed "true" token would be wrong; the run is then repeated with
    the loop's own output as the continuation until it reproduces it, and the last run counts."""
    truth = reference
    for runs in range(1, REPLAY_ROUNDS + 1):
        continuation = torch.cat([prompt, torch.tensor(truth, dtype=torch.long)]).to(model.device)
        drafter = ReplayDrafter(continuation, depth, model.config.vocab_size, seed=seed)
        with passes_synchronised(model):
            out, seconds = timed(
                lambda d=drafter: generate(
                    model, d, prompt, max_new_tokens=max_new_tokens, lookup=False, fallback=False
                )
            )
        if out.token_ids == truth:
            return out, seconds, runs, True
        truth = out.token_ids
    return out, seconds, REPLAY_ROUNDS, False


def scale(models, args, deadline: float) -> str:
    """The section's report; `models` are gpu_check.Models."""
    model, build_seconds = timed(models.large)
    prompts, depth, limit = models.large_prompts(args.scale_prompts), args.replay_depth, args.max_new_tokens
    replayed_run(model, prompts[0], hf_greedy(model, prompts[0], 8), depth, 8, seed=0)  # untimed: the first calls
    hf, ours, parts = Tally(), Tally(), Counter()
    loop = while_time_allows(list(enumerate(prompts)), deadline)
    for index, prompt in tqdm(loop, total=len(prompts), desc="3. engine at scale (prompts)"):
        reference, seconds = timed(lambda m=model, p=prompt: hf_greedy(m, p, limit))
        hf.add(Run([reference]), seconds)
        out, seconds, runs, reproduced = replayed_run(model, prompt, reference, depth, limit, seed=index)
        s = out.stats
        ours.add(Run([out.token_ids], s.target_forwards), seconds)
        parts.update(target=s.target_seconds, draft=s.draft_seconds, loop=s.engine_seconds, steps=s.target_forwards - 1)
        parts.update(runs=runs, reproduced=reproduced, identical=out.token_ids == reference)
    shape = ", ".join(f"{key.replace('_', ' ')} {getattr(model.config, key)}" for key in SHAPE_KEYS)
    dtype, done = model.dtype, hf.runs
    del model  # 16 GB at the 8B shape: given back to the device now, not when the allocator next needs it
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    speeds = [
        [name, f"{t.tokens_per_second:.1f}", f"{t.tokens_per_second / max(hf.tokens_per_second, 1e-9):.2f}x"]
        + [f"{t.tau or 1.0:.2f}", f"{1e3 / max(t.tokens_per_second, 1e-9):.1f}"]
        for name, t in (("HF generate()", hf), ("our loop, replayed lengths", ours))
    ]
    total, steps = max(parts["target"] + parts["draft"] + parts["loop"], 1e-9), max(parts["steps"], 1)
    split = [
        [part, f"{parts[key]:.2f}", f"{100 * parts[key] / total:.0f}%", f"{1e3 * parts[key] / steps:.2f}"]
        for part, key in (
            ("target passes (target_seconds, the prefills included)", "target"),
            ("drafting (draft_seconds: propose and observe)", "draft"),
            ("the loop (the rest: trees, masks, acceptance, cache)", "loop"),
        )
    ]
    return (
        f"A Llama with {shape}, random weights, built under `torch.device({str(models.device)!r})` in "
        f"{dtype_name(dtype)} in {build_seconds:.0f} s. {done} of {len(prompts)} prompts of about "
        f"{models.large_prompt_tokens} random token ids, {limit} new tokens each (no EOS). HF greedy gives each "
        f"prompt's continuation; a replay drafter drives our loop: a chain of {depth} tokens a step, the first n the "
        "continuation's and the rest wrong, n drawn from ACCEPTED_LENGTHS (the CPU stage-2 EAGLE head's through the "
        "default call in docs/results/dev2-aoti-head-default-bf16-epyc: "
        f"{1 + expected_accepted(ACCEPTED_LENGTHS, depth):.2f} tokens a pass expected). The loop reproduced the "
        f"continuation it replayed on {parts['reproduced']} of {done} prompts ({parts['runs'] / max(done, 1):.1f} runs "
        "a prompt, the last timed: a bfloat16 chain pass may part from HF's output at a near-tie); "
        f"{parts['identical']} of {done} outputs identical to HF's.\n\n"
        + table(["method", "tokens/s", "x HF generate()", "tau", "ms per new token"], speeds)
        + f"\nWhere our loop's time goes (GenerationStats over {parts['steps']} decode steps; a forward hook "
        "synchronises the device after each target pass, so that target_seconds holds the passes' device time):\n\n"
        + table(["part", "seconds", "share", "ms per decode step"], split)
    )
