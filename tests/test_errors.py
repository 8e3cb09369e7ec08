"""Bad input to generate() gets a clear error, raised before any work is done."""

import json
from types import SimpleNamespace

import pytest
import torch

import inference.target as target_module
from conftest import tiny_model
from heads import EagleConfig, EagleHead, HeadConfigError, MedusaConfig, MedusaHeads
from inference import DynamicTreeSpec, PromptLookupDrafter, TreeError, generate


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


PROMPT = torch.arange(4, 10)


@pytest.mark.parametrize(
    "prompt, kwargs, error, message",
    [
        (torch.tensor([], dtype=torch.long), {}, ValueError, "prompt is empty"),
        ("   ", {"tokenizer": object()}, ValueError, "prompt is empty"),
        ("hello", {}, ValueError, "needs tokenizer"),
        (torch.ones(2, 3, dtype=torch.long), {}, ValueError, "one sequence at a time"),
        (torch.tensor([5, 500]), {}, ValueError, r"token ids must be in \[0, 97\)"),
        (PROMPT, {"max_new_tokens": 251}, ValueError, "exceeds the model's context of 256"),
        (PROMPT, {"max_new_tokens": 0}, ValueError, "max_new_tokens must be a positive integer"),
        (PROMPT, {"temperature": -1.0}, ValueError, "temperature must be >= 0"),
        (PROMPT, {"temperature": 1.0, "top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        (PROMPT, {"temperature": 1.0, "top_p": 1.01}, ValueError, r"top_p must be in \(0, 1\]"),
        (PROMPT, {"temperature": "0.7"}, ValueError, "temperature must be a finite number, got '0.7'"),
        (PROMPT, {"temperature": 1.0, "top_p": "0.9"}, ValueError, "top_p must be a finite number"),
        (PROMPT, {"temperature": float("inf")}, ValueError, "temperature must be a finite number"),
        (PROMPT, {"temperature": 1.0, "top_k": "5"}, ValueError, "top_k must be a whole number"),
        (PROMPT, {"temperature": 1.0, "top_k": True}, ValueError, "top_k must be a whole number"),
        (PROMPT, {"temperature": 1.0, "top_k": 2.5}, ValueError, "top_k must be a whole number"),
        ([5.9, 7.2], {}, ValueError, "token ids must be integers, got torch.float32"),
        (torch.tensor([5.0, 7.0]), {}, ValueError, "token ids must be integers"),
        ([True, False], {}, ValueError, "token ids must be integers"),
        (
            [["a"], [3]],
            {},
            ValueError,
            "input_ids must be token ids",
        ),  # a batch of two prompts, the first not token ids
    ],
)
def test_bad_generation_input(model, prompt, kwargs, error, message):
    with pytest.raises(error, match=message):
        generate(model, None, prompt, **kwargs)


def test_tree_needing_more_heads_than_the_checkpoint_has(model):
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2))
    with pytest.raises(TreeError, match="needs 3 Medusa heads; the checkpoint has 2"):
        generate(model, heads, PROMPT, tree=[(0,), (0, 0), (0, 0, 0)])


def test_wrong_tree_kind_for_a_drafter(model):
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2))
    with pytest.raises(TreeError, match="static tree"):  # Medusa takes a DynamicTreeSpec or a list of paths
        generate(model, heads, PROMPT, tree="5,4,15")
    eagle = EagleHead(EagleConfig.for_target(model.config))
    with pytest.raises(TreeError, match="grows dynamic trees"):
        generate(model, eagle, PROMPT, tree=[(0,), (1,)])
    with pytest.raises(TreeError, match="with its own tree"):
        generate(model, PromptLookupDrafter(), PROMPT, tree=[(0,)])


def test_heads_built_for_another_model(model):
    other = tiny_model("llama", vocab_size=50)
    heads = MedusaHeads(MedusaConfig.for_target(other.config))
    with pytest.raises(HeadConfigError, match="built for another base model"):
        generate(model, heads, PROMPT)


def test_not_a_drafter(model):
    with pytest.raises(TypeError, match="heads must be None, heads from heads.load_heads, a Drafter"):
        generate(model, "medusa", PROMPT)


def test_sliding_window_models_are_refused_not_silently_wrong():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
    )
    with pytest.raises(NotImplementedError, match="sliding-window"):
        generate(MistralForCausalLM(config).eval(), None, PROMPT)


def test_attention_kernels_that_ignore_a_4d_mask_are_refused(model):
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            generate(model, None, PROMPT)
    finally:
        model.config._attn_implementation = "sdpa"


