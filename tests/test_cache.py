"""inference.cache: a cache of PositionLayers holds exactly what transformers' DynamicCache holds through every
operation the decode loops make, without copying the whole cache on each pass."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import tiny_model
from inference.cache import (
    append_rows,
    keep_new_entries,
    keep_path,
    keep_paths,
    keep_rows,
    new_cache,
    position_cache,
    reserve_rows,
)
from inference.loop import last_rows_forward


@pytest.mark.parametrize("shared", [False, True], ids=["own-buffers", "shared-buffers"])
def test_position_cache_matches_dynamic_cache_through_the_loops_operations(shared):
    """With buffers of each layer's own, and with every layer's in one allocation (SharedBuffers, moved at once)."""
    generator = torch.Generator().manual_seed(0)
    reference, ours = DynamicCache(), position_cache(2 if shared else None)

    def entries(rows: int, count: int):
        keys = torch.randn(rows, 2, count, 4, generator=generator)
        return keys, -keys

    def same() -> None:
        assert reference.get_seq_length() == ours.get_seq_length()
        for layer in range(2):
            torch.testing.assert_close(ours.layers[layer].keys, reference.layers[layer].keys, rtol=0, atol=0)
            torch.testing.assert_close(ours.layers[layer].values, reference.layers[layer].values, rtol=0, atol=0)

    def update(rows: int, count: int) -> None:
        for layer in range(2):
            keys, values = entries(rows, count)
            returned = ours.update(keys.clone(), values.clone(), layer)
            assert torch.equal(returned[0], reference.update(keys, values, layer)[0])

    update(3, 40)  # a prefill
    same()
    buffer = ours.layers[0].key_buffer.data_ptr()
    for _ in range(12):  # verification passes: a tree appended, its accepted paths kept, the rest cropped
        length = reference.get_seq_length()
        update(3, 5)
        cached = [length - row for row in range(3)]
        paths = [torch.tensor([0, 2, 3]), torch.tensor([0]), torch.tensor([0, 1])]
        one_view = ours.layers[0].shared is not None and ours.layers[0].shared.used() is not None
        assert one_view == shared  # the moves went through one view of every layer
        assert keep_paths(ours, cached, length, paths) == keep_paths(reference, cached, length, paths)
        same()
    assert ours.layers[0].key_buffer.data_ptr() == buffer  # every pass wrote into the same buffer
    keep_rows(ours, [0, 2])  # a row finished
    keep_rows(reference, [0, 2])
    same()
    update(2, 300)  # more than the buffer held: it grows, the kept entries are carried over
    same()
    ours.crop(-7)
    reference.crop(-7)
    update(2, 4)
    same()
    joining = [entries(1, 500) for _ in range(2)]  # a longer sequence joins the batch
    append_rows(ours, [keys for keys, _ in joining], [values for _, values in joining])
    length = reference.get_seq_length()
    for layer, (keys, values) in enumerate(joining):
        assert ours.layers[layer].keys.shape == (3, 2, 500, 4)
        assert torch.equal(ours.layers[layer].keys[:2, :, :length], reference.layers[layer].keys)
        assert (ours.layers[layer].keys[:2, :, length:] == 0).all()  # the shorter rows padded with empty entries
        assert torch.equal(ours.layers[layer].keys[2:], keys) and torch.equal(ours.layers[layer].values[2:], values)
    for layer in range(2):  # the next pass writes after them
        ours.update(*entries(3, 5), layer)
    assert ours.get_seq_length() == 505


def test_a_plain_steps_new_entries_move_as_one_node_paths_do():
    """keep_new_entries (a plain step) leaves the cache as keep_paths with every row's path its one node does; and a
    row whose entry stayed where it was written would be caught."""
    generator = torch.Generator().manual_seed(1)
    caches = [position_cache() for _ in range(3)]
    for layer in range(2):
        keys = torch.randn(4, 2, 31, 4, generator=generator)
        for cache in caches:
            cache.update(keys.clone(), -keys, layer)
    cached = [30, 27, 30, 12]  # rows 1 and 3 shorter: their new entries move back to their own ends
    assert keep_new_entries(caches[0], cached, 30) == [31, 28, 31, 13]
    assert keep_paths(caches[1], cached, 30, [torch.tensor([0])] * 4) == [31, 28, 31, 13]
    keep_paths(caches[2], [30] * 4, 30, [torch.tensor([0])] * 4)  # nothing moved
    for layer in range(2):
        assert torch.equal(caches[0].layers[layer].keys, caches[1].layers[layer].keys)
        assert torch.equal(caches[0].layers[layer].values, caches[1].layers[layer].values)
        assert not torch.equal(caches[0].layers[layer].keys, caches[2].layers[layer].keys)


def test_rows_leave_and_join_the_batch_within_the_buffer():
    generator = torch.Generator().manual_seed(3)
    reference, ours = DynamicCache(), position_cache()

    def entries(rows: int, count: int):
        keys = torch.randn(rows, 2, count, 4, generator=generator)
        return keys, -keys

    def update(rows: int, count: int) -> None:
        keys, values = entries(rows, count)
        ours.update(keys.clone(), values.clone(), 0)
        reference.update(keys, values, 0)

    def same() -> None:
        assert torch.equal(ours.layers[0].keys, reference.layers[0].keys) and torch.equal(
            ours.layers[0].values, reference.layers[0].values
        )
        assert ours.layers[0].key_buffer.data_ptr() == buffer  # rows moved within the buffer
        assert ours.layers[0].keys.numel() == 0 or ours.layers[0].keys.data_ptr() == buffer

    update(4, 30)
    update(4, 5)
    buffer = ours.layers[0].key_buffer.data_ptr()
    keep_rows(ours, [1, 3])
    keep_rows(reference, [1, 3])
    same()
    for length in (50, 10):  # a prompt longer than the cache joins, then a shorter one
        keys, values = entries(1, length)
        append_rows(ours, [keys.clone()], [values.clone()])
        append_rows(reference, [keys], [values])
        same()
    update(4, 5)
    same()
    keep_rows(ours, [])  # the last rows finished
    keep_rows(reference, [])
    same()


def test_rows_reserved_ahead_join_in_place_with_what_they_hold():
    """Prompts admitted together join group by group (shortest first): room reserved for all of them after the first
    group keeps the later groups' entries, and the next pass's, in the one allocation (no copy of every row's)."""
    generator = torch.Generator().manual_seed(5)
    reference, ours = DynamicCache(), position_cache(2)

    def entries(rows: int, count: int):
        keys = torch.randn(rows, 2, count, 4, generator=generator)
        return keys, -keys

    for layer in range(2):  # a first group: 3 prompts of 20 tokens
        keys, values = entries(3, 20)
        ours.update(keys.clone(), values.clone(), layer)
        reference.update(keys, values, layer)
    reserve_rows(ours, 8, 600)  # then 5 prompts of up to 600 tokens
    allocation = ours.shared.tensor
    assert allocation.shape[1] == 8 and allocation.shape[-2] >= 600
    joining = [entries(5, 600) for _ in range(2)]
    append_rows(ours, [keys.clone() for keys, _ in joining], [values.clone() for _, values in joining])
    append_rows(reference, [keys for keys, _ in joining], [values for _, values in joining])
    for layer in range(2):  # the first pass after them
        keys, values = entries(8, 4)
        ours.update(keys.clone(), values.clone(), layer)
        reference.update(keys, values, layer)
    assert ours.shared.tensor is allocation
    for layer in range(2):
        assert ours.layers[layer].keys.data_ptr() == allocation[2 * layer].data_ptr()
        assert torch.equal(ours.layers[layer].keys, reference.layers[layer].keys)
        assert torch.equal(ours.layers[layer].values, reference.layers[layer].values)
    reserve_rows(ours, 4, 100)  # room enough already: nothing moves
    assert ours.shared.tensor is allocation


@pytest.mark.parametrize("shared", [False, True], ids=["own-buffers", "shared-buffers"])
def test_rows_keep_any_order(shared):
    """keep_rows takes the rows in any order, overlapping moves included (a cycle), as index_select does; and the
    loop's order for finished rows moves one row for each that left."""
    generator = torch.Generator().manual_seed(5)
    reference, ours = DynamicCache(), position_cache(2 if shared else None)
    for layer in range(2):
        keys = torch.randn(4, 2, 9, 4, generator=generator)
        reference.update(keys, -keys, layer)
        ours.update(keys.clone(), -keys, layer)
    for rows in ([2, 0, 1, 3], [3, 1, 2]):
        keep_rows(reference, rows)
        keep_rows(ours, rows)
        for layer in range(2):
            assert torch.equal(ours.layers[layer].keys, reference.layers[layer].keys)
            assert torch.equal(ours.layers[layer].values, reference.layers[layer].values)
    assert last_rows_forward([1, 2, 3, 4, 5, 6, 7]) == [7, 1, 2, 3, 4, 5, 6]
    assert last_rows_forward([0, 2, 5, 6]) == [0, 5, 2, 6]
    assert last_rows_forward([3]) == [3] and last_rows_forward([0, 1]) == [0, 1]


@pytest.mark.parametrize("shared", [False, True], ids=["own-buffers", "shared-buffers"])
def test_a_single_sequence_keeps_its_path_in_place(shared):
    generator = torch.Generator().manual_seed(1)
    reference, ours = DynamicCache(), position_cache(1 if shared else None)
    for cache in (reference, ours):
        keys = torch.randn(1, 2, 10, 4, generator=torch.Generator().manual_seed(2))
        cache.update(keys, keys + 1, 0)
    tree = torch.randn(1, 2, 6, 4, generator=generator)
    for cache in (reference, ours):
        cache.update(tree.clone(), tree + 1, 0)
        keep_path(cache, 10, torch.tensor([0, 2, 5]), 6)
    assert torch.equal(ours.layers[0].keys, reference.layers[0].keys) and ours.get_seq_length() == 13


def test_new_cache_serves_a_model_as_dynamic_cache_does():
    model = tiny_model("llama").float().eval()
    ids = torch.arange(5, 25)[None]
    with torch.inference_mode():
        reference = model(ids, use_cache=True).logits
        cache = new_cache(model)
        first = model(ids[:, :12], cache=cache, use_cache=True).logits
        second = model(ids[:, 12:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([first, second], dim=1), reference, rtol=1e-5, atol=1e-5)


def test_a_compiled_pass_takes_its_stores_again_when_a_later_layer_grows_every_layers_buffers():
    """With SharedBuffers a layer's growth lays out every layer's buffers anew; stores taken for the layers before it
    would be the old ones, and the entries the pass writes there lost."""
    from inference.compiled import CompiledPasses

    cache = position_cache(2)
    for layer in range(2):
        cache.update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4), layer)
    layer = cache.layers[1]
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # off its buffer: only it needs to grow

    def runner(input_ids, position_ids, mask, logits_positions, key_stores, value_stores):
        for store in key_stores + value_stores:
            store[:, :, 5] = 7.0  # the new token's entries, written in place
        return ["logits"]

    passes = CompiledPasses.__new__(CompiledPasses)
    passes.runner, passes.narrow_runner = runner, None
    inputs = [torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), 5), torch.zeros(1, 1, 1, 6), torch.zeros(1)]
    assert passes._run_with_cache(cache, inputs) == ["logits"]
    for layer in cache.layers:
        assert layer.keys.shape == (1, 2, 6, 4)
        assert (layer.keys[:, :, 5] == 7).all() and (layer.values[:, :, 5] == 7).all()
        assert (layer.keys[:, :, :5] == 0).all()


