import json

import pytest
import torch
from safetensors.torch import load_file, save_file

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
    with pytest.raises(HeadConfigError, match="trained for .* but the target is .*weights_sample differs"):
        load_heads(tmp_path / "h", other)
    bigger = tiny_model("llama", vocab_size=101)
    with pytest.raises(HeadConfigError, match="vocab_size differs"):
        load_heads(tmp_path / "h", bigger)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_same_model_in_any_dtype_matches_its_heads(target, tmp_path, dtype):
    save_heads(MedusaHeads(MedusaConfig.for_target(target.config)), tmp_path / "h", target)
    same = tiny_model("llama").to(dtype)
    assert TargetFingerprint.of(target).mismatch(TargetFingerprint.of(same)) is None
    assert TargetFingerprint.of(same).mismatch(TargetFingerprint.of(target)) is None
    assert next(load_heads(tmp_path / "h", same).parameters()).dtype == dtype
    other = tiny_model("llama", seed=1).to(dtype)
    with pytest.raises(HeadConfigError, match="weights_sample differs"):
        load_heads(tmp_path / "h", other)


def test_checkpoints_without_a_weights_sample_are_matched_on_the_hash(target, tmp_path):
    path = save_heads(MedusaHeads(MedusaConfig.for_target(target.config)), tmp_path / "h", target)
    config = json.loads((path / "config.json").read_text())
    del config["target"]["weights_sample"]
    (path / "config.json").write_text(json.dumps(config))
    load_heads(path, tiny_model("llama").to(torch.bfloat16))
    with pytest.raises(HeadConfigError, match="weights_sha256 differs"):
        load_heads(path, tiny_model("llama", seed=1))


@pytest.mark.parametrize(
    "field, value", [("weights_sample", ["0.1", 0.2]), ("weights_sample", [float("nan")]), ("hidden_size", "64")]
)
def test_a_tampered_fingerprint_is_named(target, tmp_path, field, value):
    path = save_heads(MedusaHeads(MedusaConfig.for_target(target.config)), tmp_path / "h", target)
    config = json.loads((path / "config.json").read_text())
    config["target"][field] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadConfigError, match=f"TargetFingerprint.{field} must be"):
        load_heads(path, target)


def test_non_finite_weights_are_never_saved_nor_loaded(target, tmp_path):
    heads = MedusaHeads(MedusaConfig.for_target(target.config, num_heads=2))
    heads.heads[1][0].linear.bias.data[3] = float("nan")
    with pytest.raises(HeadConfigError, match=r"NaN or infinite weights \(heads.1.0.linear.bias\)"):
        save_heads(heads, tmp_path / "nan", target)
    assert not (tmp_path / "nan").exists()
    heads.heads[1][0].linear.bias.data[3] = 0.0
    path = save_heads(heads, tmp_path / "h", target)
    state = load_file(path / "model.safetensors")
    state["heads.0.0.linear.weight"][0, 0] = float("inf")
    save_file(state, path / "model.safetensors")
    with pytest.raises(HeadConfigError, match="holds NaN or infinite weights .*diverged"):
        load_heads(path, target)


def test_saving_never_replaces_what_is_not_a_head_checkpoint(target, tmp_path):
    heads = MedusaHeads(MedusaConfig.for_target(target.config, num_heads=2))
    folder = tmp_path / "d"
    (folder / "sub").mkdir(parents=True)
    (folder / "precious.txt").write_text("mine")
    with pytest.raises(HeadConfigError, match=r"holds files that are not a head checkpoint \(precious.txt, sub\)"):
        save_heads(heads, folder, target)
    assert (folder / "precious.txt").read_text() == "mine" and (folder / "sub").is_dir()
    (tmp_path / "file").write_text("mine")
    with pytest.raises(HeadConfigError, match="a file of that name exists"):
        save_heads(heads, tmp_path / "file", target)
    with pytest.raises(HeadConfigError, match="is a file, not a folder"):
        save_heads(heads, tmp_path / "file" / "heads", target)
    assert (tmp_path / "file").read_text() == "mine"
    (tmp_path / "impostor").mkdir()
    (tmp_path / "impostor" / "config.json").write_text('{"not": "ours"}')
    with pytest.raises(HeadConfigError, match="not a head checkpoint of this project"):
        save_heads(heads, tmp_path / "impostor", target)
    (tmp_path / "empty").mkdir()
    save_heads(heads, tmp_path / "empty", target)  # an empty folder, or one of our checkpoints, is written
    save_heads(heads, tmp_path / "empty", target)
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "empty", "file", "impostor"]  # no staging folders left


def test_a_model_cast_after_its_heads_were_loaded_is_a_clear_error(tmp_path):
    from inference import generate

    model = tiny_model("llama")
    save_heads(EagleHead(EagleConfig.for_target(model.config)), tmp_path / "eagle", model)
    head = load_heads(tmp_path / "eagle", model)
    model.to(torch.bfloat16)
    with pytest.raises(
        HeadConfigError, match=r"in torch.float32 on cpu but the target is in torch.bfloat16 on cpu .*heads.to\("
    ):
        generate(model, head, torch.arange(4, 10), max_new_tokens=4)
    head.to(torch.bfloat16)
    assert len(generate(model, head, torch.arange(4, 10), max_new_tokens=4).token_ids) == 4


def test_a_head_reading_layers_the_target_lacks_is_refused(target, tmp_path):
    path = save_heads(
        EagleHead(EagleConfig.for_target(target.config, feature_layers=[1, -1])), tmp_path / "eagle", target
    )
    config = json.loads((path / "config.json").read_text())
    config["head"]["feature_layers"] = [99, -1]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadConfigError, match=r"reads target layers \[99\], but the target has 3 hidden states"):
        load_heads(path, target)


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


EAGLE = {
    "kind": "eagle",
    "hidden_size": 8,
    "vocab_size": 10,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "intermediate_size": 16,
}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"kind": "medusa", "hidden_size": 8, "vocab_size": 10, "num_hedas": 3}, "unknown key"),
        ({"kind": "medusa", "vocab_size": 10}, "hidden_size"),
        ({"kind": "hydra"}, "'kind' must be one of"),
        ({"kind": "medusa", "hidden_size": 8, "vocab_size": 10, "num_heads": 0}, "num_heads must be >= 1"),
        ({**EAGLE, "num_layers": 0}, "num_layers must be >= 1"),
        ({**EAGLE, "copy_input": "yes"}, "copy_input must be true or false"),
        ({**EAGLE, "hidden_size": "8"}, "hidden_size must be a whole number, got '8'"),
        ({**EAGLE, "num_attention_heads": 0}, "num_attention_heads must be >= 1"),
        ({**EAGLE, "rms_norm_eps": "x"}, "rms_norm_eps must be a finite number"),
        ({**EAGLE, "rope_theta": -1.0}, "must be > 0"),
        ({**EAGLE, "num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({**EAGLE, "feature_layers": [1.5]}, "feature_layers must be a list of whole numbers"),
        ({**EAGLE, "num_layers": True}, "num_layers must be a whole number"),
        (
            {"kind": "medusa", "hidden_size": 8, "vocab_size": 10, "rank_accuracy": "high"},
            "rank_accuracy must be a list of lists",
        ),
    ],
)
def test_bad_head_configs_are_refused(data, message):
    with pytest.raises(HeadConfigError, match=message):
        head_config_from_dict(data)
