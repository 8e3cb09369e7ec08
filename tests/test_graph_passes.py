"""The graph pass inductor runs on the compiled passes (inference.graph_passes), on small FX graphs of its own. That
the packages built with it decode exactly is tested in test_compiled.py."""

import torch

from inference.compiled import INDUCTOR_OPTIONS
from inference.graph_passes import LINEAR, ResidualAddsApart

aten, prims = torch.ops.aten, torch.ops.prims


def graph_with_add(residual_shape, residual_dtype=torch.bfloat16, from_product=True):
    """x -> (oneDNN product, or x * 2) -> + residual, with tensors as meta values as inductor's graphs carry them;
    returns (graph, the add's node)."""
    graph = torch.fx.Graph()
    x, weight, residual = (graph.placeholder(name) for name in ("x", "weight", "residual"))
    x.meta["val"] = torch.empty(1, 3, 8, dtype=torch.bfloat16)
    residual.meta["val"] = torch.empty(residual_shape, dtype=residual_dtype)
    if from_product:
        out = graph.call_function(LINEAR, (x, weight, None, "none", [], ""))
    else:
        out = graph.call_function(aten.mul.Tensor, (x, 2))
    out.meta["val"] = torch.empty(1, 3, 8, dtype=torch.bfloat16)
    add = graph.call_function(aten.add.Tensor, (residual, out))
    graph.output(add)
    return graph, add


def test_a_residual_add_after_a_product_becomes_prims_add():
    graph, add = graph_with_add((1, 3, 8))
    ResidualAddsApart()(graph)
    assert add.target is prims.add.default
    assert graph.find_nodes(op="call_function", target=aten.add.Tensor) == []


def test_adds_prims_add_cannot_take_are_left_alone():
    for shape, dtype, from_product in [
        ((8,), torch.bfloat16, True),  # broadcast: prims.add does not broadcast
        ((1, 3, 8), torch.float32, True),  # mixed dtypes: prims.add does not promote
        ((1, 3, 8), torch.bfloat16, False),  # no product feeds it: nothing to keep apart
    ]:
        graph, add = graph_with_add(shape, dtype, from_product)
        ResidualAddsApart()(graph)
        assert add.target is aten.add.Tensor, (shape, dtype, from_product)


def test_a_product_plus_a_constant_is_left_alone():
    graph = torch.fx.Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("weight")
    out = graph.call_function(LINEAR, (x, weight, None, "none", [], ""))
    out.meta["val"] = torch.empty(1, 3, 8)
    add = graph.call_function(aten.add.Tensor, (out, 1.0))
    graph.output(add)
    ResidualAddsApart()(graph)
    assert add.target is aten.add.Tensor


def test_the_pass_is_part_of_the_packages_key():
    """Its repr names its source's hash: a changed pass builds new packages instead of loading old ones."""
    first = INDUCTOR_OPTIONS["post_grad_custom_pre_pass"]
    assert repr(first) == repr(ResidualAddsApart()) == f"ResidualAddsApart({first.uuid()})"
    assert "0x" not in repr(first)  # no memory address
