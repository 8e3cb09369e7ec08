"""The default target, SmolLM2-135M-Instruct, on the first 20 dev prompts, 64 new tokens each.

float32: identical to Hugging Face greedy generate(), token for token.
bfloat16: a pass over a tree does not round exactly like one-token passes, and bf16 logits are coarse
(a step of 0.125 around 20), so exact ties are common. A divergence is allowed only where a
teacher-forced pass proves a near-tie: both tokens are the top two and their logits are within a few
bf16 steps. The proof itself is tested to reject a divergence that is not a tie.
"""

import json

import pytest
import torch

from heads import MedusaConfig, MedusaHeads
from inference import OracleDrafter, PromptLookupDrafter, best_static_paths, generate, load_target, numerics
from inference.tree_size import default_accuracy

pytestmark = pytest.mark.slow
NEW_TOKENS, PROMPTS = 64, 20
ORACLE_TREE = best_static_paths(15, default_accuracy(depth=6, ranks=3))


def dev_prompts(shared_dir, tokenizer):
    lines = (shared_dir / "data" / "eval" / "dev.jsonl").read_text().splitlines()[:PROMPTS]
    prompts = []
    for line in lines:
        messages = [{"role": "user", "content": json.loads(line)["turns"][0]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        prompts.append(torch.tensor(ids))
    return prompts


def hf_greedy(model, prompt):
    out = model.generate(
        prompt[None],
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
    )
    return out[0, len(prompt) :].tolist()


def oracle(model, prompt, reference):
    return OracleDrafter(
        torch.cat([prompt, torch.tensor(reference, dtype=torch.long)]), ORACLE_TREE, model.config.vocab_size
    )


def test_float32_is_identical_to_hf_greedy(shared_dir):
    model, tokenizer = load_target(dtype="float32", compile=False)
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=3)).eval()  # untrained
    mismatches, taus = [], []
    for i, prompt in enumerate(dev_prompts(shared_dir, tokenizer)):
        reference = hf_greedy(model, prompt)
        out = generate(model, oracle(model, prompt, reference), prompt, max_new_tokens=NEW_TOKENS, fallback=False)
        taus.append(out.stats.mean_accepted)
        if out.token_ids != reference:
            mismatches.append((i, "oracle tree"))
        if i < 5:  # real drafters too: untrained Medusa heads merged with prompt lookup
            out = generate(
                model, [medusa, PromptLookupDrafter()], prompt, max_new_tokens=NEW_TOKENS, tree=[(0,), (1,), (0, 0)]
            )
            if out.token_ids != reference:
                mismatches.append((i, "medusa+lookup"))
    assert not mismatches
    assert min(taus) > 3, "the oracle's whole paths should be accepted"


def near_tie(model, context, ours, theirs) -> bool:
    return numerics.near_tie(model, context, ours, theirs)[0]


def test_bfloat16_diverges_only_at_proven_near_ties(shared_dir):
    model, tokenizer = load_target(dtype="bfloat16", compile=False)
    identical, diverged, refuted = 0, [], 0
    for prompt in dev_prompts(shared_dir, tokenizer):
        reference = hf_greedy(model, prompt)
        ours = generate(model, oracle(model, prompt, reference), prompt, max_new_tokens=NEW_TOKENS).token_ids
        d = next((i for i, (a, b) in enumerate(zip(ours, reference)) if a != b), None)
        if d is None:
            assert ours == reference
            identical += 1
            continue
        context = prompt.tolist() + reference[:d]
        diverged.append((d, near_tie(model, context, ours[d], reference[d])))
        # the proof must be able to fail: the first and the 100th token are never a near-tie here, and at the
        # prompt's end (a confident first token, for most prompts) neither are the first and second
        with torch.no_grad():
            ranked = model(torch.tensor([context])).logits[0, -1].topk(100).indices.tolist()
            first = model(prompt[None]).logits[0, -1].topk(2).indices.tolist()
        assert not near_tie(model, context, ranked[0], ranked[99])
        refuted += not near_tie(model, prompt.tolist(), first[0], first[1])
    not_ties = [d for d, ok in diverged if not ok]
    assert not not_ties, f"divergences that are not near-ties at positions {not_ties}"
    assert refuted >= len(diverged) // 2, (
        f"the near-tie proof accepted {len(diverged) - refuted} confident first tokens"
    )
    print(f"\nbf16: {identical}/{PROMPTS} identical; divergences at {[d for d, _ in diverged]}, all proven near-ties")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_shipped_heads_load_on_the_default_target_in_every_dtype(dtype):
    from pathlib import Path

    from heads import load_heads

    model, _ = load_target(dtype=dtype, compile=False)
    shipped = sorted((Path(__file__).resolve().parents[1] / "checkpoints").glob("smollm2-135m-instruct-*"))
    assert len(shipped) >= 6, shipped
    for checkpoint in shipped:
        heads = load_heads(checkpoint, model)
        assert next(heads.parameters()).dtype == model.dtype, checkpoint.name


def test_the_shipped_serving_layout_head_converts_with_no_flag_and_decodes_exactly(shared_dir, tmp_path):
    """checkpoints/smollm2-135m-instruct-eagle3 goes to speculators' and EAGLE-3's formats as it is (what vLLM and
    SGLang load), comes back with the same weights, and decodes what HF greedy gives."""
    from pathlib import Path

    from heads import load_heads
    from heads.formats import detect_format
    from inference import DynamicTreeSpec
    from inference.convert import main as convert

    shipped = Path(__file__).resolve().parents[1] / "checkpoints" / "smollm2-135m-instruct-eagle3"
    model, tokenizer = load_target(dtype="float32", compile=False)
    original = load_heads(shipped, model)
    for fmt in ("speculators", "eagle3"):
        convert([str(shipped), str(tmp_path / fmt), "--to", fmt])
        assert detect_format(tmp_path / fmt) == fmt
        loaded = load_heads(tmp_path / fmt, model)
        assert loaded.config.architecture == "eagle3"
        assert torch.equal(loaded.draft_ids, original.draft_ids)
        theirs = loaded.state_dict()
        for name, tensor in original.state_dict().items():
            assert torch.equal(theirs[name], tensor), name
    for prompt in dev_prompts(shared_dir, tokenizer)[:3]:
        out = generate(
            model,
            loaded,
            prompt,
            max_new_tokens=NEW_TOKENS,
            tree=DynamicTreeSpec(depth=4, top_k=4, nodes=10),
            lookup=False,
            fallback=False,
        )
        assert out.token_ids == hf_greedy(model, prompt)
        assert out.stats.mean_accepted > 1.2  # the head drafted, and the target took some of it
