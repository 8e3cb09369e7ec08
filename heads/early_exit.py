"""Early-exit draft (LayerSkip-style): the target's own first `exit_layer` layers, its final norm and its output
projection draft the next token; an optional peft LoRA adapter on those layers teaches their exit to predict
what the last layer would.

The draft is a second instance of the target's own class, `exit_layer` layers deep, whose weights ARE the
target's tensors (shared storage, no copy; any Hugging Face causal LM whose layers are numbered the same when
it is built shallower). The adapter is injected into the draft's module objects only: the target's modules are
never touched, so verification runs the unmodified base model and its logits stay bit-identical. The adapter
is saved in peft's own format with keys named as in the full target (`layers_to_transform`), so
`peft.PeftModel.from_pretrained(target, path)` loads it too.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.lora import LoraLayer
from safetensors.torch import save_file
from torch import nn
from transformers.pytorch_utils import Conv1D

from .config import EarlyExitConfig, HeadConfigError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the wrapped model's parameter names


def shallow_copy(target, exit_layer: int) -> nn.Module:
    """The target's class built `exit_layer` layers deep on its own weights (shared tensors, no copy)."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = exit_layer
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (sliding, full, ...)
        config.layer_types = config.layer_types[:exit_layer]
    with torch.device("meta"):  # no memory: every tensor is replaced by the target's below
        draft = type(target)(config)
    weights = target.state_dict()
    foreign = [name for name in draft.state_dict() if name not in weights]
    if foreign:
        raise HeadConfigError(
            f"an early-exit draft of {type(target).__name__} built {exit_layer} layers deep has weights the target "
            f"lacks ({', '.join(foreign[:3])}): this architecture does not number its layers the same when shallower"
        )
    draft.load_state_dict({name: weights[name] for name in draft.state_dict()}, assign=True)
    buffers = dict(target.named_buffers())
    for name, buffer in list(draft.named_buffers()):  # rotary tables and other non-persistent buffers
        if buffer.is_meta:
            owner, _, attribute = name.rpartition(".")
            draft.get_submodule(owner).register_buffer(attribute, buffers[name], persistent=False)
    return draft.requires_grad_(False).eval()


