"""Early-exit drafting (heads.early_exit): the target's first layers draft, a LoRA adapter adapts them, and the
verifying target is never changed by it."""

import json

import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

from conftest import hf_greedy, tiny_model
from heads import EarlyExitConfig, EarlyExitHead, HeadConfigError, load_heads, save_heads
from inference import DynamicTreeSpec, EarlyExitDrafter, PromptLookupDrafter, Sampling, generate
from test_exactness_tiny import NEW_TOKENS, random_prompts
from test_sampling import COUNTS, VOCAB, engine_tv, exact_distribution, exact_sampler_band


def early_exit(model, exit_layer=1, rank=4, seed=1, std=0.2):
    """A head whose adapter is not the identity (LoRA's B starts at zero): its drafts differ from the plain exit."""
    head = EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=exit_layer, lora_rank=rank), model)
    if rank:
        torch.manual_seed(seed)
        for parameter in head.parameters():
            torch.nn.init.normal_(parameter, std=std)
    return head.eval()


def exit_state(model, ids, exit_layer):
    """What the target's own first layers say at the exit: their hidden state through the final norm."""
    hidden = model(ids, output_hidden_states=True).hidden_states[exit_layer]
    return (model.model.norm if hasattr(model, "model") else model.transformer.ln_f)(hidden)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_an_untrained_exit_is_the_targets_own_first_layers_on_shared_weights(family):
    model = tiny_model(family)
    head = EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=1, lora_rank=None), model)
    ids = torch.randint(4, 97, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(head(ids), exit_state(model, ids, 1), atol=0, rtol=0)
    shared = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in shared for p in head.draft.parameters()), "the draft must not copy the target's weights"
    assert list(head.parameters()) == [], "an untrained exit has nothing of its own"


def test_the_adapter_never_touches_the_verifying_target():
    model = tiny_model("llama")
    ids = torch.randint(4, 97, (1, 20))
    with torch.no_grad():
        before = model(ids).logits
        names = [name for name, _ in model.named_parameters()]
        head = early_exit(model)
        adapted = head(ids)
        generate(model, head, ids[0], max_new_tokens=10, tree=DynamicTreeSpec(depth=3, top_k=2, nodes=6))
        after = model(ids).logits
    assert torch.equal(before, after), "the target's logits must stay bit-identical"
    assert [name for name, _ in model.named_parameters()] == names, "no adapter may be injected into the target"
    assert not torch.allclose(adapted, exit_state(model, ids, 1)), "the adapter should change the draft"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_the_merged_draft_computes_what_the_adapted_one_does_and_leaves_the_target_alone(family):
    """The compiled exit pass runs the draft with its adapter folded into its weights (new tensors); GPT-2's Conv1D
    maps keep theirs unmerged."""
    model = tiny_model(family)
    head, ids = early_exit(model), torch.randint(4, 97, (2, 12))
    target = {name: p.clone() for name, p in model.state_dict().items()}
    merged = head.merged_draft()
    with torch.no_grad():
        torch.testing.assert_close(merged.base_model(input_ids=ids).last_hidden_state, head(ids), atol=1e-4, rtol=0)
    assert all(torch.equal(target[name], p) for name, p in model.state_dict().items()), "the target changed"
    adapted = [m for m in merged.modules() if isinstance(m, LoraLayer)]
    assert (adapted == []) == (family == "llama")  # Llama's adapted maps are plain products now
    assert any(isinstance(m, LoraLayer) for m in head.draft.modules()), "the head's own draft keeps its adapter"


class CheckedEarlyExitDrafter(EarlyExitDrafter):
    """Checks at every step that the draft's cache holds the committed text only: its output for the root equals
    a fresh pass over the whole text (but the start of a long prompt it skipped: prompt_window), and the draft entries
    of the last proposal are gone."""

    def propose_rows(self, texts, max_depths, host_texts=None):  # what the loop calls: one row here
        (tokens,) = texts
        trees = super().propose_rows(texts, max_depths, host_texts)
        skipped = self.rows[0].skipped
        assert self.cache.get_seq_length() == self.lengths[0] == tokens.shape[0] - skipped
        with torch.no_grad():
            fresh = self.head(tokens[None, skipped:])[0, -1]
        self.skipped = max(getattr(self, "skipped", 0), skipped)
        # float32 summed in another order moves it by up to ~2e-4 (seen on one CPU); one stale or leaked entry
        # moves it by about 1 (the median over 50 random prefixes), so a cache bug fails at most of its steps
        torch.testing.assert_close(self.last[0], fresh, atol=1e-2, rtol=0)
        self.steps = getattr(self, "steps", 0) + 1
        return trees


