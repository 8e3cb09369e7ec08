"""How likely the target is to accept a draft, from the drafter's own probability of it.

A dynamic tree keeps the drafts with the highest path probability (EAGLE-2), so the head's probabilities decide
which of the few hundred drafts grown each step are verified. Measured on the shipped EAGLE head (held-out corpus
prompts, fixed tree 10/8/15, float32), they are off in the middle: drafts the head gave 0.48 were accepted 0.62 of
the time, drafts it gave 0.72 were accepted 0.83, at every depth alike, while 0.05 meant 0.05. A shallow sibling
and a deep chain are then weighed wrongly against each other. A logistic map of the head's probability p,

    P(accepted | the parent accepted) = sigmoid(w0 + w1 * log p + w2 * log(1 - p)),    w1 > 0 >= w2,

fitted on held-out prompts (scripts/fit_acceptance_map.py), corrects it; a node's path score becomes the sum of its
ancestors' mapped log-probabilities. The map increases with p, so each node keeps its own likeliest children,
and a child never scores above its parent (the selection stays ancestor-closed). Only which drafts are verified
changes, never what the target accepts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .tree import Tree, on_committed_path

LOG_ONE_MINUS_FLOOR = math.log(1e-6)  # log(1 - p) for p within 1e-6 of 1: a draft the head is sure of


def acceptance_log_probs(log_probs: torch.Tensor, weights: list[float] | tuple[float, ...]) -> torch.Tensor:
    """log P(accepted | parent accepted) for drafts the head gives log-probabilities `log_probs` (any shape).
    -inf stays -inf (an impossible draft); NaN stays NaN."""
    w0, w1, w2 = weights
    log_rest = torch.log1p(-log_probs.exp().clamp(max=1.0)).clamp(min=LOG_ONE_MINUS_FLOOR)
    return F.logsigmoid(w0 + w1 * log_probs + w2 * log_rest)


def draft_outcomes(
    tree: Tree, scores: torch.Tensor, start: int, text: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's drafts against what the target went on to write: `tree` holds the grown nodes (root first) and
    `scores` [N] their path log-probabilities by the head itself; they were grown after a text whose next token sits
    at `start` of `text` (the whole decoded sequence, 1-D). Returns each node's log-probability given its parent (the
    root's 0) and whether the target wrote its path (the root: True), both [N]."""
    local = scores.double() - torch.where(tree.parents >= 0, scores.double()[tree.parents.clamp(min=0)], 0.0)
    return local, on_committed_path(tree, text[start:])


def path_scores(tree: Tree, local: torch.Tensor) -> torch.Tensor:
    """Each node's path score: the sum of `local` [N] over the node and its ancestors."""
    return tree.ancestors.to(local.dtype) @ local


def fit_weights(log_probs: torch.Tensor, accepted: torch.Tensor, steps: int = 200) -> list[float]:
    """The map's weights by maximum likelihood (logistic regression on log p and log(1 - p)), with w1 > 0 >= w2
    kept by construction (w1 = softplus(u1), w2 = -softplus(u2))."""
    if log_probs.numel() == 0 or bool(accepted.all()) or not bool(accepted.any()):
        raise ValueError(
            "fitting the acceptance map needs drafts both accepted and rejected; got "
            f"{int(accepted.sum())} accepted of {accepted.numel()}: decode more prompts"
        )
    finite = log_probs > float("-inf")
    log_p = log_probs[finite].double().clamp(max=0.0)
    target = accepted[finite].double()
    log_rest = torch.log1p(-log_p.exp()).clamp(min=LOG_ONE_MINUS_FLOOR)

    def inverse_softplus(value: float) -> float:
        return math.log(math.expm1(value))

    # near the identity (0, 1, 0); w2 starts a little below 0, where softplus still has a gradient
    start = [0.0, inverse_softplus(1.0), inverse_softplus(0.1)]
    params = torch.tensor(start, dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([params], max_iter=steps, line_search_fn="strong_wolfe")

    def loss():
        optimizer.zero_grad()
        w0, w1, w2 = params[0], F.softplus(params[1]), -F.softplus(params[2])
        value = F.binary_cross_entropy_with_logits(w0 + w1 * log_p + w2 * log_rest, target)
        value.backward()
        return value

    optimizer.step(loss)
    with torch.no_grad():
        # a head whose probabilities tell nothing fits w1 near 0: kept above it, so the map still ranks its drafts
        return [float(params[0]), max(float(F.softplus(params[1])), 1e-6), float(-F.softplus(params[2]))]
