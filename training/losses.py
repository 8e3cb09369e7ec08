"""Objectives per head kind (Medusa, EAGLE, early exit), on features of the frozen target. Each returns (loss, metrics).

The vocabulary projection dominates the cost of a step on a small target (49152 x 576 per token, forward
and backward), so the cross-entropy terms use at most `max_tokens` randomly chosen loss positions per
batch, projected onto the heads' draft vocabulary (heads.vocab); the cheap feature regression covers
every position. Their cross-entropy against the target's distribution runs a block of rows at a time
(`soft_cross_entropy`), so that its float32 work stays in the CPU's cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from heads import DraftVocabulary, copy_embedding, copy_tokens


@torch.no_grad()
def target_features(
    target, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: tuple[int, ...], dtype=torch.float32
) -> dict[int, torch.Tensor]:
    """The frozen target's hidden states at `layers` (plus -1, the normalised last one), as `dtype`
    (None: the target's own)."""
    # the base model (no vocabulary projection over every position): its last hidden state is normalised
    out = target.base_model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return {layer: out.hidden_states[layer].to(dtype or out.hidden_states[layer].dtype) for layer in set(layers) | {-1}}


SOFT_CE_ROWS = 128  # rows of logits a block: 128 x 8,192 float32 is 4 MiB, a share of a CPU's last-level cache


class SoftCrossEntropy(torch.autograd.Function):
    """-(softmax(teacher) * log_softmax(logits)).sum(-1).mean() over rows [N, V], a block of rows at a time, its
    gradient (softmax(logits) - softmax(teacher)) / N written during the forward pass: each block is read once,
    where over whole [4,096 x 8,192] tensors each elementwise pass went through memory and the objective's softmax
    passes took about a quarter of an EAGLE corpus step on a 2-core CPU."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits)
        for start in range(0, logits.shape[0], SOFT_CE_ROWS):
            rows = slice(start, start + SOFT_CE_ROWS)
            log_q = torch.log_softmax(logits[rows].float(), dim=-1)
            p = torch.softmax(teacher[rows].float(), dim=-1)
            total -= (p * log_q).sum()
            grad[rows] = log_q.exp_().sub_(p)
        ctx.save_for_backward(grad)
        return total / max(logits.shape[0], 1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * (grad_output / max(grad.shape[0], 1)), None


def soft_cross_entropy(logits: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """The mean over rows of the cross-entropy of softmax(logits) against softmax(teacher) (no gradient to it)."""
    return SoftCrossEntropy.apply(logits, teacher.detach())


def sample_positions(mask: torch.Tensor, max_tokens: int) -> torch.Tensor:
    """(batch, position) indices of at most `max_tokens` positions where `mask` is set."""
    where = mask.nonzero()
    if where.shape[0] > max_tokens:
        where = where[torch.randperm(where.shape[0], device=where.device)[:max_tokens]]
    return where


def medusa_loss(
    heads,
    vocab: DraftVocabulary,
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    decay: float,
    max_tokens: int,
    soft_labels: bool = False,
    embed=None,
    num_heads: int | None = None,
):
    """Head k at position t predicts the token at t + k + 2 (the one after next, then further).

    With `soft_labels`, against the target's whole distribution for that token (its last hidden state one
    position earlier, through the draft vocabulary) rather than the token alone: the runners-up it teaches
    are what a tree's other ranks draft, and the heads' probabilities are what a dynamic tree ranks by.
    Sequential heads (`embed`, the target's input embeddings, and their `num_heads`) also read the text's tokens
    t + 1 .. t + k + 1, as drafting reads a path's tokens; past the end of a row they read its last token (no
    label there)."""
    where = sample_positions(loss_mask[:, 2:].bool(), max_tokens)  # positions head 0 has a label for
    # [N, K, H], through the (possibly wrapped) module, which reads whole texts (a prefix layer attends over them)
    if embed is None:
        features = heads(hidden, at=where)
    else:
        after = (where[:, 1:] + 1 + torch.arange(num_heads, device=where.device)).clamp(
            max=input_ids.shape[1] - 1
        )  # [N, K]
        features = heads(hidden, embed(input_ids[where[:, :1], after]).to(hidden.dtype), at=where)
    total, metrics = features.sum() * 0.0, {}
    for k in range(features.shape[1]):
        label_at = where[:, 1] + k + 2
        keep = label_at < input_ids.shape[1]
        keep[keep.clone()] = loss_mask[where[keep, 0], label_at[keep]].bool()
        if not keep.any():
            continue
        logits = vocab.logits(features[keep, k])
        labels = input_ids[where[keep, 0], label_at[keep]]
        drafted = vocab.from_target(labels)  # -100 (ignored) where the label is outside the draft vocabulary
        if soft_labels:
            with torch.no_grad():
                teacher = vocab.logits(hidden[where[keep, 0], label_at[keep] - 1])
            total = total + decay**k * soft_cross_entropy(logits, teacher)
        elif (drafted >= 0).any():
            total = total + decay**k * F.cross_entropy(logits.float(), drafted, ignore_index=-100)
        top = vocab.to_target(logits.topk(4, dim=-1).indices)
        metrics[f"top1/depth{k + 2}"] = (top[:, 0] == labels).float().mean().item()
        metrics[f"top4/depth{k + 2}"] = (top == labels[:, None]).any(-1).float().mean().item()
        for rank in range(1, 4):  # how often the r-th candidate is the one: what shapes a Medusa tree
            metrics[f"rank{rank + 1}/depth{k + 2}"] = (top[:, rank] == labels).float().mean().item()
    return total, metrics


def eagle_loss(
    head,
    layers: list[int],
    embed,
    lm_head,
    vocab: DraftVocabulary,
    features: dict[int, torch.Tensor],
    input_ids,
    loss_mask,
    *,
    regression_weight: float,
    ce_weight: float,
    noise: float,
    unroll: int,
    max_tokens: int,
    copy_input: bool = False,
    draft_vocab: DraftVocabulary | None = None,
):
    """EAGLE: from (feature of token t, token t+1) predict the feature of t+1 and the target's distribution
    after it. With unroll > 1, EAGLE-3's training-time test: step j feeds the head its own step-(j-1)
    predictions, attending to real features before the draft and its own earlier draft steps, exactly as
    drafting at depth j does. With `copy_input`, the head also reads what prompt lookup would copy after
    token t+1 (heads.eagle.copy_tokens); a draft path j deep has the same tokens as the text here, so every
    unroll step reads the same copies. `draft_vocab` projects the head's outputs when it has a projection of its
    own (eagle3: its norm and lm_head); `vocab`, the target's, gives the labels."""
    inputs = torch.cat([features[layer] for layer in layers], dim=-1)[:, :-1]  # fused inside the head
    if head.training and noise > 0:
        inputs = inputs + (torch.rand_like(inputs) - 0.5) * noise
    tokens = embed(input_ids[:, 1:]).float()  # the frozen target may run in bf16; the head trains in fp32
    copies = None
    if copy_input:
        found = torch.tensor(
            [copy_tokens(row) for row in input_ids.tolist()], dtype=torch.long, device=input_ids.device
        )
        copies = copy_embedding(embed, found).float()
    batch, length = tokens.shape[:2]
    positions = torch.arange(length, device=input_ids.device).expand(batch, -1)
    valid = loss_mask[:, 1:].bool()  # position t predicts what follows token t+1: a response token
    targets = features[-1][:, 1:]  # the target's last hidden state at t+1 gives its next distribution
    # a step-j prediction at position t stands for a draft j deep: it exists only where t >= j - 1. The
    # cross-entropy positions are drawn once, where the deepest step has a draft, so that the target's distribution
    # there is projected once a batch rather than once an unroll step (that projection took a sixth of a step)
    deepest = valid.clone()
    deepest[:, : unroll - 1] = False
    where = sample_positions(deepest, max_tokens)
    if where.shape[0]:
        chosen = targets[where[:, 0], where[:, 1]]
        with torch.no_grad():  # the target's distribution, restricted to the draft vocabulary
            target_logits = vocab.logits(chosen)
            # evaluation scores against the target's true next token; training makes do with the draft
            # vocabulary's view of it, which saves a full-vocabulary projection
            wanted = (
                lm_head(chosen.to(lm_head.weight.dtype)).argmax(-1)
                if not head.training
                else vocab.to_target(target_logits.argmax(-1))
            )
    total, metrics = 0.0, {}
    cache = DynamicCache() if unroll > 1 else None  # holds every step's keys for the later steps
    for step in range(1, unroll + 1):
        mask = None if step == 1 else unroll_mask(length, step, inputs.dtype, input_ids.device)
        predicted = head(inputs, tokens, copies, position_ids=positions, attention_mask=mask, cache=cache)
        if regression_weight:
            step_valid = valid.clone()
            step_valid[:, : step - 1] = False
            diff = F.smooth_l1_loss(predicted, targets, reduction="none").mean(-1)
            total = total + regression_weight * (diff * step_valid).sum() / step_valid.sum().clamp(min=1)
        if where.shape[0]:
            logits = (draft_vocab or vocab).logits(predicted[where[:, 0], where[:, 1]])
            if ce_weight:
                total = total + ce_weight * soft_cross_entropy(logits, target_logits)
            top = vocab.to_target(logits.topk(4, dim=-1).indices)
            metrics[f"top1/depth{step}"] = (top[:, 0] == wanted).float().mean().item()
            metrics[f"top4/depth{step}"] = (top == wanted[:, None]).any(-1).float().mean().item()
        # the next step sees this step's prediction for position t - 1 as its feature at t; position 0
        # has no draft path that deep (never in the loss), so any hidden-sized filler will do
        inputs = torch.cat([predicted[:, :1], predicted[:, :-1]], dim=1)
    return total, metrics