def linear_names(layer: nn.Module) -> list[str]:
    """The names of a decoder layer's linear maps (LoRA's usual targets), e.g. q_proj ... down_proj."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, module in layer.named_modules() if isinstance(module, (nn.Linear, Conv1D))}
    )


def decoder_layers(model) -> nn.ModuleList:
    layers = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and re.fullmatch(r"(.*\.)?(layers|h|blocks)", name)
    ]
    if len(layers) != 1:
        raise HeadConfigError(
            f"cannot find the decoder layers of {type(model).__name__} (a ModuleList named layers, h or blocks)"
        )
    return layers[0]


class EarlyExitHead(nn.Module):
    """The trainable part is the adapter alone (registered here); the draft model that carries it is the
    target's own weights and is deliberately NOT a submodule, so `parameters()`, `state_dict()` and `.to()`
    see only the adapter, as they see only a head's own weights for Medusa and EAGLE."""

    def __init__(self, config: EarlyExitConfig, target):
        super().__init__()
        self.config = config
        total = target.config.num_hidden_layers
        if not 1 <= config.exit_layer < total:
            raise HeadConfigError(
                f"exit_layer must be from 1 to {total - 1} (the target has {total} layers), got {config.exit_layer}"
            )
        draft = shallow_copy(target, config.exit_layer)
        self.lora = None
        if config.lora_rank:
            targets = config.lora_targets or linear_names(decoder_layers(draft)[0])
            self.lora = LoraConfig(
                r=config.lora_rank,
                lora_alpha=config.lora_alpha,
                target_modules=targets,
                layers_to_transform=list(range(config.exit_layer)),
                lora_dropout=0.0,
            )
            try:
                inject_adapter_in_model(self.lora, draft)
            except ValueError as error:  # peft: no module matched
                raise HeadConfigError(
                    f"lora_targets {targets} name no module of {type(target).__name__}'s layers (they have "
                    f"{linear_names(decoder_layers(draft)[0])}): {error}"
                ) from None
            adapted = [m for m in draft.modules() if isinstance(m, LoraLayer)]
            self.adapter = nn.ModuleList(
                nn.ModuleList([m.lora_A, m.lora_B]) for m in adapted
            )  # LoRA's own weights only
        object.__setattr__(self, "draft", draft)  # outside the module tree: see the class docstring
        # the target's token ids the head drafts from (set by training), saved with the weights
        self.register_buffer("draft_ids", torch.arange(config.draft_vocab_size) if config.draft_vocab_size else None)

    def forward(self, input_ids: torch.Tensor, *, position_ids=None, attention_mask=None, cache=None) -> torch.Tensor:
        """The exit's hidden state after the target's final norm, [B, T, H]: the target's output projection
        (or the draft vocabulary's rows of it) turns it into draft logits."""
        out = self.draft.base_model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state

    def merged_draft(self) -> nn.Module:
        """The draft with its adapter folded into the weights of the linear maps it adapts: one product a map instead
        of three (a compiled pass holds its own copy of the weights anyway, inference.passes.ExitPass). The merged
        weights are new tensors; every other one is still the target's, and the target is left untouched."""
        if self.lora is None:
            return self.draft
        shared = {id(t): t for t in [*self.draft.parameters(), *self.draft.buffers()]}
        draft = copy.deepcopy(self.draft, memo=shared)  # new module objects over the same tensors
        for name, module in list(draft.named_modules()):
            base = module.get_base_layer() if isinstance(module, LoraLayer) else None
            if not isinstance(base, nn.Linear):  # e.g. GPT-2's Conv1D keeps its adapter unmerged
                continue
            merged = nn.Linear(base.in_features, base.out_features, bias=False, device="meta")
            delta = sum(module.get_delta_weight(adapter) for adapter in module.active_adapters)
            merged.weight = nn.Parameter(base.weight + delta, requires_grad=False)
            merged.bias = base.bias
            owner, _, attribute = name.rpartition(".")
            setattr(draft.get_submodule(owner), attribute, merged)
        return draft

    def runs_on(self, target) -> bool:
        """Whether the draft's layers are `target`'s own tensors (not another model's, nor a pre-cast copy)."""
        return self.draft.get_input_embeddings().weight.data_ptr() == target.get_input_embeddings().weight.data_ptr()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's weights named as peft names them on the full target."""
        return {PEFT_PREFIX + name: tensor for name, tensor in get_peft_model_state_dict(self.draft).items()}

    def save_adapter(self, directory: Path, dtype: torch.dtype) -> None:
        if self.lora is None:
            return
        state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in self.adapter_state().items()}
        save_file(state, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        self.lora.save_pretrained(str(directory))  # adapter_config.json

    def load_adapter(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        saved = json.loads((directory / ADAPTER_CONFIG).read_text())
        for key in ("r", "lora_alpha", "target_modules", "layers_to_transform"):
            ours = getattr(self.lora, key)
            ours = sorted(ours) if isinstance(ours, (set, list)) else ours
            theirs = sorted(saved.get(key) or []) if isinstance(saved.get(key), list) else saved.get(key)
            if ours != theirs:
                raise HeadConfigError(
                    f"{directory / ADAPTER_CONFIG}: {key} is {saved.get(key)!r} but config.json implies "
                    f"{getattr(self.lora, key)!r}"
                )
        expected = set(self.adapter_state())
        if set(state) != expected:
            missing, unknown = sorted(expected - set(state)), sorted(set(state) - expected)
            raise HeadConfigError(
                f"{directory / ADAPTER_WEIGHTS} does not match its config: missing {missing[:3]}, unexpected "
                f"{unknown[:3]}"
            )
        set_peft_model_state_dict(
            self.draft, {name.removeprefix(PEFT_PREFIX): tensor for name, tensor in state.items()}
        )
