import json

import pytest
import torch

from conftest import tiny_model
from heads import (
    DraftVocabulary,
    EagleConfig,
    EagleHead,
    HeadConfigError,
    MedusaConfig,
    MedusaHeads,
    TargetFingerprint,
    load_heads,
    most_frequent_tokens,
    save_heads,
)
from heads.config import head_config_from_dict


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_reduced_draft_vocabulary_round_trip(target, tmp_path):
    heads = MedusaHeads(MedusaConfig.for_target(target.config, num_heads=2, draft_vocab_size=5))
    ids, covered, total = most_frequent_tokens([[7, 7, 3, 90, 90, 90, 60], [3, 41, 41, 7, 12, 12, 12, 5]], 5, 97)
    assert ids.tolist() == [3, 7, 12, 41, 90]  # counts 2, 3, 3, 2, 3; 5 and 60 once each
    assert (covered, total) == (13, 15)
    heads.draft_ids.copy_(ids)
    save_heads(heads, tmp_path / "reduced", target, training=None)  # bf16 weights, integer token ids
    loaded = load_heads(tmp_path / "reduced", target)
    assert loaded.draft_ids.dtype == torch.long and torch.equal(loaded.draft_ids, ids)

    lm_head = target.get_output_embeddings()
    full, reduced = DraftVocabulary(lm_head), DraftVocabulary(lm_head, loaded.draft_ids)
    hidden = torch.randn(4, 64)
    assert torch.allclose(reduced.logits(hidden), full.logits(hidden)[:, ids], atol=1e-5)
    assert torch.equal(reduced.to_target(torch.tensor([0, 4])), ids[[0, 4]])
    assert reduced.from_target(torch.tensor([12, 0, 90])).tolist() == [2, -100, 4]
    with pytest.raises(HeadConfigError, match="draft_vocab_size"):
        MedusaConfig.for_target(target.config, draft_vocab_size=98)


def test_medusa_round_trip_and_shared_projection(target, tmp_path):
    heads = MedusaHeads(MedusaConfig.for_target(target.config, num_heads=3, num_layers=2))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_heads(heads, tmp_path / "medusa", target, training={"steps": 0}, dtype=torch.float32)
    loaded = load_heads(tmp_path / "medusa", target)
    hidden = torch.randn(5, 64)
    vocab = DraftVocabulary(target.get_output_embeddings())
    assert torch.equal(vocab.logits(loaded(hidden)), vocab.logits(heads(hidden)))
    assert vocab.logits(heads(hidden)).shape == (5, 3, 97)
    saved = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert saved["head"]["kind"] == "medusa" and saved["training"] == {"steps": 0}
    assert "lm_head.weight" not in str(loaded.state_dict().keys())  # the target's projection is not copied


def test_eagle_round_trip_in_bfloat16(target, tmp_path):
    head = EagleHead(EagleConfig.for_target(target.config, feature_layers=[1, 2, -1], num_layers=2))
    save_heads(head, tmp_path / "eagle", target)
    loaded = load_heads(tmp_path / "eagle", target)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor.to(torch.bfloat16).float())
    assert loaded.config == head.config


def test_heads_for_another_model_are_refused(target, tmp_path):
    save_heads(MedusaHeads(MedusaConfig.for_target(target.config)), tmp_path / "h", target)
    other = tiny_model("llama", seed=1)  # same shapes, other weights
    with pytest.raises(HeadConfigError, match="trained for .* but the target is .*weights_sha256"):
        load_heads(tmp_path / "h", other)
    bigger = tiny_model("llama", vocab_size=101)
    with pytest.raises(HeadConfigError, match="vocab_size differs"):
        load_heads(tmp_path / "h", bigger)


def test_fingerprint_ignores_dtype(target):
    assert TargetFingerprint.of(target) == TargetFingerprint.of(tiny_model("llama").to(torch.bfloat16))


def test_corrupted_or_half_written_checkpoints_are_refused(target, tmp_path):
    path = save_heads(MedusaHeads(MedusaConfig.for_target(target.config)), tmp_path / "h", target)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(HeadConfigError, match="corrupted or half-written"):
        load_heads(path, target)
    weights.unlink()
    with pytest.raises(HeadConfigError, match="missing"):
        load_heads(path, target)
    (path / "config.json").write_text('{"head": {')
    with pytest.raises(HeadConfigError, match="not valid JSON"):
        load_heads(path, target)
    with pytest.raises(HeadConfigError, match="config.json is missing"):
        load_heads(tmp_path / "nowhere", target)


def test_weights_that_do_not_match_the_config_are_refused(target, tmp_path):
    path = save_heads(MedusaHeads(MedusaConfig.for_target(target.config, num_heads=2)), tmp_path / "h", target)
    config = json.loads((path / "config.json").read_text())
    config["head"]["num_heads"] = 4
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadConfigError, match="does not match its config.json"):
        load_heads(path, target)


def test_saving_over_a_checkpoint_replaces_it_whole(target, tmp_path):
    save_heads(MedusaHeads(MedusaConfig.for_target(target.config, num_heads=2)), tmp_path / "h", target)
    save_heads(MedusaHeads(MedusaConfig.for_target(target.config, num_heads=3)), tmp_path / "h", target)
    assert load_heads(tmp_path / "h", target).config.num_heads == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h"]  # no staging or retired directories left


@pytest.mark.parametrize("data, message", [
    ({"kind": "medusa", "hidden_size": 8, "vocab_size": 10, "num_hedas": 3}, "unknown key"),
    ({"kind": "medusa", "vocab_size": 10}, "hidden_size"),
    ({"kind": "hydra"}, "'kind' must be one of"),
    ({"kind": "medusa", "hidden_size": 8, "vocab_size": 10, "num_heads": 0}, "num_heads >= 1"),
    ({"kind": "eagle", "hidden_size": 8, "vocab_size": 10, "num_attention_heads": 2, "num_key_value_heads": 2,
      "head_dim": 4, "intermediate_size": 16, "num_layers": 0}, "num_layers must be a whole number >= 1"),
    ({"kind": "eagle", "hidden_size": 8, "vocab_size": 10, "num_attention_heads": 2, "num_key_value_heads": 2,
      "head_dim": 4, "intermediate_size": 16, "copy_input": "yes"}, "copy_input must be true or false"),
])
def test_bad_head_configs_are_refused(data, message):
    with pytest.raises(HeadConfigError, match=message):
        head_config_from_dict(data)
