"""An exported program cut in two between its repeated blocks, so that two processes compile the halves at once.

Why: compiling SmolLM2-135M's pass with AOTInductor took 82-87 s on one core of a 2-core EPYC, nearly all of it
inductor's Python work, which grows with the graph (about 2.7 s a decoder layer). Cut before its 16th decoder layer,
the two halves compiled side by side in 55 s, and the two packages ran a pass as fast as the whole one.

The cut goes between two blocks of the model's repeated modules (the decoder layers: the torch.export graph
records each node's module path, and the layers' paths end in their index), so only the hidden state and what
every layer reads (the rotary tables) cross it. Nothing is traced again: each half is the original graph's nodes,
copied, with its own signature, weights and the original symbolic sizes (each half computes the sizes it needs
from its own inputs). `HalvesRunner` runs the two compiled halves as the whole program's package would be run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

# an ExportedProgram's placeholders come in this order: weights, then buffers, then constants, then the inputs
_INPUT_ORDER = {InputKind.PARAMETER: 0, InputKind.BUFFER: 1, InputKind.CONSTANT_TENSOR: 2, InputKind.USER_INPUT: 3}


@dataclass
class ProgramHalves:
    """The two halves of a program and how they connect (`wiring`, plain JSON): the whole program's inputs (by
    name, in its flat order) feed both; the first half's first len(crossing) outputs feed the second; each of the
    whole's outputs is ("first" | "second", index) of a half's outputs; "cut" names the second half's first block."""

    first: ExportedProgram
    second: ExportedProgram
    wiring: dict


