"""How heads are used: one decode loop, drafters behind one interface, exact acceptance."""

from .accept import Sampling
from .compiled import compile_target
from .compiled_heads import warm_up
from .drafters import (
    Drafter,
    EagleDrafter,
    EarlyExitDrafter,
    MedusaDrafter,
    MergedDrafter,
    NoDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    SequenceDrafter,
    SequentialMedusaDrafter,
    TokenDrafter,
    medusa_tree_spec,
)
from .generate import generate
from .stats import Generation, GenerationStats
from .target import load_target
from .tree import StaticTree, Tree, TreeError, chain_paths, static_tree
from .tree_size import DynamicTreeSpec, best_static_paths

__all__ = [
    "Drafter",
    "DynamicTreeSpec",
    "EagleDrafter",
    "EarlyExitDrafter",
    "Generation",
    "GenerationStats",
    "MedusaDrafter",
    "MergedDrafter",
    "NoDrafter",
    "OracleDrafter",
    "PromptLookupDrafter",
    "Sampling",
    "SequenceDrafter",
    "SequentialMedusaDrafter",
    "StaticTree",
    "TokenDrafter",
    "Tree",
    "TreeError",
    "best_static_paths",
    "chain_paths",
    "compile_target",
    "generate",
    "load_target",
    "medusa_tree_spec",
    "static_tree",
    "warm_up",
]
