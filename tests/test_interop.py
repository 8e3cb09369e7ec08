"""Published head formats (heads.formats): our heads in the EAGLE-1, EAGLE-3 and Medusa layouts compute what the
formats' own code computes (SpecForge and speculators are the oracles: code no one here wrote), files round-trip
exactly, decoding with them is exact, and bad files are refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import (
    DraftVocabulary,
    EagleConfig,
    EagleHead,
    HeadConfigError,
    MedusaConfig,
    MedusaHeads,
    load_heads,
    save_heads,
)
from heads.formats import detect_format, write_format
from inference import DynamicTreeSpec, generate, medusa_tree_spec

LAYERS = 8  # EAGLE-3's default aux layers (2, L//2, L-3) are distinct from 8 layers up
AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", layers=LAYERS, vocab_size=97)


def randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every floating-point weight drawn at random, norms around 1: no zero or identity hides a wrong wiring."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            noise = torch.randn(parameter.shape, generator=generator)
            parameter.copy_(1 + 0.2 * noise if "norm" in name else 0.3 * noise / parameter.shape[-1] ** 0.25)
    return module.eval()


def eagle3_head(target, draft_vocab: int | None = 40, seed: int = 1) -> EagleHead:
    config = EagleConfig.for_target(
        target.config, architecture="eagle3", feature_layers=AUX, draft_vocab_size=draft_vocab
    )
    head = randomised(EagleHead(config), seed)
    if draft_vocab:  # a draft vocabulary in no particular order: the mapping must survive every format
        head.draft_ids = torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(seed))[
            :draft_vocab
        ]
    return head


def eagle3_inputs(target, length: int = 11, seed: int = 2):
    """Raw target states at the aux layers [1, T, 3H] for a random text, and the text's next tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (1, length + 1), generator=generator)
    with torch.no_grad():
        states = target(ids[:, :-1], output_hidden_states=True).hidden_states
    return torch.cat([states[layer] for layer in AUX], dim=-1), ids[:, 1:]


def our_logits(head: EagleHead, target, features, next_tokens) -> torch.Tensor:
    embed = target.get_input_embeddings()
    with torch.no_grad():
        out = head(features, embed(next_tokens), position_ids=torch.arange(features.shape[1])[None])
        return head.draft_vocabulary(target.get_output_embeddings()).logits(out)


def test_eagle3_layout_matches_specforge(target, tmp_path):
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    head = eagle3_head(target)
    write_format(head, tmp_path / "e3", "eagle3", target, dtype=torch.float32)
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == AUX and config["draft_vocab_size"] == 40
    theirs_config = LlamaConfig(
        **{k: v for k, v in config.items() if k not in ("eagle_config", "architectures")}, norm_output=True
    )
    theirs = LlamaForCausalLMEagle3(theirs_config, attention_backend="sdpa").eval()
    from safetensors.torch import load_file

    missing, unexpected = theirs.load_state_dict(load_file(tmp_path / "e3" / "model.safetensors"), strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)

    features, next_tokens = eagle3_inputs(target)
    with torch.no_grad():
        hidden = theirs.backbone(
            theirs.embed_input_ids(next_tokens),
            theirs.project_hidden_states(features),
            cache_hidden=None,
            attention_mask=None,
            position_ids=torch.arange(features.shape[1])[None],
        )
        expected = theirs.compute_logits(hidden)
    mine = our_logits(head, target, features, next_tokens)
    torch.testing.assert_close(mine, expected, atol=1e-5, rtol=1e-5)
    # the draft vocabulary maps back to the same target ids: SpecForge's d2t holds offsets
    draft = torch.arange(40)
    assert torch.equal(draft + theirs.d2t, head.draft_ids)
    assert int(theirs.t2d.sum()) == 40 and bool(theirs.t2d[head.draft_ids].all())


def speculators_model(config: dict):
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    layer = LlamaConfig(**{k: v for k, v in config["transformer_layer_config"].items() if k != "architectures"})
    layer._attn_implementation = "eager"
    built = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=config["draft_vocab_size"],
        norm_before_residual=config["norm_before_residual"],
        eagle_aux_hidden_state_layer_ids=config["eagle_aux_hidden_state_layer_ids"],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]),  # no download
        ),
    )
    return Eagle3DraftModel(built).eval()


