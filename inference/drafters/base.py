"""The interface the decode loop drafts through, and the adapter for drafters of one sequence.

The loop (inference.loop) decodes rows (one per prompt; a single prompt is one row) and calls, in this order:
- `reset(rows)`                         new sequences start;
- `add_rows(count)`                     more sequences join after the current rows (continuous batching);
- `observe_rows(hidden, next_tokens)`   the target has processed more tokens of each row: hidden[b][layer] is
                                        their [k, H] hidden states for each layer in `hidden_layers`,
                                        next_tokens[b] the committed tokens that follow each of them (the last
                                        one is the row's new root);
- `propose_rows(texts, max_depths, host_texts)`
                                        a Tree for each row, rooted at texts[b][-1], no deeper than max_depths[b];
                                        host_texts[b] holds texts[b] on the host (a NumPy array), for drafters that
                                        work on the tokens in Python: on a GPU they then need not wait for it
                                        (None outside the loop);
- `keep_rows(rows)`                     only these rows go on (the others finished), in this order.

A drafter of one sequence at a time subclasses `SequenceDrafter` and writes `propose` (and `observe` and `reset`
when it keeps state); one that reads only the committed tokens subclasses `TokenDrafter` and can serve a batch.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import torch

from heads import DraftVocabulary, EarlyExitHead, HeadConfigError
from heads.config import check_feature_layers

from ..tree import StaticTree, Tree, TreeError, static_tree

KEPT_VOCABULARY = "_specheads_draft_vocabulary"  # the head's attribute holding its draft vocabulary between calls


def kept_vocabulary(head, make: Callable[[], DraftVocabulary], *tensors: torch.Tensor | None) -> DraftVocabulary:
    """make(), kept on `head` for later drafters while `tensors` (the weights and ids it is made of) are the same
    tensors, unchanged (their version counters): a generate() call makes a drafter, and slicing the target's rows
    and packing them (with a context vocabulary's buffers, kept with it) takes milliseconds, a few steps' drafting."""
    tensors = [tensor for tensor in tensors if tensor is not None]
    kept = getattr(head, KEPT_VOCABULARY, None)
    if kept is not None and len(kept[0]) == len(tensors):
        if all(ref() is tensor and version == tensor._version for (ref, version), tensor in zip(kept[0], tensors)):
            return kept[1]
    vocab = make()
    setattr(head, KEPT_VOCABULARY, ([(weakref.ref(tensor), tensor._version) for tensor in tensors], vocab))
    return vocab


class Drafter(ABC):
    """What the decode loop calls; see the module's docstring for the order and the arguments."""

    hidden_layers: tuple[int, ...] = ()  # the target's layers whose hidden states observe_rows receives

    @abstractmethod
    def reset(self, rows: int = 1) -> None: ...

    @abstractmethod
    def add_rows(self, count: int) -> None: ...

    @abstractmethod
    def keep_rows(self, rows: list[int]) -> None: ...

    @abstractmethod
    def observe_rows(self, hidden: list[dict[int, torch.Tensor]], next_tokens: list[torch.Tensor]) -> None: ...

    @abstractmethod
    def propose_rows(
        self, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray] | None = None
    ) -> list[Tree]: ...

    # one sequence, outside the loop (tests, scripts)
    def observe(self, hidden: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None:
        self.observe_rows([hidden], [next_tokens])

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        return self.propose_rows([tokens], [max_depth])[0]


class SequenceDrafter(Drafter):
    """The adapter for a drafter of one sequence: write `propose(tokens, max_depth)` and, if it keeps state,
    `observe(hidden, next_tokens)` and `reset()`; the loop's row methods call them for the one row. Such a drafter
    cannot serve a batch (generate() says so), unless it reads only the committed tokens (`TokenDrafter`)."""

    serves_batches = False  # True: no state of its own, so one instance may propose for every row in turn

    @abstractmethod
    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree: ...

    def observe(self, hidden: dict[int, torch.Tensor], next_tokens: torch.Tensor) -> None:
        pass

    def reset(self, rows: int = 1) -> None:
        pass

    def add_rows(self, count: int) -> None:
        pass

    def keep_rows(self, rows: list[int]) -> None:
        pass

    def observe_rows(self, hidden: list[dict[int, torch.Tensor]], next_tokens: list[torch.Tensor]) -> None:
        for row_hidden, tokens in zip(hidden, next_tokens):
            self.observe(row_hidden, tokens)

    def propose_rows(
        self, texts: list[torch.Tensor], max_depths: list[int], host_texts: list[np.ndarray] | None = None
    ) -> list[Tree]:
        return [self.propose(text, depth) for text, depth in zip(texts, max_depths)]


class TokenDrafter(SequenceDrafter):
    """A drafter that reads only the committed tokens: no hidden states, no state to reset, any number of rows."""

    serves_batches = True


class NoDrafter(TokenDrafter):
    """Plain decoding through the same loop: every tree is just the root."""

    def propose(self, tokens: torch.Tensor, max_depth: int) -> Tree:
        return root_only(tokens)


def root_only(tokens: torch.Tensor) -> Tree:
    return Tree.chain(tokens[-1:])


def drafter_name(drafter) -> str:
    inner = getattr(drafter, "drafters", None)  # a MergedDrafter names what it merges
    if inner is not None:
        return f"{type(drafter).__name__}({', '.join(drafter_name(d) for d in inner)})"
    return type(drafter).__name__


def as_static_tree(tree) -> StaticTree:
    if isinstance(tree, StaticTree):
        return tree
    if isinstance(tree, (list, tuple)):
        return static_tree(tree)
    raise TreeError(f"expected a static tree (a list of paths such as [(0,), (0, 0), (1,)]), got {tree!r}")


def check_head_fits(heads, model, what: str) -> None:
    """Refuse heads built for another model, or left behind when the model was moved or cast."""
    config, target = heads.config, model.config
    if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise HeadConfigError(
            f"{what} expects hidden size {config.hidden_size} and vocab {config.vocab_size}, but the target "
            f"{getattr(target, '_name_or_path', '') or target.model_type!r} has {target.hidden_size} and "
            f"{target.vocab_size}: these heads were built for another base model"
        )
    check_feature_layers(config, target, what)
    if isinstance(heads, EarlyExitHead) and not heads.runs_on(model):
        raise HeadConfigError(
            f"{what} runs the layers of another model instance, or of this one before it was moved or cast: load it "
            f"again for this model (heads.load_heads(path, model)) after any .to(...)"
        )
    parameter = next(heads.parameters(), None)  # an untrained early exit has none
    if parameter is not None and (parameter.dtype, parameter.device) != (model.dtype, model.device):
        raise HeadConfigError(
            f"{what} are in {parameter.dtype} on {parameter.device} but the target is in {model.dtype} on "
            f"{model.device} (was the model moved or cast after its heads were loaded?): call "
            "heads.to(device=model.device, dtype=model.dtype)"
        )
