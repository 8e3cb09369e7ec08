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
