"""Tiny random-weight models built from configs (no download), and the shared data path."""

from __future__ import annotations

import json
import os
from pathlib import Path

# pytest-xdist (`make test` runs `pytest -n auto`): each worker gets its share of the cores, set before torch starts
# its thread pool (and inherited by the processes tests start), or the workers' pools oversubscribe the cores
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # this process's
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

SHARED = Path(os.environ.get("SPECHEADS_SHARED", Path(__file__).resolve().parents[1].parent / "shared"))
EOS = 3


def tiny_model(
    family: str = "llama",
    *,
    vocab_size: int = 97,
    attn: str = "sdpa",
    seed: int = 0,
    init: float = 0.15,
    eos: int | None = EOS,
    layers: int = 2,
):
    """A 2-layer (by default) model whose logits are spread enough that float32 argmaxes are never near-ties."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=None,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False))
    elif family == "gpt2":  # learned absolute positions, fused qkv: a different family altogether
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=vocab_size,
                n_embd=64,
                n_layer=2,
                n_head=4,
                n_positions=256,
                initializer_range=init,
                bos_token_id=eos,
                eos_token_id=eos,
                attn_implementation=attn,
            )
        )
    else:
        raise ValueError(family)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos if eos is not None else 0
    return model.eval()


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    out = model.generate(
        prompt[None],
        attention_mask=torch.ones(1, prompt.shape[0], dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    return out[0, prompt.shape[0] :].tolist()


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not (SHARED / "data").is_dir():
        pytest.fail(f"shared data not found at {SHARED}; set SPECHEADS_SHARED to the folder holding data/")
    return SHARED


WORDS = (
    "the cat dog runs jumps over a lazy fox quick brown red blue green tree house car sun moon star sky sea big small "
    "old new"
).split()


@pytest.fixture(scope="session")
def tiny_chat(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer and a chat template, a small prompt file and the model's answers to
    it."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("tiny-chat")
    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        chat_template=template,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(vocab),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.3,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=2,
        )
    )
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    rng = random.Random(0)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(160):
            f.write(
                json.dumps(
                    {
                        "id": i,
                        "source": ["chat", "maths"][i % 2],
                        "prompt": " ".join(rng.choice(WORDS) for _ in range(8)),
                        "response": " ".join(rng.choice(WORDS) for _ in range(16)),
                    }
                )
                + "\n"
            )
    # its own answers to every prompt: the distilled corpus the training recipes read (root/distill/model-float32)
    from training.distill import DistillConfig, distill

    distill(
        DistillConfig(
            model=str(root / "model"),
            dtype="float32",
            prompts=str(root / "prompts.jsonl"),
            corpus_root=str(root / "distill"),
            answers=160,
            second_turn_share=0,
            max_new_tokens=32,
            workers=1,
            threads=1,
        )
    )
    return root


@pytest.fixture(autouse=True, scope="session")
def artefacts_in_a_temporary_folder(tmp_path_factory):
    """Calibrations and compiled packages of tiny random models (inference.store) have no place in the user's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECHEADS_CACHE", str(tmp_path_factory.mktemp("specheads-cache")))
        yield
