"""split_program cuts an exported decoding pass between its layers into two programs that, run one after the other
(HalvesRunner), compute exactly what the whole program computes. Eager only (the programs' own modules): no
compiling, a few seconds."""

import pytest
import torch
import torch.utils._pytree as pytree

from conftest import tiny_model
from inference.compiled import CompiledPasses
from inference.split_program import HalvesRunner, split_program


def pass_inputs(model, rows: int, tokens: int, cached: int, capacity: int, seed: int = 0) -> tuple:
    """A decoding pass's arguments: random tokens and cache entries, a tree-like mask (each new token sees the cache
    and itself), every token's logits."""
    generator = torch.Generator().manual_seed(seed)
    shapes = CompiledPasses(model).read_cache_shapes()
    ids = torch.randint(0, model.config.vocab_size, (rows, tokens), generator=generator)
    positions = (torch.arange(tokens) + cached).expand(rows, -1).contiguous()
    allowed = torch.ones(tokens, cached + tokens, dtype=torch.bool).tril(cached)
    mask = torch.where(allowed, 0.0, torch.finfo(model.dtype).min).to(model.dtype)
    keys = [torch.randn(rows, heads, capacity, dim, generator=generator) for heads, dim in shapes]
    values = [torch.randn(rows, heads, capacity, dim, generator=generator) for heads, dim in shapes]
    return ids, positions, mask.expand(rows, 1, -1, -1).contiguous(), torch.arange(tokens), keys, values


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("layers,share", [(2, 0.5), (4, 0.5), (5, 0.75)])
def test_the_halves_compute_exactly_what_the_whole_program_does(family, layers, share):
    model = tiny_model(family, layers=layers)
    program = CompiledPasses(model).export()
    halves = split_program(program, share)
    assert halves is not None
    # what crosses the cut: the hidden state and the rotary tables every layer reads, not the cache
    assert len(halves.wiring["crossing"]) <= 3
    # (the programs' guard functions, checked on real inputs, fail to build after a non-strict export: NameError)
    whole = program.module(check_guards=False)
    first, second = (half.module(check_guards=False) for half in (halves.first, halves.second))
    split = HalvesRunner(first, second, halves.wiring)
    for rows, tokens, cached, capacity in [(1, 1, 3, 8), (2, 5, 7, 12), (3, 4, 0, 4)]:
        inputs = pass_inputs(model, rows, tokens, cached, capacity, seed=rows)
        own = (*inputs[:4], [k.clone() for k in inputs[4]], [v.clone() for v in inputs[5]])  # the split's stores
        with torch.no_grad():
            expected, got = whole(*inputs), split(*own)
        assert pytree.tree_structure(got) == pytree.tree_structure(expected)
        assert all(torch.equal(a, b) for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected)))
        # both wrote the new tokens' entries into their stores, after the cached ones, and nothing else
        untouched = pass_inputs(model, rows, tokens, cached, capacity, seed=rows)[4]
        for whole_store, split_store, before in zip(inputs[4], own[4], untouched, strict=True):
            assert torch.equal(whole_store, split_store)
            assert not torch.equal(whole_store[:, :, cached : cached + tokens], before[:, :, cached : cached + tokens])
            assert torch.equal(whole_store[:, :, :cached], before[:, :, :cached])
            assert torch.equal(whole_store[:, :, cached + tokens :], before[:, :, cached + tokens :])


def test_the_first_half_holds_the_given_share_of_the_layers():
    model = tiny_model("llama", layers=4)
    program = CompiledPasses(model).export()

    def layers_in(half) -> set[str]:  # the layers whose matrix products it computes
        return {
            path
            for node in half.graph.nodes
            if node.target is torch.ops.aten.linear.default
            for path, _ in (node.meta.get("nn_module_stack") or {}).values()
            if path.rsplit(".", 1)[-1].isdigit()
        }

    for share, first in [(0.5, 2), (0.75, 3), (0.1, 1), (1.0, 3)]:  # each half keeps at least one layer
        halves = split_program(program, share)
        assert len(layers_in(halves.first)) == first and len(layers_in(halves.second)) == 4 - first


def test_a_program_with_fewer_than_two_layers_is_not_split():
    program = CompiledPasses(tiny_model("llama", layers=1)).export()
    assert split_program(program) is None