def test_eagle3_layout_matches_speculators(target, tmp_path):
    from safetensors.torch import load_file

    head = eagle3_head(target, seed=3)
    write_format(head, tmp_path / "spec", "speculators", target, dtype=torch.float32)
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    theirs = speculators_model(config)
    state = load_file(tmp_path / "spec" / "model.safetensors")
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    for (
        name,
        parameter,
    ) in theirs.named_parameters():  # a fresh model leaves some weights NaN: all must come from the file
        assert bool(torch.isfinite(parameter).all()) or name.startswith("verifier"), name
    captured = []
    theirs.lm_head.register_forward_hook(lambda module, args, out: captured.append(out))
    features, next_tokens = eagle3_inputs(target, seed=4)
    with torch.no_grad():
        theirs(features, next_tokens, document_ids=torch.zeros_like(next_tokens), ttt_steps=1)
    mine = our_logits(head, target, features, next_tokens)
    torch.testing.assert_close(mine, captured[0], atol=1e-5, rtol=1e-5)


def same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa.keys() - {
        "decoder.embed_tokens.weight"
    }:  # a placeholder the decoder never reads (inputs are embeddings)
        assert torch.equal(sa[name], sb[name]), name


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_eagle3_round_trip(target, tmp_path, fmt):
    head = eagle3_head(target, seed=5)
    write_format(head, tmp_path / "out", fmt, target, dtype=torch.float32)
    assert detect_format(tmp_path / "out") == fmt
    loaded = load_heads(tmp_path / "out", target)
    assert loaded.config.architecture == "eagle3" and loaded.config.feature_layers == AUX
    same_state(head, loaded)
    write_format(loaded, tmp_path / "again", fmt, target, dtype=torch.float32)  # the files, byte for byte
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "again" / "model.safetensors"
    ).read_bytes()


def test_eagle1_round_trip(target, tmp_path):
    config = EagleConfig.for_target(target.config, architecture="eagle1")
    head = randomised(EagleHead(config), 6)
    write_format(head, tmp_path / "e1", "eagle", target, dtype=torch.float32)
    state = torch.load(tmp_path / "e1" / "pytorch_model.bin", weights_only=True)
    # SafeAILab's layout: layer 0 has no input norm, there is no final norm, fc has its bias, the embedding is a copy
    assert "layers.0.input_layernorm.weight" not in state and "norm.weight" not in state and "fc.bias" in state
    assert state["fc.weight"].shape == (64, 128) and torch.equal(
        state["embed_tokens.weight"], target.get_input_embeddings().weight
    )
    assert detect_format(tmp_path / "e1") == "eagle"
    same_state(head, load_heads(tmp_path / "e1", target))


def test_medusa_round_trip(target, tmp_path):
    heads = randomised(MedusaHeads(MedusaConfig.for_target(target.config, num_heads=3, num_layers=2)), 7)
    write_format(heads, tmp_path / "m", "medusa", target, dtype=torch.float32)
    state = torch.load(tmp_path / "m" / "medusa_lm_head.pt", weights_only=True)  # FasterDecoding's file name and keys
    blocks = [f"{h}.{j}.linear.{p}" for h in range(3) for j in range(2) for p in ("weight", "bias")]
    assert sorted(state) == sorted(blocks + [f"{h}.2.weight" for h in range(3)])
    loaded = load_heads(tmp_path / "m", target)
    assert loaded.config.own_lm_heads
    hidden, lm_head = torch.randn(64), DraftVocabulary(target.get_output_embeddings())
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.draft_logits(loaded(hidden), lm_head), heads.draft_logits(heads(hidden), lm_head)
        )
    # heads with a reduced draft vocabulary go out only when told to draft from every token instead
    reduced = MedusaHeads(MedusaConfig.for_target(target.config, num_heads=3, num_layers=2, draft_vocab_size=30))
    with pytest.raises(HeadConfigError, match="full_vocabulary=True"):
        write_format(reduced, tmp_path / "reduced", "medusa", target)
    write_format(reduced, tmp_path / "reduced", "medusa", target, full_vocabulary=True)
    assert load_heads(tmp_path / "reduced", target).draft_ids is None
    write_format(loaded, tmp_path / "again", "medusa", target, dtype=torch.float32)
    again = torch.load(tmp_path / "again" / "medusa_lm_head.pt", weights_only=True)
    assert again.keys() == state.keys() and all(torch.equal(again[name], state[name]) for name in state)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "medusa"])