def _block(node: torch.fx.Node) -> str | None:
    """The outermost module path of `node` that ends in an index (model.layers.7, not model.layers.7.experts.2):
    one of the repeated blocks."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path.rsplit(".", 1)[-1].isdigit():
            return path
    return None


def _is_size(node: torch.fx.Node) -> bool:
    """A node computing a symbolic size (an integer), not a tensor."""
    return not isinstance(node.meta.get("val"), torch.Tensor)


def split_program(program: ExportedProgram, share: float = 0.5) -> ProgramHalves | None:
    """`program` cut before the repeated block at `share` of them (the first half gets that share of the blocks),
    or None where it has fewer than two blocks."""
    graph = program.graph
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    blocks = list(dict.fromkeys(b for b in map(_block, nodes) if b is not None))
    if len(blocks) < 2:
        return None
    start = blocks[min(len(blocks) - 1, max(1, round(len(blocks) * share)))]
    cut = next(i for i, n in enumerate(nodes) if _block(n) == start)
    sizes = {n for n in nodes if _is_size(n)}  # each half computes the sizes it needs
    in_first = {n for n in nodes[:cut] if n not in sizes}
    # outputs computed from the first half's values alone (the early layers' hidden states)
    # join it; what is computed from inputs alone and read only after the cut (the later layers' cache views)
    # joins the second: either way, fewer tensors cross
    for n in nodes[cut:]:
        tensors = [a for a in n.all_input_nodes if a not in sizes]
        if (
            n not in sizes
            and all(user.op == "output" for user in n.users)
            and any(a in in_first for a in tensors)
            and all(a in in_first or a.op == "placeholder" for a in tensors)
        ):
            in_first.add(n)
    for n in reversed(nodes[:cut]):
        if (
            n in in_first
            and all(user.op != "output" and user not in in_first for user in n.users)
            and all(a.op == "placeholder" or a in sizes for a in n.all_input_nodes)
        ):
            in_first.discard(n)
    first = [n for n in nodes if n in in_first]
    second = [n for n in nodes if n not in in_first and n not in sizes]
    in_second = set(second)
    crossing = [n for n in first if any(user in in_second for user in n.users)]
    final = list(graph.output_node().args[0])
    first_outputs = crossing + [n for n in final if n in in_first and n not in crossing]
    second_outputs = [n for n in final if n in in_second]
    if any(n not in in_first and n not in in_second for n in final):
        return None  # an output that is an input or a size: not a pass this cut serves
    first_program = _program(program, first, first_outputs, [], _sizes_for(first, nodes, sizes))
    second_program = _program(program, second, second_outputs, crossing, _sizes_for(second, nodes, sizes))
    wiring = {
        "cut": start,
        "inputs": [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT],
        "first": _user_inputs(first_program),
        "second": _user_inputs(second_program),
        "crossing": [n.name for n in crossing],
        "outputs": [
            ["first", first_outputs.index(n)] if n in in_first else ["second", second_outputs.index(n)] for n in final
        ],
        "out_spec": pytree.treespec_dumps(program.call_spec.out_spec),
    }
    return ProgramHalves(first_program, second_program, wiring)


def _sizes_for(body: list[torch.fx.Node], nodes: list[torch.fx.Node], sizes: set) -> list[torch.fx.Node]:
    """The size nodes `body` reads, with the size nodes those read, in graph order."""
    needed, stack = set(), [a for n in body for a in n.all_input_nodes if a in sizes]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(a for a in n.all_input_nodes if a in sizes)
    return [n for n in nodes if n in needed]


def _user_inputs(program: ExportedProgram) -> list[str]:
    return [spec.arg.name for spec in program.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]


def _program(
    program: ExportedProgram,
    body: list[torch.fx.Node],
    outputs: list[torch.fx.Node],
    crossing: list[torch.fx.Node],
    sizes: list[torch.fx.Node],
) -> ExportedProgram:
    """An ExportedProgram of `program`'s nodes `sizes` then `body`, returning `outputs`: it takes the original
    placeholders these read (weights, constants, inputs) and, as inputs after those, the `crossing` values."""
    specs = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
    read = {a for n in [*sizes, *body] for a in n.all_input_nodes}
    placeholders = sorted(
        (n for n in program.graph.nodes if n.op == "placeholder" and n in read),
        key=lambda n: _INPUT_ORDER[specs[n.name].kind],
    )
    graph, env, input_specs, examples = torch.fx.Graph(), {}, [], []
    for n in placeholders:
        env[n] = graph.node_copy(n)
        input_specs.append(specs[n.name])
        if specs[n.name].kind == InputKind.USER_INPUT:
            examples.append(_example(n))
    for n in crossing:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
        input_specs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(n.name), None))
        examples.append(_example(n))
    for n in [*sizes, *body]:
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    output_specs = [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(env[n].name), None) for n in outputs]
    _, in_spec = pytree.tree_flatten((tuple(examples), {}))
    _, out_spec = pytree.tree_flatten(tuple(outputs))
    targets = {spec.target for spec in input_specs if spec.target is not None}
    return ExportedProgram(
        root=torch.fx.GraphModule(program.graph_module, graph),
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs, output_specs),
        state_dict={k: v for k, v in program.state_dict.items() if k in targets},
        range_constraints=program.range_constraints,
        module_call_graph=[ModuleCallEntry("", ModuleCallSignature([], [], in_spec, out_spec))],
        example_inputs=(tuple(examples), {}),
        constants={k: v for k, v in program.constants.items() if k in targets},
        verifiers=program.verifiers,  # the original's dialect: its passes write into their cache stores in place
    )


def _example(node: torch.fx.Node) -> torch.Tensor:
    """A tensor shaped like the example the program was exported with at `node` (zeros: only shapes matter)."""
    value = node.meta["val"]
    shape = [int(s.node.hint) if isinstance(s, torch.SymInt) else s for s in value.shape]
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


class HalvesRunner:
    """Runs two compiled halves (callables over their flat inputs) like the whole program's package: the whole's
    arguments in, its outputs out."""

    def __init__(self, first, second, wiring: dict):
        self.first, self.second, self.wiring = first, second, wiring
        self.out_spec = pytree.treespec_loads(wiring["out_spec"])

    def __call__(self, *args):
        named = dict(zip(self.wiring["inputs"], pytree.tree_leaves(args), strict=True))
        first = self.first(*[named[name] for name in self.wiring["first"]])
        named.update(zip(self.wiring["crossing"], first))
        second = self.second(*[named[name] for name in self.wiring["second"]])
        halves = {"first": first, "second": second}
        flat = [halves[half][index] for half, index in self.wiring["outputs"]]
        return pytree.tree_unflatten(flat, self.out_spec)
