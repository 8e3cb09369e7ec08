"""KV caches indexed by position: after verification keep exactly the accepted path's entries.

Rejected tree nodes sit after the accepted ones; moving the path's entries into place and cropping the
rest means the next pass simply writes over them (gpt-fast's idea, on Hugging Face's `DynamicCache`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache(model) -> DynamicCache:
    """An empty cache for `model`, refused when its layers cannot be compacted to a tree path."""
    cache = DynamicCache(config=model.config)
    unsupported = {type(layer).__name__ for layer in cache.layers if type(layer) is not DynamicLayer}
    if unsupported:
        raise NotImplementedError(
            f"{model.config.model_type} uses cache layers {sorted(unsupported)} (sliding-window or recurrent "
            "state), which cannot be rolled back to an accepted tree path yet. Use a model with full attention, "
            "or disable its sliding window in the config if it never takes effect at your lengths."
        )
    return cache


def keep_path(cache: DynamicCache, past_length: int, path: torch.Tensor, tree_size: int) -> None:
    """The cache holds past_length + tree_size entries; keep the past and the nodes in `path` (sorted)."""
    kept = path.shape[0]
    if int(path[-1]) != kept - 1:  # the path is not simply the first nodes: move its entries forward
        source = path + past_length
        for layer in cache.layers:
            layer.keys[:, :, past_length : past_length + kept] = layer.keys[:, :, source]
            layer.values[:, :, past_length : past_length + kept] = layer.values[:, :, source]
    cache.crop(kept - tree_size)  # crop takes a negative count of entries to drop


def keep_paths(cache, cached: list[int], cache_length: int, paths: list[torch.Tensor]) -> list[int]:
    """Move each row's accepted path (node indices into the block appended after `cache_length`) to the row's own
    end, crop the cache to the longest row, and return the rows' new committed lengths."""
    kept = [past + path.shape[0] for past, path in zip(cached, paths)]
    device = paths[0].device
    rows = torch.cat([torch.full_like(path, row) for row, path in enumerate(paths)])
    target = torch.cat([torch.arange(past, past + path.shape[0], device=device) for past, path in zip(cached, paths)])
    source = torch.cat(paths) + cache_length
    for layer in cache.layers:  # one gather and one scatter a layer for all rows (the right side is a copy)
        layer.keys[rows, :, target] = layer.keys[rows, :, source]
        layer.values[rows, :, target] = layer.values[rows, :, source]
    cache.crop(max(kept) - cache.get_seq_length())
    return kept


def keep_rows(cache, rows: torch.Tensor) -> None:
    """Drop the other rows from the cache (finished sequences leave the batch)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.index_select(0, rows), layer.values.index_select(0, rows)