def early_exit_loss(
    head, vocab: DraftVocabulary, hidden: torch.Tensor | None, input_ids, attention_mask, loss_mask, max_tokens: int
):
    """The exit's distribution at position t against the target's own (its last hidden state `hidden` at t): soft
    labels, so the runners-up a tree's other branches draft are taught too. With `hidden` None, against the
    text's next token: on the target's own greedy answers (a corpus) that is its top choice, and a step needs no
    pass of the whole target."""
    exit_states = head(input_ids, attention_mask=attention_mask)  # through the adapted early layers
    where = sample_positions(loss_mask[:, 1:].bool(), max_tokens)  # position t predicts token t + 1, a response token
    logits = vocab.logits(exit_states[where[:, 0], where[:, 1]])
    wanted = input_ids[where[:, 0], where[:, 1] + 1]  # the text: what the target itself answered (a corpus)
    metrics = {}
    if hidden is None:
        drafted = vocab.from_target(wanted)  # -100 (ignored) where the token is outside the draft vocabulary
        loss = (
            F.cross_entropy(logits.float(), drafted, ignore_index=-100) if (drafted >= 0).any() else logits.sum() * 0.0
        )
    else:
        with torch.no_grad():
            teacher = vocab.logits(hidden[where[:, 0], where[:, 1]])
        loss = soft_cross_entropy(logits, teacher)
        metrics["agree/depth1"] = (
            (logits.argmax(-1) == teacher.argmax(-1)).float().mean().item()
        )  # with the target's top choice
    top = vocab.to_target(logits.topk(4, dim=-1).indices)
    metrics["top1/depth1"] = (top[:, 0] == wanted).float().mean().item()
    metrics["top4/depth1"] = (top == wanted[:, None]).any(-1).float().mean().item()
    return loss, metrics


def unroll_mask(length: int, step: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, T, step * T] for unroll step `step` over keys [step 1 | step 2 | ... | step].

    Query t of step j is a draft j deep whose first draft pair sits at t - j + 1: it sees step-1 (real)
    keys s <= t - j + 1 and, for each later step i <= j, the key at t - (j - i): its own draft path.
    """
    t = torch.arange(length, device=device)
    blocks = [t[None, :] <= (t[:, None] - step + 1)]
    for i in range(2, step + 1):
        blocks.append(t[None, :] == (t[:, None] - (step - i)))
    allowed = torch.cat(blocks, dim=1)
    allowed[:, 0] |= ~allowed.any(-1)  # early rows with nothing to see attend to the first key (never in the loss)
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)[
        None, None
    ]
