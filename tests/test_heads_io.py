import json

import pytest
import torch

from conftest import tiny_model
from heads import EagleConfig, EagleHead, HeadConfigError, MedusaConfig, MedusaHeads, TargetFingerprint, load_heads, save_heads
from heads.config import head_config_from_dict


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_medusa_round_trip_and_shared_projection(target, tmp_path):
    heads = MedusaHeads(MedusaConfig.for_target(target.config, num_heads=3, num_layers=2))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    save_heads(heads, tmp_path / "medusa", target, training={"steps": 0}, dtype=torch.float32)
    loaded = load_heads(tmp_path / "medusa", target)
    hidden = torch.randn(5, 64)
    lm_head = target.get_output_embeddings()
    assert torch.equal(loaded(hidden, lm_head), heads(hidden, lm_head))
    assert heads(hidden, lm_head).shape == (5, 3, 97)
    saved = json.loads((tmp_path / "medusa" / "config.json").read_text())
    assert saved["head"]["kind"] == "medusa" and saved["training"] == {"steps": 0}
    assert "lm_head.weight" not in str(loaded.state_dict().keys())  # the target's projection is not copied


def test_eagle_round_trip_in_bfloat16(target, tmp_path):
    head = EagleHead(EagleConfig.for_target(target.config, feature_layers=[1, 2, -1]))
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
])
def test_bad_head_configs_are_refused(data, message):
    with pytest.raises(HeadConfigError, match=message):
        head_config_from_dict(data)
