"""Passes over the decoding passes' graphs.

packed_products: on the exported program, before inductor sees it, each bfloat16 linear layer over the module's own
weights runs through our packed kernel (inference.kernels: `specheads::packed_linear` over
`specheads::pack_linear_weight(weight)`); layers reading the same input (queries, keys and values; gate and up) as
one product over their weights concatenated, as inductor's `cpp.enable_concat_linear` does for oneDNN. The packing
depends on the weights alone, so inductor's `freezing` folds it into the package's constants.

ResidualAddsApart: given to inductor (inference.compiled's INDUCTOR_OPTIONS) through its extension point for graph
passes (`post_grad_custom_pre_pass`).

ResidualAddsApart: inductor fuses a residual add into the oneDNN product before it (`_linear_pointwise.binary`, the
add as a post-op). With a few tokens that fused call costs more than the product alone, while the add costs nothing
inside the elementwise kernel that follows (the next layer's RMSNorm), so the adds are kept apart (measured in
docs/experiments.md, row X7). In bfloat16 they then round as in the eager model: the product's output is rounded
before the add.
"""

from __future__ import annotations

import operator

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import kernels

# a frozen weight's product, as freezing packs it for oneDNN (a torch built without oneDNN has no such op)
LINEAR = torch.ops.mkldnn._linear_pointwise.default if torch.backends.mkldnn.is_available() else None


def packed_products(program: torch.export.ExportedProgram, int8: bool = False) -> int:
    """Route `program`'s bfloat16 linear layers over its parameters through the packed kernel, in place (the ops
    must be registered: inference.kernels.load), their weights quantized to int8 where `int8` (a draft's: `specheads::
    quantize_int8`, folded into the constants like the packing); returns how many products it made. A layer
    whose weights do not fit the kernel (kernels.fits_packed) stays as it is."""
    graph = program.graph_module.graph
    parameters = set(program.graph_signature.inputs_to_parameters)
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}  # each input's layers, in the graph's order
    for node in graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default):
        weight = node.args[1]
        if weight.op == "placeholder" and weight.name in parameters and _value(weight).dtype == torch.bfloat16:
            readers.setdefault(node.args[0], []).append(node)
    products = 0
    for layers in readers.values():
        biased = [_bias(layer) is not None for layer in layers]
        groups = [layers] if all(biased) or not any(biased) else [[layer] for layer in layers]
        for group in groups:
            products += _packed_product(graph, group, int8)
    program.graph_module.recompile()
    return products


def _packed_product(graph: torch.fx.Graph, layers: list[torch.fx.Node], int8: bool) -> int:
    """One packed product for `layers` (of one input, all with a bias or none), each layer's output a slice of it;
    0 where their weights do not fit the kernel."""
    ops = torch.ops.specheads
    weights = [layer.args[1] for layer in layers]
    outputs = [_value(weight).shape[0] for weight in weights]
    inputs = _value(weights[0]).shape[1]
    if not kernels.fits_packed(sum(outputs), inputs):
        return 0
    first, biases = layers[0], [_bias(layer) for layer in layers]
    with graph.inserting_before(first):
        weight = _call(graph, torch.ops.aten.cat.default, weights, 0) if len(layers) > 1 else weights[0]
        bias = None
        if biases[0] is not None:
            bias = _call(graph, torch.ops.aten.cat.default, biases, 0) if len(layers) > 1 else biases[0]
        scales = None
        if int8:
            quantized = _call(graph, ops.quantize_int8.default, weight)
            weight, scales = (_call(graph, operator.getitem, quantized, index) for index in (0, 1))
        packed = _call(graph, ops.pack_linear_weight.default, weight)
        product = _call(graph, ops.packed_linear.default, first.args[0], packed, bias, scales)
        start = 0
        for layer, width in zip(layers, outputs):
            out = (
                product
                if len(layers) == 1
                else _call(graph, torch.ops.aten.slice.Tensor, product, -1, start, start + width)
            )
            start += width
            layer.replace_all_uses_with(out)
            graph.erase_node(layer)
    return 1


def _bias(layer: torch.fx.Node) -> torch.fx.Node | None:
    return layer.args[2] if len(layer.args) > 2 else layer.kwargs.get("bias")


def _call(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    """A new node calling `target` on `args`, its value (meta["val"]) computed from theirs as tracing would."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*torch.fx.node.map_arg(args, _value), **kwargs)
    return node


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