def test_a_pass_takes_every_layers_stores_at_once_while_they_lie_in_the_shared_buffers():
    """SharedBuffers.stores: what each layer's reserve would give, or None when any layer's entries lie elsewhere,
    hold another count, or would overrun the buffers."""
    cache = position_cache(3)
    for layer in range(3):
        cache.update(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4), layer)
    shared = cache.layers[0].shared
    views = shared.stores(2, 5, 6)
    reserved = [layer.reserve(layer.keys, 1) for layer in cache.layers]
    # the same views of the same memory (comparing values would read the unwritten tail, which may hold NaNs)
    same = [
        (k.data_ptr(), k.shape, k.stride()) == (rk.data_ptr(), rk.shape, rk.stride())
        for (k, _), (rk, _) in zip(views, reserved)
    ]
    assert all(same)
    for keys, values in views:
        keys[:, :, 5], values[:, :, 5] = 3.0, 4.0  # the pass writes its entries in place
    shared.extend(views, 6)
    assert all((layer.keys[:, :, 5] == 3).all() and (layer.values[:, :, 5] == 4).all() for layer in cache.layers)
    assert cache.get_seq_length() == 6 and shared.stores(2, 6, 7) is not None
    assert shared.stores(2, 5, 7) is None  # the layers hold 6 entries, not 5
    assert shared.stores(2, 6, shared.tensor.shape[-2] + 1) is None  # no room
    assert shared.stores(3, 6, 7) is None  # more rows than the buffers have
    layer = cache.layers[1]
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # off its buffer
    assert shared.stores(2, 6, 7) is None