def test_decoding_with_published_layouts_is_exact(target, kind):
    if kind == "eagle3":
        heads = eagle3_head(target, seed=8)
    elif kind == "eagle1":
        heads = randomised(EagleHead(EagleConfig.for_target(target.config, architecture="eagle1")), 9)
    else:
        heads = randomised(MedusaHeads(MedusaConfig.for_target(target.config, num_heads=3, own_lm_heads=True)), 10)
    tree = medusa_tree_spec(heads, nodes=10) if kind == "medusa" else DynamicTreeSpec(depth=4, top_k=3, nodes=10)
    generator = torch.Generator().manual_seed(11)
    for length in (3, 9, 17, 30):
        prompt = torch.randint(0, target.config.vocab_size, (length,), generator=generator)
        out = generate(target, heads, prompt, max_new_tokens=24, tree=tree, lookup=False, fallback=False)
        assert out.token_ids == hf_greedy(target, prompt, 24)
        assert (
            out.stats.tree_nodes > out.stats.target_forwards
        )  # the heads drafted: trees beyond the root were verified


def test_our_own_format_still_loads(target, tmp_path):
    head = eagle3_head(target, seed=12)
    save_heads(head, tmp_path / "ours", target, dtype=torch.float32)
    assert detect_format(tmp_path / "ours") == "ours"
    same_state(head, load_heads(tmp_path / "ours", target))


def test_bad_files_are_refused_clearly(target, tmp_path):
    head = eagle3_head(target, seed=13)
    write_format(head, tmp_path / "e3", "eagle3", target)
    other = tiny_model("llama", layers=LAYERS, vocab_size=97, seed=99)  # same sizes, other weights
    with pytest.raises(HeadConfigError, match="copy of the token embedding is not the target's"):
        load_heads(tmp_path / "e3", other)
    with pytest.raises(HeadConfigError, match="hidden size 64 and vocab 97, but the target"):
        load_heads(tmp_path / "e3", tiny_model("llama", layers=LAYERS, vocab_size=101))
    with pytest.raises(HeadConfigError, match="not an empty folder"):
        write_format(head, tmp_path / "e3", "eagle3", target)
    ours = randomised(EagleHead(EagleConfig.for_target(target.config)), 14)
    with pytest.raises(HeadConfigError, match="architecture: eagle3"):
        write_format(ours, tmp_path / "x", "eagle3", target)
    last = EagleHead(EagleConfig.for_target(target.config, architecture="eagle3", feature_layers=[2, 4, -1]))
    with pytest.raises(HeadConfigError, match="after the final norm"):
        write_format(last, tmp_path / "y", "eagle3", target)
    shuffled = EagleHead(EagleConfig.for_target(target.config, architecture="eagle3", feature_layers=[4, 2, 5]))
    with pytest.raises(HeadConfigError, match="distinct and ascending"):
        write_format(shuffled, tmp_path / "z", "speculators", target)
    config = json.loads((tmp_path / "e3" / "config.json").read_text())
    del config["intermediate_size"]
    (tmp_path / "e3" / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadConfigError, match="lacks 'intermediate_size'"):
        load_heads(tmp_path / "e3", target)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text('{"hello": 1}')
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(HeadConfigError, match="cannot be read"):
        load_heads(tmp_path / "junk", target)


def test_convert_command_round_trips(target, tmp_path, capsys):
    """python -m inference.convert: published -> ours -> another published format -> the first, the same tensors."""
    from inference.convert import main

    target.save_pretrained(tmp_path / "model")
    head = eagle3_head(target, seed=15)
    write_format(head, tmp_path / "e3", "eagle3", target, dtype=torch.bfloat16)
    model = ["--model", str(tmp_path / "model")]
    main([str(tmp_path / "e3"), str(tmp_path / "ours"), "--to", "ours", *model])
    main([str(tmp_path / "ours"), str(tmp_path / "spec"), "--to", "speculators", *model])
    main([str(tmp_path / "spec"), str(tmp_path / "back"), "--to", "eagle3", *model])
    assert "(eagle3) ->" in capsys.readouterr().out
    assert detect_format(tmp_path / "ours") == "ours" and detect_format(tmp_path / "spec") == "speculators"
    assert (tmp_path / "e3" / "model.safetensors").read_bytes() == (
        tmp_path / "back" / "model.safetensors"
    ).read_bytes()
    with pytest.raises(HeadConfigError, match="not an empty folder"):
        main([str(tmp_path / "e3"), str(tmp_path / "back"), "--to", "eagle3", *model])
