"""What a draft head is: modules, typed configs, checkpoints validated against their target."""

from .config import EagleConfig, HeadConfigError, MedusaConfig, TargetFingerprint
from .eagle import EagleHead
from .io import build_heads, load_heads, save_heads
from .medusa import MedusaHeads
from .vocab import DraftVocabulary, most_frequent_tokens

__all__ = [
    "DraftVocabulary",
    "EagleConfig",
    "EagleHead",
    "HeadConfigError",
    "MedusaConfig",
    "MedusaHeads",
    "TargetFingerprint",
    "build_heads",
    "load_heads",
    "most_frequent_tokens",
    "save_heads",
]
