"""How heads are made: the accelerate entry point `training/train_heads.py` (see the README)."""
