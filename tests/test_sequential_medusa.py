"""Sequential (Hydra-style) Medusa heads: training feeds each head the tokens drafting feeds it, the drafter grows
the heads' own chain, the checkpoint round-trips, and what they cannot do is a clear error. Their greedy output
is checked against HF in test_exactness_tiny.py, their training in test_training.py."""

from dataclasses import replace

import pytest
import torch

from conftest import tiny_model
from heads import DraftVocabulary, HeadConfigError, LayerShape, MedusaConfig, MedusaHeads, load_heads, save_heads
from heads.formats import write_format
from inference import DynamicTreeSpec, SequentialMedusaDrafter, TreeError, medusa_tree_spec
from training.losses import medusa_loss

HIDDEN, VOCAB, HEADS = 8, 50, 3


def random_sequential_heads(hidden=HIDDEN, vocab=VOCAB, heads=HEADS, **extra):
    torch.manual_seed(0)
    medusa = MedusaHeads(
        MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=heads, num_layers=2, sequential=True, **extra)
    )
    for p in medusa.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return medusa.eval()


class Recording(MedusaHeads):
    def forward(self, hidden, token_embeddings=None, at=None):
        self.seen = (hidden[at[:, 0], at[:, 1]], token_embeddings)
        return super().forward(hidden, token_embeddings, at)


def test_the_loss_feeds_each_position_the_text_tokens_after_it():
    """Head k at position t reads tokens t + 1 .. t + k + 1, as the drafter reads a path from the root."""
    length = 20
    heads = Recording(MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, num_heads=HEADS, sequential=True))
    hidden = (
        torch.arange(length, dtype=torch.float32)[None, :, None].expand(1, length, HIDDEN).contiguous()
    )  # position t holds t
    embed = torch.nn.Embedding(VOCAB, HIDDEN)
    embed.weight.data = (
        torch.arange(VOCAB, dtype=torch.float32)[:, None].expand(VOCAB, HIDDEN).contiguous()
    )  # token i embeds as i
    input_ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    medusa_loss(
        heads, DraftVocabulary(lm_head), hidden, input_ids, torch.ones(1, length), 0.8, 64, embed=embed, num_heads=HEADS
    )
    positions, tokens = heads.seen[0][:, 0].long(), heads.seen[1][..., 0].long()
    assert len(positions) == length - 2  # every position with a label for head 0
    for t, read in zip(positions.tolist(), tokens.tolist()):
        expected = input_ids[0, t + 1 : t + 1 + HEADS].tolist()
        expected += [int(input_ids[0, -1])] * (HEADS - len(expected))  # past the end: the last token (no label there)
        assert read == expected, t


def test_a_chain_is_the_heads_own_greedy_path():
    model = tiny_model(vocab_size=VOCAB)
    heads = random_sequential_heads(hidden=model.config.hidden_size)
    drafter = SequentialMedusaDrafter(heads, model, DynamicTreeSpec(depth=HEADS, top_k=1, nodes=HEADS))
    text = torch.tensor([5, 9, 11, 7])
    hidden = torch.randn(len(text), model.config.hidden_size)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    feature, token, chain = hidden[-1], text[-1], [int(text[-1])]
    with torch.no_grad():
        drafter.observe({-1: hidden}, text[1:])
        tree = drafter.propose(text, max_depth=HEADS)
        for depth in range(HEADS):
            feature = heads.step(depth, feature, embed(token))
            token = lm_head(feature).argmax()
            chain.append(int(token))
    assert tree.tokens.tolist() == chain


def test_heads_round_trip_and_refuse_what_they_cannot_do(tmp_path):
    model = tiny_model(vocab_size=VOCAB)
    heads = random_sequential_heads(hidden=model.config.hidden_size)
    save_heads(heads, tmp_path / "heads", model, dtype=torch.float32)
    loaded = load_heads(tmp_path / "heads", model)
    assert loaded.config.sequential and loaded.readers is not None
    for name, tensor in heads.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    spec = medusa_tree_spec(loaded)
    assert isinstance(spec, DynamicTreeSpec) and spec.depth == HEADS and spec.top_k == 15
    with pytest.raises(TreeError, match="needs 4 sequential Medusa heads; the checkpoint has 3"):
        SequentialMedusaDrafter(loaded, model, DynamicTreeSpec(depth=4, top_k=2, nodes=6))
    with pytest.raises(TreeError, match="grows dynamic trees"):
        SequentialMedusaDrafter(loaded, model, [(0,), (0, 0)])
    with pytest.raises(HeadConfigError, match="sequential"):
        write_format(loaded, tmp_path / "medusa-format", "medusa", model)
    with pytest.raises(HeadConfigError, match="own_lm_heads"):
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, sequential=True, own_lm_heads=True)
    with pytest.raises(ValueError, match="embeddings of 1 to 3 tokens"):
        loaded(torch.randn(2, model.config.hidden_size))


def prefix_heads(model, **extra):
    """Sequential heads with a prefix layer shaped as the target's, every weight random (the layer's output
    projections too, so it changes what it reads)."""
    torch.manual_seed(0)
    shape = LayerShape.for_target(model.config)
    heads = MedusaHeads(
        MedusaConfig.for_target(model.config, num_heads=HEADS, sequential=True, prefix_layer=shape, **extra)
    )
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return heads.eval()