def test_a_crop_narrows_every_layer_at_once_while_they_are_the_shared_buffers_views():
    """PositionCache.crop: one view of every layer's entries where each layer's are still what SharedBuffers.narrow
    made them; layer by layer (Cache.crop) once any layer's were replaced."""
    cache = position_cache(3)
    for layer in range(3):
        cache.update(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4), layer)
    shared = cache.layers[0].shared
    assert shared.narrowed() is None  # the layers' own updates made their entries
    shared.extend(shared.stores(2, 5, 6), 6)
    assert shared.narrowed() == (2, 6) and shared.stores(2, 6, 7) is not None
    kept = [(layer.keys[:, :, :4].clone(), layer.values[:, :, :4].clone()) for layer in cache.layers]
    cache.crop(-2)
    assert shared.narrowed() == (2, 4) and cache.get_seq_length() == 4
    for index, (layer, (keys, values)) in enumerate(zip(cache.layers, kept)):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert layer.keys.data_ptr() == shared.tensor[2 * index].data_ptr() and layer.keys.shape == (2, 2, 4, 4)
    assert shared.stores(2, 5, 6) is None  # they hold 4 entries now
    layer = cache.layers[1]
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # off the buffers
    assert shared.narrowed() is None and shared.stores(2, 4, 5) is None
    cache.crop(-1)
    assert all(layer.keys.shape[-2] == 3 for layer in cache.layers) and torch.equal(
        cache.layers[1].keys, kept[1][0][:, :, :3]
    )
