"""How heads are used: one decode loop, drafters behind one interface, exact acceptance."""

from .accept import Sampling
from .compiled import compile_target, warm_up
from .drafters import (
    Drafter,
    EagleDrafter,
    EarlyExitDrafter,
    MedusaDrafter,
    MergedDrafter,
    NoDrafter,
    OracleDrafter,
    PromptLookupDrafter,
    SequentialMedusaDrafter,
    medusa_tree_spec,
)
from .generate import Generation, GenerationStats, generate
from .target import load_target
from .tree import DynamicTreeSpec, StaticTree, Tree, TreeError, best_static_paths, chain_paths, static_tree

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
    "SequentialMedusaDrafter",
    "StaticTree",
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
