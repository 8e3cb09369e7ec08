"""Drafters: where candidate trees come from, behind the one interface the loop uses (base.Drafter).

`drafter_class` is the one place that tells which drafter loaded heads take; `as_drafter` turns what generate()
accepts as `heads` into a drafter.
"""

from __future__ import annotations

from heads import EagleHead, EarlyExitHead, MedusaHeads

from ..tree import TreeError
from .base import Drafter, NoDrafter, SequenceDrafter, TokenDrafter, drafter_name, root_only
from .dynamic import MAX_RELIABILITY, RELIABILITY_DECAY, DraftNodes, DynamicTreeDrafter, drafted_nodes
from .eagle import EagleDrafter
from .early_exit import EarlyExitDrafter
from .lookup import PromptLookupDrafter
from .medusa import MedusaDrafter, SequentialMedusaDrafter, medusa_tree_spec
from .merged import SPAN_PRIOR, MergedDrafter, span_outcome
from .oracle import OracleDrafter

TrainedHeads = MedusaHeads | EagleHead | EarlyExitHead  # what heads.load_heads returns


def drafter_class(heads) -> type[Drafter] | None:
    """The drafter that loaded heads (heads.load_heads) draft through; None for anything else."""
    if isinstance(heads, MedusaHeads):
        return SequentialMedusaDrafter if heads.config.sequential else MedusaDrafter
    if isinstance(heads, EagleHead):
        return EagleDrafter
    if isinstance(heads, EarlyExitHead):
        return EarlyExitDrafter
    return None


def is_trained(heads) -> bool:
    return drafter_class(heads) is not None


def trained_head(heads):
    """The trained head among `heads` (one, or a list of drafters), or None."""
    candidates = heads if isinstance(heads, (list, tuple)) else [heads]
    return next((h for h in candidates if is_trained(h)), None)


def grows_dynamic_trees(heads) -> bool:
    """Whether these loaded heads grow their trees a level (a head pass) at a time, EAGLE-2's way: EAGLE, the early
    exit, sequential Medusa heads. Such a drafter weighs copied spans against its drafts in a batch (MergedDrafter),
    and calibration prices a level of it."""
    kind = drafter_class(heads)
    return kind is not None and issubclass(kind, DynamicTreeDrafter)


def as_drafter(heads, model, tree=None, context_vocab: bool = True) -> Drafter:
    """What generate() accepts as `heads`: None, loaded heads, a drafter, or a list of them to merge.
    `context_vocab=False`: trained heads draft from their own draft vocabulary only (inference.context_vocab)."""
    if isinstance(heads, type):
        raise TypeError(
            f"heads is the class {heads.__name__}, not a drafter: pass an instance, e.g. {heads.__name__}()"
        )
    if heads is None:
        if tree is not None:
            raise TreeError("a tree was given but no heads or drafter to fill it")
        return NoDrafter()
    kind = drafter_class(heads)
    if kind is not None:
        return kind(heads, model, tree, context_vocab)
    if isinstance(heads, (list, tuple)):
        return MergedDrafter([as_drafter(h, model, tree if is_trained(h) else None, context_vocab) for h in heads])
    if isinstance(heads, Drafter):
        if tree is not None:
            raise TreeError(
                f"{type(heads).__name__} was built with its own tree; pass tree= to its constructor instead"
            )
        return heads
    if callable(getattr(heads, "propose", None)):
        raise TypeError(
            f"{type(heads).__name__} has a propose method but is not a Drafter: subclass "
            "inference.drafters.SequenceDrafter (one sequence: propose, and observe and reset if it keeps state) or "
            "TokenDrafter (it reads only the committed tokens)"
        )
    raise TypeError(
        f"heads must be None, heads from heads.load_heads, a Drafter, or a list of them; got {type(heads).__name__}"
    )


__all__ = [
    "MAX_RELIABILITY",
    "RELIABILITY_DECAY",
    "SPAN_PRIOR",
    "DraftNodes",
    "Drafter",
    "DynamicTreeDrafter",
    "EagleDrafter",
    "EarlyExitDrafter",
    "MedusaDrafter",
    "MergedDrafter",
    "NoDrafter",
    "OracleDrafter",
    "PromptLookupDrafter",
    "SequenceDrafter",
    "SequentialMedusaDrafter",
    "TokenDrafter",
    "TrainedHeads",
    "as_drafter",
    "drafted_nodes",
    "drafter_class",
    "drafter_name",
    "grows_dynamic_trees",
    "is_trained",
    "medusa_tree_spec",
    "root_only",
    "span_outcome",
    "trained_head",
]
