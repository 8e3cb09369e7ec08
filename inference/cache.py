"""KV caches indexed by position: after verification keep exactly the accepted path's entries.

Rejected tree nodes sit after the accepted ones; moving the path's entries into place and cropping the
rest means the next pass simply writes over them (gpt-fast's idea, on Hugging Face's cache classes).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from . import huge_pages
from .transfer import to_device


class PositionLayer(DynamicLayer):
    """A DynamicLayer whose entries sit in a buffer with room to grow: a pass writes its entries after the kept ones
    instead of concatenating a copy of the whole cache (DynamicLayer's way, which cost 5-10% of a batch's verification
    pass); a compiled pass writes them into the buffer itself (`reserve`, then `extend`). `keys` and `values` stay views
    of the used part (the buffer's first rows and entries), so cropping them and moving a path's entries within them
    work as on a DynamicLayer. Rows leaving or joining a batch move within the buffer too (keep_rows, append_rows): a
    new buffer for each would touch fresh memory every time rows change, a cost paid per layer."""

    key_buffer = value_buffer = None  # allocated at the first update
    shared: SharedBuffers | None = None  # the one allocation of every layer's buffers, where the cache has one

    def __init__(self, shared: SharedBuffers | None = None):
        super().__init__()
        self.shared = shared

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        used, new = self.get_seq_length(), key_states.shape[-2]
        key_buffer, value_buffer = self.reserve(key_states, new)
        key_buffer[:, :, used : used + new] = key_states
        value_buffer[:, :, used : used + new] = value_states
        self.extend(key_states.shape[0], new)
        return self.keys, self.values

    def reserve(self, like: torch.Tensor, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The buffers' first rows, as many as `like` has ([rows, heads, _, dim], the entries' dtype and device),
        with room for `new` entries after the used ones: where they are written (a compiled pass writes them in
        place) before `extend` takes them in. A new buffer, the used entries copied, where there is no room: the
        first pass, a full buffer, or more rows than it had room for."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
            if self.shared is not None and self.key_buffer is not None:  # laid out by SharedBuffers.grow already
                rows = like.shape[0]
                self.keys, self.values = self.key_buffer[:rows, :, :0], self.value_buffer[:rows, :, :0]
            else:
                self.key_buffer = self.value_buffer = None
        used, rows = self.get_seq_length(), like.shape[0]
        fits = self._fits(like.shape, used + new)
        if not fits and self.shared is not None:
            self.shared.grow(like, used + new)  # every layer's buffers, this one's among them
            fits = self._fits(like.shape, used + new)
        if not fits:
            capacity = used + new + max(256, (used + new) // 2)
            shape = (*like.shape[:-2], capacity, like.shape[-1])
            key_buffer, value_buffer = like.new_empty(shape), like.new_empty(shape)
            if used:
                key_buffer[..., :used, :] = self.keys
                value_buffer[..., :used, :] = self.values
            self.key_buffer, self.value_buffer = key_buffer, value_buffer
        return self.key_buffer[:rows], self.value_buffer[:rows]

    def extend(self, rows: int, new: int) -> None:
        """Take in the `new` entries written after the used ones in the buffers' first `rows` rows (reserve)."""
        end = self.get_seq_length() + new
        self.keys, self.values = self.key_buffer[:rows, :, :end], self.value_buffer[:rows, :, :end]

    def keep_rows(self, rows: list[int]) -> None:
        """Only these rows go on, in this order, moved to the buffer's first rows (only those whose place changes)."""
        if not self._fits(self.keys.shape, self.keys.shape[-2]):
            index = to_device(rows, self.keys.device)
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)
            return  # the next update gives them a buffer
        length = self.keys.shape[-2]
        for buffer in (self.key_buffer, self.value_buffer):
            move_rows(buffer[:, :, :length], rows)
        self.keys, self.values = self.key_buffer[: len(rows), :, :length], self.value_buffer[: len(rows), :, :length]

    def append_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows joining after the current ones, in the buffer when it has room; empty entries pad the shorter side."""
        rows, length, joining = self.keys.shape[0], self.keys.shape[-2], keys.shape[0]
        width = max(length, keys.shape[-2])
        if not self._fits((rows + joining, *self.keys.shape[1:]), width):
            self.keys = torch.cat([_padded(self.keys, width), _padded(keys, width)])
            self.values = torch.cat([_padded(self.values, width), _padded(values, width)])
            return
        for buffer, new in ((self.key_buffer, keys), (self.value_buffer, values)):
            buffer[:rows, :, length:width] = 0
            buffer[rows : rows + joining, :, : new.shape[-2]] = new
            buffer[rows : rows + joining, :, new.shape[-2] : width] = 0
        self.keys, self.values = (
            self.key_buffer[: rows + joining, :, :width],
            self.value_buffer[: rows + joining, :, :width],
        )

    def _fits(self, shape, length: int) -> bool:
        """Whether `keys` still lives at the start of the buffer, and the buffer has room for entries of `shape`
        (rows, heads, _, dim) up to `length`."""
        buffer, keys = self.key_buffer, self.keys
        if buffer is None or buffer.shape[0] < shape[0] or buffer.shape[-2] < length:
            return False
        if buffer.shape[1:-2] != tuple(shape[1:-2]) or buffer.shape[-1] != shape[-1]:
            return False
        if keys.stride() != buffer.stride():
            return False
        if keys.numel():  # where the entries start (data_ptr() reads 0 for an empty view, so not by that alone)
            return keys.data_ptr() == buffer.data_ptr()
        return (
            keys.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            and keys.storage_offset() == buffer.storage_offset()
        )


class SharedBuffers:
    """Every layer's key and value buffers in one allocation, [2 * layers, rows, heads, capacity, dim] (layer i's keys
    at 2i, its values at 2i + 1), so that moving entries in every layer (a step's accepted paths) is one gather and
    one scatter instead of two of each a layer. Layers whose entries are shaped otherwise keep buffers of their own."""

    def __init__(self):
        self.layers: list[PositionLayer] = []
        self.tensor: torch.Tensor | None = None
        self._views = None  # (tensor, rows, each layer's (keys, values) first rows): what `stores` gave last
        self._narrowed = None  # (rows, length, every layer's keys and values): what `narrow` set last

    def grow(self, like: torch.Tensor, length: int) -> None:
        """Buffers with room for `length` entries of `like`'s rows for every layer, each layer's used entries copied
        in; nothing where a layer's entries are shaped otherwise (that layer's own buffer then grows)."""
        layers = [layer for layer in self.layers if _has_entries(layer)]
        if any(not _same_layout(layer.keys, like) for layer in layers):
            return
        rows = max([like.shape[0]] + [layer.keys.shape[0] for layer in layers])
        capacity = length + max(256, length // 2)
        self._views = self._narrowed = None  # views of the old buffers: they would keep them alive till the next pass
        self.tensor = like.new_empty(2 * len(self.layers), rows, *like.shape[1:-2], capacity, like.shape[-1])
        huge_pages.for_tensor(self.tensor)  # attention reads every layer's entries each pass
        for index, layer in enumerate(self.layers):
            keys, values = self.tensor[2 * index], self.tensor[2 * index + 1]
            if _has_entries(layer):
                used_rows, used = layer.keys.shape[0], layer.keys.shape[-2]
                keys[:used_rows, :, :used] = layer.keys
                values[:used_rows, :, :used] = layer.values
                layer.keys, layer.values = keys[:used_rows, :, :used], values[:used_rows, :, :used]
            elif layer.is_initialized:  # initialized by the pass that grows these buffers: no entries yet
                layer.keys, layer.values = keys[: like.shape[0], :, :0], values[: like.shape[0], :, :0]
            layer.key_buffer, layer.value_buffer = keys, values

    def stores(self, rows: int, used: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Every layer's buffers' first `rows` rows, where a pass over `rows` rows may write its entries in place:
        every layer holding `used` entries of those rows at the start of its buffer here, with room up to `length`.
        None otherwise (each layer then reserves its own: PositionLayer.reserve). What a pass's 30 reserve calls
        would give, checked in one loop: they cost a few percent of a one-token pass."""
        tensor = self.tensor
        if tensor is None or tensor.shape[1] < rows or tensor.shape[-2] < length or not used:
            return None
        if self._views is None or self._views[0] is not tensor or self._views[1] != rows:
            views = [(tensor[2 * index, :rows], tensor[2 * index + 1, :rows]) for index in range(len(self.layers))]
            self._views = (tensor, rows, views)
        views = self._views[2]
        if self.narrowed() == (rows, used):  # every layer's entries are the views `narrow` made: no need to look
            return views
        for layer, (keys, values) in zip(self.layers, views, strict=True):
            entries = layer.keys
            if entries.data_ptr() != keys.data_ptr() or layer.values.data_ptr() != values.data_ptr():
                return None
            if entries.shape[0] != rows or entries.shape[-2] != used or entries.stride() != keys.stride():
                return None
        return views

    def extend(self, views: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Every layer takes in the entries a pass wrote into `views` (from `stores`), up to `length`."""
        self.narrow(views[0][0].shape[0], length)

    def narrow(self, rows: int, length: int) -> None:
        """Every layer's entries become the buffers' first `rows` rows and `length` entries: one view of all of them,
        unbound (a slice a layer cost three times as much, twice a step)."""
        parts = self.tensor[:, :rows, :, :length].unbind(0)
        for index, layer in enumerate(self.layers):
            layer.keys, layer.values = parts[2 * index], parts[2 * index + 1]
        self._narrowed = (rows, length, parts)

    def narrowed(self) -> tuple[int, int] | None:
        """(rows, entries) where every layer's entries are still the views `narrow` gave them, else None: whatever
        replaced a layer's entries since (an update, keep_rows) replaced the tensor objects, which this compares."""
        if self._narrowed is None:
            return None
        rows, length, parts = self._narrowed
        layers = self.layers
        if len(parts) != 2 * len(layers) or not all(
            layer.keys is parts[2 * index] and layer.values is parts[2 * index + 1]
            for index, layer in enumerate(layers)
        ):
            return None
        return rows, length

    def used(self) -> torch.Tensor | None:
        """The used part of every layer's entries as one view [2 * layers, rows, heads, used, dim], or None where
        some layer's entries are elsewhere (or not of one size)."""
        if self.tensor is None or not self.layers or not all(layer.is_initialized for layer in self.layers):
            return None
        shape = self.layers[0].keys.shape
        for index, layer in enumerate(self.layers):
            buffer = layer.key_buffer
            on_buffer = buffer is not None and buffer.data_ptr() == self.tensor[2 * index].data_ptr()
            if not (on_buffer and layer._fits(shape, shape[-2]) and layer.keys.shape == shape):
                return None
        return self.tensor[:, : shape[0], :, : shape[-2]]


def _has_entries(layer: PositionLayer) -> bool:
    """Whether the layer holds entries shaped [rows, heads, n, dim] (a layer just initialized holds an empty 1-D
    tensor)."""
    return layer.is_initialized and layer.keys.dim() == 4


def _same_layout(entries: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether `entries` and `like` ([rows, heads, n, dim]) differ at most in rows and entries."""
    same_heads_and_dim = entries.shape[1:-2] == like.shape[1:-2] and entries.shape[-1] == like.shape[-1]
    return same_heads_and_dim and entries.dtype == like.dtype and entries.device == like.device


def position_cache(layers: int | None = None) -> Cache:
    """An empty cache of PositionLayers: `layers` of them with their buffers in one allocation (SharedBuffers), or
    without a count, one added per layer as a model first writes to it, each with buffers of its own."""
    if layers is None:
        return Cache(layer_class_to_replicate=PositionLayer)
    shared = SharedBuffers()
    shared.layers = [PositionLayer(shared) for _ in range(layers)]
    return PositionCache(shared)


class PositionCache(Cache):
    """A Cache of PositionLayers whose buffers are one allocation (SharedBuffers): a crop narrows every layer's
    entries at once where they are all the shared buffers' views."""

    def __init__(self, shared: SharedBuffers):
        super().__init__(layers=shared.layers)
        self.shared = shared

    def crop(self, tokens_to_remove: int) -> None:
        narrowed = self.shared.narrowed()
        if narrowed is None or tokens_to_remove >= 0:  # Cache.crop says what a positive count means
            super().crop(tokens_to_remove)
            return
        rows, length = narrowed
        self.shared.narrow(rows, max(length + tokens_to_remove, 0))


def new_cache(model) -> Cache:
    """An empty cache for `model`, refused when its layers cannot be compacted to a tree path."""
    layers = DynamicCache(config=model.config).layers
    unsupported = {type(layer).__name__ for layer in layers if type(layer) is not DynamicLayer}
    if unsupported:
        raise NotImplementedError(
            f"{model.config.model_type} uses cache layers {sorted(unsupported)} (sliding-window or recurrent "
            "state), which cannot be rolled back to an accepted tree path yet. Use a model with full attention, "
            "or disable its sliding window in the config if it never takes effect at your lengths."
        )
    return position_cache(len(layers))


def keep_path(cache: Cache, past_length: int, path: torch.Tensor, tree_size: int) -> None:
    """The cache holds past_length + tree_size entries; keep the past and the nodes in `path` (sorted)."""
    kept = path.shape[0]
    if int(path[-1]) != kept - 1:  # the path is not simply the first nodes: move its entries forward
        source = path + past_length
        shared = _shared_entries(cache)
        if shared is not None:  # every layer at once
            shared[:, :, :, past_length : past_length + kept] = shared[:, :, :, source]
        else:
            for layer in cache.layers:
                layer.keys[:, :, past_length : past_length + kept] = layer.keys[:, :, source]
                layer.values[:, :, past_length : past_length + kept] = layer.values[:, :, source]
    cache.crop(kept - tree_size)  # crop takes a negative count of entries to drop


def keep_paths(
    cache, cached: list[int], cache_length: int, paths: list[torch.Tensor], deepest: list[int] | None = None
) -> list[int]:
    """Move each row's accepted path (node indices into the block appended after `cache_length`) to the row's own
    end, crop the cache to the longest row, and return the rows' new committed lengths. `deepest`, each path's last
    node when the caller has read it already, saves reading it here."""
    kept = [past + path.shape[0] for past, path in zip(cached, paths)]
    lasts = deepest if deepest is not None else [None] * len(paths)
    if all(  # an empty path (a row that added nothing) moves nothing
        path.shape[0] == 0 or (past == cache_length and (int(path[-1]) if last is None else last) == path.shape[0] - 1)
        for past, path, last in zip(cached, paths, lasts)
    ):
        cache.crop(max(kept) - cache.get_seq_length())  # every path is its block's first nodes: already in place
        return kept
    device = paths[0].device
    rows = torch.cat([torch.full_like(path, row) for row, path in enumerate(paths)])
    target = torch.cat([torch.arange(past, past + path.shape[0], device=device) for past, path in zip(cached, paths)])
    _move_entries(cache, rows, target, torch.cat(paths) + cache_length)
    cache.crop(max(kept) - cache.get_seq_length())
    return kept


def keep_new_entries(cache, cached: list[int], cache_length: int) -> list[int]:
    """keep_paths for a step of one node a row (a plain step): each row's one new entry, at `cache_length`, moved to
    the row's own end; returns the rows' new committed lengths."""
    moving = [row for row, past in enumerate(cached) if past != cache_length]
    if moving:
        device = cache.layers[0].keys.device
        target = to_device([cached[row] for row in moving], device)
        _move_entries(cache, to_device(moving, device), target, torch.full_like(target, cache_length))
    cache.crop(max(cached) + 1 - cache.get_seq_length())
    return [past + 1 for past in cached]


def _shared_entries(cache) -> torch.Tensor | None:
    """Every layer's used entries as one view (SharedBuffers.used), where the cache's layers share one allocation."""
    shared = getattr(cache.layers[0], "shared", None) if cache.layers else None
    return shared.used() if shared is not None else None


def _move_entries(cache, rows: torch.Tensor, target: torch.Tensor, source: torch.Tensor) -> None:
    """Entry source[i] of row rows[i] copied to entry target[i], in every layer: one gather and one scatter for all
    rows (the right side is a copy), for all layers at once where they share one allocation."""
    shared = _shared_entries(cache)
    if shared is not None:
        shared[:, rows, :, target] = shared[:, rows, :, source]
        return
    for layer in cache.layers:
        layer.keys[rows, :, target] = layer.keys[rows, :, source]
        layer.values[rows, :, target] = layer.values[rows, :, source]


def keep_rows(cache, rows: list[int]) -> None:
    """Only these rows (slots) go on, in this order (finished sequences leave the batch)."""
    shared = _shared_entries(cache)
    if shared is not None:  # every layer at once
        move_rows(shared, rows, dim=1)
        cache.layers[0].shared.narrow(len(rows), shared.shape[-2])
        return
    for layer in cache.layers:
        if isinstance(layer, PositionLayer) and layer.key_buffer is not None:
            layer.keep_rows(rows)
        else:
            index = to_device(rows, layer.keys.device)
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)


def move_rows(entries: torch.Tensor, rows: list[int], dim: int = 0) -> None:
    """entries' slots along `dim` become rows[0], rows[1], ... (slots past len(rows) are left as they are): only the
    slots whose row changes are written, a slot at a time (index_select over the shared buffers' strided view is many
    times slower: docs/experiments.md, row X28)."""
    moved = [(slot, row) for slot, row in enumerate(rows) if slot != row]
    sources = {row for _, row in moved}
    # where a slot is written before its row is read elsewhere (a cycle), the rows are read from copies
    copies = {row: entries.select(dim, row).clone() for row in sources} if any(s in sources for s, _ in moved) else {}
    for slot, row in moved:
        entries.select(dim, slot).copy_(copies[row] if copies else entries.select(dim, row))


def append_rows(cache, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Add rows after the cache's own (sequences joining the batch): keys[i] / values[i] [rows, heads, length,
    dim] for layer i. The shorter side is padded with zero entries, which every query masks off as it does a
    shorter row's stale ones."""
    for layer, new_keys, new_values in zip(cache.layers, keys, values, strict=True):
        if isinstance(layer, PositionLayer) and layer.key_buffer is not None:
            layer.append_rows(new_keys, new_values)
            continue
        length = max(layer.keys.shape[-2], new_keys.shape[-2])
        layer.keys = torch.cat([_padded(layer.keys, length), _padded(new_keys, length)])
        layer.values = torch.cat([_padded(layer.values, length), _padded(new_values, length)])


def reserve_rows(cache, rows: int, length: int) -> None:
    """Room in the cache's shared buffers for `rows` rows of `length` entries, where it holds entries there: prompts
    about to join the batch then join in place (append_rows), where a full buffer would have them concatenated and
    the next pass copy every row's entries into a larger one (docs/experiments.md, row X31). Rows not written yet
    take no memory (the buffers are allocated empty, and pages are faulted in as they are written)."""
    shared = getattr(cache, "shared", None)
    if shared is None or shared.tensor is None or not all(_has_entries(layer) for layer in shared.layers):
        return
    like = shared.layers[0].keys
    length = max(length, like.shape[-2])
    if shared.tensor.shape[1] >= rows and shared.tensor.shape[-2] >= length:
        return
    shared.grow(like.new_empty(rows, *like.shape[1:-2], 0, like.shape[-1]), length)


def _padded(entries: torch.Tensor, length: int) -> torch.Tensor:
    """entries [rows, heads, n, dim] with zero entries after them up to `length`."""
    missing = length - entries.shape[-2]
    return (
        entries
        if missing == 0
        else torch.cat([entries, entries.new_zeros(*entries.shape[:-2], missing, entries.shape[-1])], dim=-2)
    )