def test_a_model_whose_forward_takes_no_cache_argument_is_refused(model):
    class OldModelingCode(torch.nn.Module):  # modeling code from before transformers 5.24 named it past_key_values
        config = model.config

        def forward(self, input_ids, past_key_values=None, **kwargs):  # a `cache=` would land in kwargs, unused
            kwargs.pop("cache", None)
            return model(input_ids, past_key_values=past_key_values, **kwargs)

    with pytest.raises(ValueError, match="takes no `cache` argument"):
        generate(OldModelingCode(), None, PROMPT)


def test_a_tokenizer_output_is_accepted_as_prompt(model):
    assert (
        generate(model, None, {"input_ids": PROMPT.tolist()}, max_new_tokens=3).token_ids
        == generate(model, None, PROMPT, max_new_tokens=3).token_ids
    )
    with pytest.raises(ValueError, match="no 'input_ids'"):
        generate(model, None, {"ids": [1, 2]})


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(depth=2.5), "depth must be a whole number >= 1, got 2.5"),
        (dict(top_k=float("nan")), "top_k must be a whole number >= 1, got nan"),
        (dict(nodes=True), "nodes must be a whole number >= 1, got True"),
        (dict(top_k=100000), "top_k <= 64"),
        (dict(nodes=10**6), "nodes <= 1024"),
        (dict(cost=2.0), "cost must be a PassCost"),
    ],
)
def test_bad_tree_specs_are_refused(settings, message):
    with pytest.raises(TreeError, match=message):
        DynamicTreeSpec(**settings)


def test_eagle_trees_too_large_to_score_are_refused(model):
    with pytest.raises(TreeError, match="candidate nodes a step"):
        generate(
            model,
            EagleHead(EagleConfig.for_target(model.config)),
            PROMPT,
            tree=DynamicTreeSpec(depth=30, top_k=64, nodes=15),
        )


def test_medusa_ranks_beyond_the_draft_vocabulary_are_refused(model):
    heads = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2, draft_vocab_size=8))
    with pytest.raises(TreeError, match="asks for candidate rank 8, but the heads draft from 8 tokens"):
        generate(model, heads, PROMPT, tree=[(0,), (8,)])
    with pytest.raises(TreeError, match="asks for candidate rank 97, but the heads draft from 97 tokens"):
        generate(model, MedusaHeads(MedusaConfig.for_target(model.config, num_heads=2)), PROMPT, tree=[(0,), (97,)])


def test_a_drafter_class_instead_of_an_instance(model):
    with pytest.raises(
        TypeError, match=r"the class PromptLookupDrafter, not a drafter: pass an instance, e.g. PromptLookupDrafter\(\)"
    ):
        generate(model, PromptLookupDrafter, PROMPT)
    with pytest.raises(TypeError, match="the class PromptLookupDrafter"):
        generate(model, [EagleHead(EagleConfig.for_target(model.config)), PromptLookupDrafter], PROMPT)


def test_a_damaged_calibration_cache_is_measured_again(model, tmp_path, monkeypatch):
    from inference import calibrate

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "doubt_about", lambda *args: None)  # kept whatever the machine's load
    calibrate.load_or_measure(model)
    [saved] = (tmp_path / "calibration").glob("*.json")
    for damage in (
        '{"tokens": [1, 2',
        '{"tokens": [1, 2], "relative": [1.0]}',
        "[]",
        '{"tokens": [1], "relative": ["x"], "draft_level": 0}',
    ):
        saved.write_text(damage)
        with pytest.warns(UserWarning, match=f"calibration cached in {saved} is damaged"):
            cost = calibrate.load_or_measure(model)
        assert cost.relative[0] == 1.0 and len(cost.tokens) == len(calibrate.TOKEN_COUNTS)
        assert json.loads(saved.read_text())["tokens"] == list(calibrate.TOKEN_COUNTS)  # written anew


def test_two_processes_converting_the_default_model_at_once_both_get_it(tmp_path, monkeypatch):
    """The conversion that finishes second cannot rename its copy over the first one's: it uses the first's."""
    target = tmp_path / "smollm2"

    def save_pretrained(staging):  # meanwhile, another process renames its finished copy into place
        target.mkdir(exist_ok=True)
        (target / "config.json").write_text("{}")
        staging.mkdir(parents=True, exist_ok=True)
        (staging / "config.json").write_text("{}")

    fake_model = SimpleNamespace(config=SimpleNamespace(quantization_config=None), save_pretrained=save_pretrained)
    fake_tokenizer = SimpleNamespace(save_pretrained=lambda staging: None)
    monkeypatch.setattr(target_module.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: fake_model)
    monkeypatch.setattr(target_module.AutoTokenizer, "from_pretrained", lambda *a, **k: fake_tokenizer)
    assert target_module.default_model_dir(target) == target
    assert not list(tmp_path.glob(".smollm2.tmp*")), "the losing copy is removed"
