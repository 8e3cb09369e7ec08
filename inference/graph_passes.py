"""A graph pass given to inductor when it compiles the decoding passes (inference.compiled's INDUCTOR_OPTIONS), through
its extension point for them (`post_grad_custom_pre_pass`).

ResidualAddsApart: inductor fuses a residual add into the oneDNN product before it (`_linear_pointwise.binary`, the
add as a post-op). With a few tokens that fused call costs more than the product alone, while the add costs nothing
inside the elementwise kernel that follows (the next layer's RMSNorm), so the adds are kept apart (measured in
docs/experiments.md, row X7). In bfloat16 they then round as in the eager model: the product's output is rounded
before the add.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

# a frozen weight's product, as freezing packs it for oneDNN (a torch built without oneDNN has no such op)
LINEAR = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


class ResidualAddsApart(CustomGraphPass):
    """Turns `aten.add(a, b)` of two tensors of one shape and dtype, one of them a oneDNN product's output, into
    `prims.add` (the same sum, lowered the same way), which inductor's post-op fusion does not match."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        for node in graph.find_nodes(op="call_function", target=torch.ops.aten.add.Tensor):
            two_tensors = len(node.args) == 2 and not node.kwargs and _same_tensor_kind(*map(_value, node.args))
            if two_tensors and any(_is_product(arg) for arg in node.args):
                node.target = torch.ops.prims.add.default

    def uuid(self) -> str:
        return get_hash_for_files((__file__,)).hex()

    def __repr__(self) -> str:  # part of the compiled packages' key (inference.store.artefact_key)
        return f"{type(self).__name__}({self.uuid()})"


def _is_product(arg) -> bool:
    return LINEAR is not None and isinstance(arg, torch.fx.Node) and arg.op == "call_function" and arg.target is LINEAR


def _value(arg):
    """What a node computes, as inductor's graphs record it (None for a constant argument)."""
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def _same_tensor_kind(left, right) -> bool:
    """Two tensors prims.add takes as they are: one shape, one dtype (it neither broadcasts nor promotes)."""
    return (
        isinstance(left, torch.Tensor)
        and isinstance(right, torch.Tensor)
        and left.shape == right.shape
        and left.dtype == right.dtype
    )
