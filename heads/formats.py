"""Published head formats: read EAGLE-1/2, EAGLE-3 (SafeAILab, SpecForge), speculators and Medusa directories into
this project's heads, and write ours back out so vLLM and SGLang can serve them.

Every format maps onto a head of ours that computes what the format's own code computes (heads.eagle's
`architecture`, Medusa's `own_lm_heads`), so a conversion only renames and reshapes tensors: a round trip gives
the same tensors back. What each format holds, and where the implementations disagree, is in
docs/interop-formats.md. Foreign files carry no fingerprint of their target, so a head is checked against the
target it is loaded for by its sizes and, where the files hold it, the token embedding.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import EagleConfig, HeadConfigError, MedusaConfig
from .eagle import EagleHead
from .files import check_output_dir, written_atomically
from .medusa import MedusaHeads

FORMATS = ("ours", "eagle", "eagle3", "speculators", "medusa")
EXPORTS = ("eagle", "eagle3", "speculators", "medusa")  # what `write_format` writes; "ours" is heads.save_heads
MEDUSA_WEIGHTS = ("medusa_lm_head.pt", "medusa_lm_head.safetensors")
WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def detect_format(path: str | os.PathLike) -> str:
    """Which of FORMATS the directory at `path` holds, from its files; a clear error when none."""
    path = Path(path)
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        raise HeadConfigError(f"{path} is not a head checkpoint: no {config_file}")
    config = _read_json(config_file)
    if "head" in config and "target" in config:
        return "ours"
    if "speculators_model_type" in config:
        if config["speculators_model_type"] != "eagle3":
            raise HeadConfigError(
                f"{path} is a speculators {config['speculators_model_type']!r} model; only 'eagle3' heads can be loaded"
            )
        return "speculators"
    if "medusa_num_heads" in config:
        return "medusa"
    if "draft_vocab_size" in config:
        return "eagle3"
    state = _read_weights(path, WEIGHTS)
    if any(name.startswith("midlayer.") for name in state):
        return "eagle3"
    if "fc.weight" in state and any(name.startswith("layers.0.") for name in state):
        return "eagle"
    raise HeadConfigError(
        f"{path} holds no head this project can read: expected our config.json, or an EAGLE, EAGLE-3, speculators or "
        f"Medusa directory (see docs/interop-formats.md); its config.json has keys {sorted(config)[:8]}"
    )


def load_foreign(path: str | os.PathLike, target, fmt: str | None = None) -> EagleHead | MedusaHeads:
    """Heads for `target` from a directory in one of the published formats, checked against `target`."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    readers = {"eagle": _read_eagle, "eagle3": _read_eagle3, "speculators": _read_speculators, "medusa": _read_medusa}
    if fmt not in readers:
        raise HeadConfigError(f"{path}: format {fmt!r} is not a published head format; use heads.load_heads")
    config = _read_json(path / "config.json")
    heads, state, embedding = readers[fmt](path, config, target)
    _check_embedding(embedding, target, path)
    try:
        heads.load_state_dict({**heads.state_dict(), **state})
    except RuntimeError as error:
        raise HeadConfigError(f"{path}: the weights do not match their config.json ({error})") from None
    parameter = next(target.parameters())
    return heads.to(device=parameter.device, dtype=parameter.dtype).eval()


