"""What a draft head is (Medusa, EAGLE, early exit): modules, typed configs, checkpoints validated against their
target."""

from .config import EagleConfig, EarlyExitConfig, HeadConfigError, LayerShape, MedusaConfig, TargetFingerprint
from .eagle import NO_COPY, EagleHead, copy_embedding, copy_tokens
from .early_exit import EarlyExitHead
from .io import build_heads, load_heads, save_heads
from .medusa import MedusaHeads
from .vocab import DraftVocabulary, most_frequent_tokens

__all__ = [
    "DraftVocabulary",
    "EagleConfig",
    "EagleHead",
    "EarlyExitConfig",
    "EarlyExitHead",
    "HeadConfigError",
    "LayerShape",
    "MedusaConfig",
    "MedusaHeads",
    "NO_COPY",
    "TargetFingerprint",
    "build_heads",
    "copy_embedding",
    "copy_tokens",
    "load_heads",
    "most_frequent_tokens",
    "save_heads",
]