@pytest.mark.parametrize("family,attn", [("llama", "sdpa"), ("qwen2", "eager")])
def test_early_exit_matches_hf_greedy(family, attn):
    model = tiny_model(family, attn=attn)
    head = early_exit(model)
    untrained = EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=1, lora_rank=None), model).eval()
    spec = DynamicTreeSpec(depth=4, top_k=3, nodes=10)
    mismatches, accepted = [], []
    for i, prompt in enumerate(random_prompts(model.config.vocab_size, 50, seed=11)):
        reference = hf_greedy(model, prompt, NEW_TOKENS)
        checked, windowed = CheckedEarlyExitDrafter(head, model, spec), CheckedEarlyExitDrafter(head, model, spec)
        windowed.prompt_window = 5  # a prompt's last 5 tokens: its first ones are never read
        cases = [
            ("adapted", checked, None),
            ("untrained", untrained, spec),
            ("merged with lookup", [head, PromptLookupDrafter()], DynamicTreeSpec(depth=3, top_k=2, nodes=6)),
        ]
        if i % 5 == 0:
            cases.append(("a prompt's last tokens", windowed, None))
        for name, heads, tree in cases:
            out = generate(model, heads, prompt, max_new_tokens=NEW_TOKENS, tree=tree, lookup=False, fallback=False)
            if out.token_ids != reference:
                mismatches.append((i, name))
            accepted.append(out.stats.mean_accepted)
        assert checked.steps > 0
        if i % 5 == 0:  # its first read: the prompt and the first new token
            assert windowed.skipped == max(prompt.shape[0] + 1 - 5, 0)
    assert not mismatches, mismatches[:5]
    assert max(accepted) > 1.5, "some drafts should be accepted, or exactness was tested on empty trees"


def test_saved_adapter_loads_here_and_in_peft(tmp_path):
    model = tiny_model("llama")
    head = early_exit(model)
    path = save_heads(head, tmp_path / "exit", model, dtype=torch.float32)
    assert {p.name for p in path.iterdir()} == {
        "config.json",
        "model.safetensors",
        "adapter_config.json",
        "adapter_model.safetensors",
    }
    loaded = load_heads(path, model)
    ids = torch.randint(4, 97, (1, 15))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), head(ids), atol=0, rtol=0)
        # peft reads the same files onto the whole target: its hidden state at the exit is the draft's
        peft_model = PeftModel.from_pretrained(tiny_model("llama"), str(path))
        hidden = peft_model(ids, output_hidden_states=True).hidden_states[1]
        torch.testing.assert_close(peft_model.base_model.model.model.norm(hidden), head(ids), atol=1e-6, rtol=1e-5)


def test_untrained_exit_saves_without_an_adapter(tmp_path):
    model = tiny_model("llama")
    head = EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=1, lora_rank=None), model)
    path = save_heads(head, tmp_path / "exit", model)
    assert {p.name for p in path.iterdir()} == {"config.json", "model.safetensors"}
    assert isinstance(load_heads(path, model), EarlyExitHead)


def test_bad_early_exit_configs_are_named(tmp_path):
    model = tiny_model("llama")
    for exit_layer, message in (
        (0, "exit_layer must be >= 1"),
        (2, "from 1 to 1"),
        (5, "from 1 to 1"),
    ):  # the tiny target has 2 layers
        with pytest.raises(HeadConfigError, match=message):
            EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=exit_layer), model)
    with pytest.raises(HeadConfigError, match="lora_rank must be >= 1"):
        EarlyExitConfig.for_target(model.config, lora_rank=0)
    with pytest.raises(HeadConfigError, match="name no module"):
        EarlyExitHead(EarlyExitConfig.for_target(model.config, exit_layer=1, lora_targets=["no_such_proj"]), model)
    path = save_heads(early_exit(model), tmp_path / "exit", model)
    with pytest.raises(HeadConfigError, match="trained for"):
        load_heads(path, tiny_model("llama", seed=3))  # another model's weights
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    with pytest.raises(HeadConfigError, match="r is 8"):
        load_heads(path, model)
    (path / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(HeadConfigError, match="cannot be read"):
        load_heads(path, model)


@pytest.mark.slow
def test_early_exit_sampling_is_in_distribution():
    model = tiny_model("llama", vocab_size=VOCAB, init=0.25, eos=None, seed=5)
    sampling = Sampling(temperature=1.0)
    exact = exact_distribution(model, sampling)
    ours = engine_tv(
        model, early_exit(model, seed=2, std=0.05), sampling, exact, tree=DynamicTreeSpec(depth=3, top_k=2, nodes=5)
    )
    for n in COUNTS:
        assert ours[n] < exact_sampler_band(exact, n), (
            f"TV {ours[n]:.4f} at {n} samples is outside an exact sampler's band"
        )