def write_format(
    heads: EagleHead | MedusaHeads,
    path: str | os.PathLike,
    fmt: str,
    target,
    dtype: torch.dtype = torch.bfloat16,
    *,
    full_vocabulary: bool = False,
) -> Path:
    """Write `heads` (fitted on `target`) to a new or empty directory in format `fmt` (one of EXPORTS).

    Medusa's files have no place for a reduced draft vocabulary: `full_vocabulary=True` writes heads that draft
    from every token instead (other drafts, the same output); without it such heads are refused."""

    writers = {
        "eagle": _eagle_files,
        "eagle3": _eagle3_files,
        "speculators": _speculators_files,
        "medusa": _medusa_files,
    }
    if fmt not in writers:
        raise HeadConfigError(
            f"cannot write format {fmt!r}: choose one of {list(EXPORTS)} (or heads.save_heads for this project's own)"
        )
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise HeadConfigError(
            f"cannot write {fmt} heads to {path}: it exists and is not an empty folder; choose a new output directory"
        )
    check_output_dir(path)
    if fmt == "medusa" and isinstance(heads, MedusaHeads) and heads.config.sequential:
        raise HeadConfigError(
            "these Medusa heads are sequential (each reads the token drafted before it), which Medusa's format cannot "
            "hold; they load only from this project's own format (heads.load_heads)"
        )
    if (
        fmt == "medusa"
        and isinstance(heads, MedusaHeads)
        and heads.config.draft_vocab_size is not None
        and not full_vocabulary
    ):
        raise HeadConfigError(
            "these Medusa heads draft from a reduced vocabulary, which Medusa's format cannot hold: pass "
            "full_vocabulary=True (python -m inference.convert ... --full-vocabulary) to write heads that draft from "
            "every token (other drafts, the same output), or train them with draft_vocab_size: null"
        )
    config, state, weights_name = writers[fmt](heads, target)
    state = {
        name: tensor.detach().to("cpu", dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
        for name, tensor in state.items()
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(path) as staging:
        staging.mkdir()
        if weights_name.endswith(".safetensors"):
            save_file(state, staging / weights_name)
        else:
            torch.save(state, staging / weights_name)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


# --- reading and writing each format --------------------------------------------------------------------------


def _eagle_config(head: EagleConfig) -> dict[str, Any]:
    """The decoder layer's Llama config fields, as SafeAILab's and SpecForge's configs name them."""
    return {
        "model_type": "llama",
        "hidden_size": head.hidden_size,
        "intermediate_size": head.intermediate_size,
        "num_attention_heads": head.num_attention_heads,
        "num_key_value_heads": head.num_key_value_heads,
        "head_dim": head.head_dim,
        "num_hidden_layers": head.num_layers,
        "rms_norm_eps": head.rms_norm_eps,
        "rope_theta": head.rope_theta,
        "max_position_embeddings": head.max_position_embeddings,
        "vocab_size": head.vocab_size,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }


def _eagle_head_config(config: dict[str, Any], where: Path, **fields) -> EagleConfig:
    """Our EagleConfig from a Llama-style config dict (SafeAILab, SpecForge, speculators' transformer_layer_config)."""
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise HeadConfigError(f"{where}: rope scaling {rope} is not supported for a draft head; only plain RoPE is")
    if (
        config.get("hidden_act", "silu") != "silu"
        or config.get("attention_bias")
        or config.get("qkv_bias")
        or config.get("mlp_bias")
    ):
        raise HeadConfigError(
            f"{where}: only Llama-style draft layers (silu, no attention or MLP biases) are supported"
        )
    try:
        heads = config["num_attention_heads"]
        return EagleConfig(
            hidden_size=config["hidden_size"],
            vocab_size=config["vocab_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate_size=config["intermediate_size"],
            num_layers=config.get("num_hidden_layers", 1),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            **fields,
        )
    except KeyError as missing:
        raise HeadConfigError(f"{where}/config.json lacks {missing}") from None


def _read_eagle(path: Path, config, target):
    state = _read_weights(path, WEIGHTS)
    head_config = _eagle_head_config(config, path, architecture="eagle1", fc_bias="fc.bias" in state)
    _check_sizes(head_config, target, path)
    ours = {
        ("decoder." + name if name.startswith("layers.") else name): tensor
        for name, tensor in state.items()
        if name != "embed_tokens.weight"
    }
    return EagleHead(head_config), ours, state.get("embed_tokens.weight")


def _eagle_files(heads, target):
    config = _require_eagle(heads, "eagle1", "eagle")
    state = {
        name.removeprefix("decoder."): tensor
        for name, tensor in heads.state_dict().items()
        if name != "decoder.embed_tokens.weight"
    }
    state["embed_tokens.weight"] = target.get_input_embeddings().weight  # eagle-llm loads strictly: it expects the copy
    return (
        {**_eagle_config(config), "architectures": ["LlamaForCausalLM"], "bias": config.has_fc_bias},
        state,
        "pytorch_model.bin",
    )


def _feature_layers(ids, target, where: Path) -> list[int]:
    """vLLM's aux-layer ids (the residual stream entering layer k: Hugging Face hidden_states[k]), checked."""
    layers = target.config.num_hidden_layers
    ids = [2, layers // 2, layers - 3] if ids is None else list(ids)
    if not all(isinstance(i, int) and 0 <= i < layers for i in ids) or len(set(ids)) != len(ids) or len(ids) < 2:
        raise HeadConfigError(
            f"{where}: eagle_aux_hidden_state_layer_ids {ids} must be distinct layers in 0..{layers - 1} of the target"
        )
    return sorted(ids)  # vLLM concatenates in layer order


def _read_eagle3(path: Path, config, target):
    state = _read_weights(path, WEIGHTS)
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    return _eagle3_heads(path, config, state, _feature_layers(ids, target, path), target, "midlayer.")


def _eagle3_heads(path: Path, config, state, feature_layers, target, layer_prefix: str):
    if config.get("target_hidden_size") not in (None, config["hidden_size"]):
        raise HeadConfigError(
            f"{path}: a draft narrower or wider than its target (target_hidden_size) is not supported"
        )
    if config.get("num_hidden_layers", 1) != 1:
        raise HeadConfigError(f"{path}: EAGLE-3 heads of more than one layer are not supported")
    draft_size = state["lm_head.weight"].shape[0]
    mapped = draft_size < config["vocab_size"] or bool(
        state.get("d2t", torch.zeros(1)).any()
    )  # a draft vocabulary, or a reordered one
    head_config = _eagle_head_config(
        config,
        path,
        architecture="eagle3",
        feature_layers=feature_layers,
        draft_vocab_size=draft_size if mapped else None,
    )
    _check_sizes(head_config, target, path)
    ours = {
        "fuse.weight": state["fc.weight"],
        "norm.weight": state["norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    ours.update(
        {"layer." + name.removeprefix(layer_prefix): t for name, t in state.items() if name.startswith(layer_prefix)}
    )
    if head_config.draft_vocab_size is not None:
        if "d2t" not in state:
            raise HeadConfigError(
                f"{path}: a draft vocabulary of {draft_size} tokens needs its d2t mapping, which the weights lack"
            )
        ours["draft_ids"] = torch.arange(draft_size) + state["d2t"].long()  # d2t holds offsets: target id = i + d2t[i]
    return EagleHead(head_config), ours, state.get("embed_tokens.weight")


def _eagle3_state(heads: EagleHead, target, layer_prefix: str) -> dict[str, torch.Tensor]:
    own = heads.state_dict()
    state = {
        "fc.weight": own["fuse.weight"],
        "norm.weight": own["norm.weight"],
        "lm_head.weight": own["lm_head.weight"],
    }
    state.update(
        {layer_prefix + name.removeprefix("layer."): t for name, t in own.items() if name.startswith("layer.")}
    )
    draft_size, vocab = own["lm_head.weight"].shape[0], heads.config.vocab_size
    ids = heads.draft_ids if heads.draft_ids is not None else torch.arange(draft_size)
    state["d2t"] = ids.long().cpu() - torch.arange(draft_size)
    state["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids.long().cpu(), True)
    state["embed_tokens.weight"] = target.get_input_embeddings().weight  # SpecForge and speculators read it from here
    return state


def _aux_layer_ids(heads: EagleHead, target) -> list[int]:
    layers = target.config.num_hidden_layers
    ids = [layer % (layers + 1) for layer in heads.config.feature_layers]
    if any(i >= layers for i in ids):
        raise HeadConfigError(
            "this head reads the target's final hidden state (layer -1), which Hugging Face gives after the final norm "
            "but vLLM captures before it: an EAGLE-3 export would read other numbers; train with feature_layers below "
            "the last layer"
        )
    if ids != sorted(set(ids)):
        raise HeadConfigError(
            f"feature_layers {heads.config.feature_layers} must be distinct and ascending to export: vLLM concatenates "
            "the layers in that order"
        )
    return ids


def _eagle3_files(heads, target):
    config = _require_eagle(heads, "eagle3", "eagle3")
    ids = _aux_layer_ids(heads, target)
    out = {
        **_eagle_config(config),
        "architectures": ["LlamaForCausalLMEagle3"],
        "draft_vocab_size": heads.lm_head.weight.shape[0],
        "target_hidden_size": config.hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
    }
    return out, _eagle3_state(heads, target, "midlayer."), "model.safetensors"


SPECULATORS_FLAGS = (
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
)  # variants of EAGLE-3 we do not run


def _read_speculators(path: Path, config, target):
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise HeadConfigError(f"{path}/config.json: a speculators eagle3 config needs transformer_layer_config")
    if layer.get("model_type", "llama") != "llama":
        raise HeadConfigError(
            f"{path}: the draft layer is a {layer.get('model_type')!r} layer; only Llama-style layers are supported"
        )
    variants = [flag for flag in SPECULATORS_FLAGS if config.get(flag)]
    if variants:
        raise HeadConfigError(
            f"{path}: {variants} are set; only the plain EAGLE-3 layer (all of {list(SPECULATORS_FLAGS)} false) is "
            "supported"
        )
    state = _read_weights(path, WEIGHTS)
    merged = {
        **layer,
        "draft_vocab_size": config.get("draft_vocab_size"),
        "target_hidden_size": config.get("target_hidden_size"),
    }
    return _eagle3_heads(
        path,
        merged,
        state,
        _feature_layers(config.get("eagle_aux_hidden_state_layer_ids"), target, path),
        target,
        "layers.0.",
    )


def _speculators_files(heads, target):
    config = _require_eagle(heads, "eagle3", "speculators")
    layer = {**_eagle_config(config), "architectures": ["LlamaForCausalLM"]}
    out = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": heads.lm_head.weight.shape[0],
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": _aux_layer_ids(heads, target),
        **{flag: False for flag in SPECULATORS_FLAGS},  # vLLM reads a missing norm_before_residual as true
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": 5, "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": getattr(target.config, "_name_or_path", None) or None,
                "architectures": list(target.config.architectures or []),
            },
        },
    }
    return out, _eagle3_state(heads, target, "layers.0."), "model.safetensors"


def _read_medusa(path: Path, config, target):
    state = _read_weights(path, MEDUSA_WEIGHTS)
    count, layers = config.get("medusa_num_heads"), config.get("medusa_num_layers", 1)
    if not isinstance(count, int) or not isinstance(layers, int) or count < 1 or layers < 1:
        raise HeadConfigError(f"{path}/config.json: medusa_num_heads and medusa_num_layers must be whole numbers >= 1")
    projection = state.get(f"0.{layers}.weight")
    if projection is None:
        raise HeadConfigError(
            f"{path}: the weights lack 0.{layers}.weight, head 0's lm_head (medusa_num_layers {layers})"
        )
    vocab, hidden = projection.shape
    head_config = MedusaConfig(
        hidden_size=hidden, vocab_size=vocab, num_heads=count, num_layers=layers, own_lm_heads=True
    )
    _check_sizes(head_config, target, path)
    ours = {}
    for name, tensor in state.items():
        parts = name.removeprefix("medusa_head.").split(".", 2)  # head, layer (lm_head: `layers`), parameter
        if len(parts) < 3 or not (
            parts[0].isdigit() and parts[1].isdigit() and int(parts[0]) < count and int(parts[1]) <= layers
        ):
            raise HeadConfigError(f"{path}: unexpected weight {name!r} for {count} Medusa heads of {layers} layers")
        head, index, rest = parts
        ours[f"lm_heads.{head}.{rest}" if int(index) == layers else f"heads.{head}.{index}.{rest}"] = tensor
    return MedusaHeads(head_config), ours, None


def _medusa_files(heads, target):
    if not isinstance(heads, MedusaHeads):
        raise HeadConfigError(f"only Medusa heads can be written in Medusa's format, not {heads.config.kind} heads")
    config, state = heads.config, {}
    for name, tensor in heads.state_dict().items():
        if name == "draft_ids":  # dropped: the heads draft from every token (write_format's full_vocabulary)
            continue
        kind, head, rest = name.split(".", 2)
        state[f"{head}.{config.num_layers}.{rest}" if kind == "lm_heads" else f"{head}.{rest}"] = tensor
    if heads.lm_heads is None:  # ours project with the target's lm_head; Medusa's files hold a copy per head
        for head in range(config.num_heads):
            state[f"{head}.{config.num_layers}.weight"] = target.get_output_embeddings().weight
    out = {
        "medusa_num_heads": config.num_heads,
        "medusa_num_layers": config.num_layers,
        "base_model_name_or_path": target.config._name_or_path or None,
        # read by vLLM, which otherwise assumes 4096 / 32001 and drops the blocks' biases
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "medusa_fc_bias": True,
    }
    return out, state, "medusa_lm_head.pt"  # the name every version of FasterDecoding's Medusa reads


# --- checks and file access ------------------------------------------------------------------------------------


def _require_eagle(heads, architecture: str, fmt: str) -> EagleConfig:
    if not isinstance(heads, EagleHead) or heads.config.architecture != architecture:
        what = (
            f"an EAGLE head in the {heads.config.architecture} layout"
            if isinstance(heads, EagleHead)
            else f"{heads.config.kind} heads"
        )
        raise HeadConfigError(
            f"the {fmt} format holds EAGLE heads of the {architecture} layout, this is {what}: train one with "
            f"head.architecture: {architecture} (docs/interop.md)"
        )
    return heads.config


def _check_sizes(config, target, where: Path) -> None:
    if (config.hidden_size, config.vocab_size) != (target.config.hidden_size, target.config.vocab_size):
        raise HeadConfigError(
            f"{where} holds a head for hidden size {config.hidden_size} and vocab {config.vocab_size}, but the target "
            f"{getattr(target.config, '_name_or_path', '') or target.config.model_type!r} has "
            f"{target.config.hidden_size} and {target.config.vocab_size}: load the base model it was trained for"
        )


def _check_embedding(embedding: torch.Tensor | None, target, where: Path) -> None:
    """A head file's copy of the token embedding must be the target's (bfloat16 rounding allowed)."""
    if embedding is None:
        return
    mine = target.get_input_embeddings().weight.detach().float().cpu()
    theirs = embedding.float()
    if theirs.shape != mine.shape or not torch.allclose(theirs, mine, rtol=2**-7, atol=1e-6):
        raise HeadConfigError(
            f"{where}: the head's copy of the token embedding is not the target's: it was trained for another base "
            f"model than {getattr(target.config, '_name_or_path', '') or target.config.model_type!r}"
        )


def _read_json(file: Path) -> dict[str, Any]:
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise HeadConfigError(f"{file} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise HeadConfigError(f"{file} does not hold a JSON object")
    return config


def _read_weights(path: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The first of `names` that exists in `path`: safetensors, or a pickled state dict read without running code."""
    for name in names:
        file = path / name
        if not file.is_file():
            continue
        try:
            if name.endswith(".safetensors"):
                return load_file(file)
            state = torch.load(file, map_location="cpu", weights_only=True)
        except (SafetensorError, OSError, RuntimeError, EOFError) as error:
            raise HeadConfigError(f"{file} cannot be read ({error}): the file is corrupted or half-written") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise HeadConfigError(f"{file} does not hold a state dict of tensors")
        return state
    raise HeadConfigError(f"{path} has none of the weight files {list(names)}")