def test_a_prefix_layer_starts_as_a_pass_through_then_reads_the_earlier_states_only():
    model = tiny_model(vocab_size=VOCAB)
    hidden_size = model.config.hidden_size
    plain = random_sequential_heads(hidden=hidden_size)
    added = MedusaHeads(replace(plain.config, prefix_layer=LayerShape.for_target(model.config))).eval()
    missing = added.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing and all(name.startswith("prefix.") for name in missing)
    texts, tokens = torch.randn(2, 9, hidden_size), torch.randn(5, HEADS, hidden_size)
    at = torch.tensor([[0, 8], [1, 3], [1, 0], [0, 4], [1, 8]])
    with torch.no_grad():
        torch.testing.assert_close(added(texts, tokens, at=at), plain(texts[at[:, 0], at[:, 1]], tokens))
        for p in added.prefix.parameters():
            torch.nn.init.normal_(p, std=0.1)
        before = added(texts, tokens, at=at)
        changed = texts.clone()
        changed[1, 5] += 1.0  # row 1, position 5: seen by row 1's position 8 only
        after = added(changed, tokens, at=at)
    moved = (before - after).abs().amax(dim=(1, 2)) > 1e-4
    assert moved.tolist() == [False, False, False, False, True]
    with pytest.raises(ValueError, match="read whole texts"):
        added(texts[:, -1], tokens[:2])


def test_the_drafter_reads_the_prefix_layer_through_its_cache_as_the_layer_reads_the_whole_text():
    """The states arrive in pieces (the prompt, then what each step commits); the drafter's state for the root
    is the layer's output over all of them at once, and drafting writes nothing into that cache."""
    model = tiny_model(vocab_size=VOCAB)
    heads = prefix_heads(model)
    drafter = SequentialMedusaDrafter(heads, model, DynamicTreeSpec(depth=HEADS, top_k=2, nodes=5))
    states = torch.randn(12, model.config.hidden_size)
    text = torch.randint(0, VOCAB, (13,))
    with torch.no_grad():
        for start, end in [(0, 7), (7, 9), (9, 10), (10, 12)]:
            drafter.observe({-1: states[start:end]}, text[start + 1 : end + 1])
            drafter.propose(text[: end + 1], max_depth=HEADS)
            whole = heads.prefix(states[None, :end], torch.arange(end)[None])[0, -1]
            torch.testing.assert_close(drafter.hidden[0], whole, rtol=1e-5, atol=1e-5)
            assert drafter.cache.get_seq_length() == end


def test_prefix_heads_round_trip_and_refuse_what_they_cannot_be(tmp_path):
    model = tiny_model(vocab_size=VOCAB)
    heads = prefix_heads(model)
    save_heads(heads, tmp_path / "heads", model, dtype=torch.float32)
    loaded = load_heads(tmp_path / "heads", model)
    assert loaded.config.prefix_layer == LayerShape.for_target(model.config)
    for name, tensor in heads.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    shape = LayerShape.for_target(model.config)
    with pytest.raises(HeadConfigError, match="set sequential: true, or prefix_layer: null"):
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, prefix_layer=shape)
    with pytest.raises(HeadConfigError, match="a saved config holds the shape itself"):
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, sequential=True, prefix_layer=True)
    with pytest.raises(HeadConfigError, match=r"unknown key\(s\) \['heads'\]"):
        MedusaConfig(hidden_size=HIDDEN, vocab_size=VOCAB, sequential=True, prefix_layer={"heads": 2})


def test_rows_of_a_batch_read_the_prefix_layer_each_through_its_own_cache():
    """Rows of different lengths, a row joining and a row leaving: each row's state is the layer's output over its
    own states alone."""
    model = tiny_model(vocab_size=VOCAB)
    heads, hidden_size = prefix_heads(model), model.config.hidden_size
    drafter = SequentialMedusaDrafter(heads, model, DynamicTreeSpec(depth=HEADS, top_k=2, nodes=5))
    torch.manual_seed(1)
    states = [torch.randn(n, hidden_size) for n in (9, 4, 6)]
    texts = [torch.randint(0, VOCAB, (n + 1,)) for n in (9, 4, 6)]
    seen = [0, 0, 0]

    def step(rows, new):  # rows: which sequences are in the batch, in order; new: how many states each commits
        drafter.observe_rows(
            [{-1: states[r][seen[r] : seen[r] + n]} for r, n in zip(rows, new)],
            [texts[r][seen[r] + 1 : seen[r] + n + 1] for r, n in zip(rows, new)],
        )
        for r, n in zip(rows, new):
            seen[r] += n
        drafter.propose_rows([texts[r][: seen[r] + 1] for r in rows], [HEADS] * len(rows))
        for slot, r in enumerate(rows):
            whole = heads.prefix(states[r][None, : seen[r]], torch.arange(seen[r])[None])[0, -1]
            torch.testing.assert_close(drafter.hidden[slot], whole, rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        drafter.reset(2)
        step([0, 1], [6, 2])  # two prompts of different lengths
        step([0, 1], [1, 2])  # ragged steps
        drafter.add_rows(1)
        step([0, 1, 2], [2, 0, 5])  # a prompt joins; a row commits nothing this step
        drafter.keep_rows([0, 2])  # row 1 leaves
        step([0, 2], [0, 1])
