"""inference.kernels: the attention kernel for a few query rows over a long bfloat16 cache computes what ATen's
scaled_dot_product_attention computes, for the shapes it takes and for those it hands to ATen; the packed linear
layers compute what F.linear computes (over int8 weights, what it computes over the weights they stand for), and a
program whose layers graph_passes.packed_products routes through them computes what it did before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from conftest import tiny_model
from heads import DraftVocabulary, EagleConfig, EagleHead, attention
from inference import kernels, packed
from inference.compiled_heads import CompiledHead
from inference.context_vocab import ContextVocabulary
from inference.graph_passes import packed_products
from inference.packed import pack_weight
from inference.passes import EXAMPLE_CAPACITY, export_decoding_pass, export_head_pass

pytestmark = pytest.mark.skipif(
    not kernels.wanted(torch.device("cpu"), torch.bfloat16), reason="the kernels need AVX512-BF16"
)


@pytest.fixture(scope="module")
def kernel():
    assert kernels.load(verbose=False), "the kernels did not build"
    yield torch.ops.specheads.decode_attention.default
    attention.use_decode_kernel(None)  # the tests after these run as they would alone


def folded_inputs(rows, kv_heads, groups, queries, keys, dim, mask_rows=None, seed=0):
    """A folded query [rows, kv_heads, groups * queries, dim], keys and values that are views into longer stores,
    and an additive mask [mask_rows, 1, queries, keys] hiding a random third of the keys (the first always seen)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(rows, kv_heads, groups * queries, dim, generator=generator).bfloat16()
    key, value = (torch.randn(rows, kv_heads, keys + 7, dim, generator=generator).bfloat16()[:, :, :keys] for _ in "kv")
    hidden = torch.rand(mask_rows or rows, 1, queries, keys, generator=generator) < 0.3
    hidden[..., 0] = False
    mask = torch.zeros(hidden.shape).masked_fill(hidden, torch.finfo(torch.bfloat16).min).bfloat16()
    return query, key, value, mask


@pytest.mark.parametrize(
    "rows, groups, queries, keys, dim, mask_rows",
    [
        (16, 3, 1, 513, 64, None),  # a batch step of one token a row: keys one at a time
        (1, 3, 1, 5000, 64, None),  # one row over a long cache: the keys split into chunks across threads
        (4, 3, 4, 300, 64, 1),  # small trees, one mask for every row: 16 keys at once, then the last 12 alone
        (3, 2, 8, 70, 128, None),  # 16 rows a head, a larger head
        (2, 3, 16, 90, 64, None),  # 48 rows a head
        (1, 3, 21, 700, 64, None),  # 63 rows a head, split into chunks
        (2, 3, 22, 50, 64, None),  # 66 rows a head: handed to ATen
        (2, 3, 2, 40, 32, None),  # a head size it does not take: handed to ATen
    ],
)
def test_the_kernel_computes_what_sdpa_computes(kernel, rows, groups, queries, keys, dim, mask_rows):
    query, key, value, mask = folded_inputs(rows, 3, groups, queries, keys, dim, mask_rows)
    ours = kernel(query, key, value, mask, 0.3)
    repeated = mask.expand(rows, -1, -1, -1).repeat(1, 1, groups, 1)
    exact = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), repeated.double(), scale=0.3)
    aten = F.scaled_dot_product_attention(query, key, value, repeated, scale=0.3)
    assert ours.shape == query.shape and ours.dtype == torch.bfloat16 and ours.is_contiguous()
    # as near the exact result as ATen's own bfloat16 kernel: within a rounding of the output
    assert (ours.double() - exact).abs().max() <= (aten.double() - exact).abs().max() * 1.5 + 1e-3


def test_a_chunk_whose_keys_are_all_masked_adds_nothing(kernel):
    query, key, value, mask = folded_inputs(1, 3, 3, 1, 2048, 64)
    mask[..., 1:1500] = float("-inf")  # whole chunks hidden, with -inf
    ours = kernel(query, key, value, mask, 0.125)
    exact = F.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), mask.double().repeat(1, 1, 3, 1), scale=0.125
    )
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours.double(), exact, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("masked", [torch.finfo(torch.bfloat16).min, float("-inf")])
def test_rows_of_different_lengths_read_their_own_keys_and_the_new_ones(kernel, masked):
    """A batch step: row b sees its first lengths[b] keys and the step's 3 new entries at the cache's end, nothing
    between (the stretch the kernel skips), each new entry itself and those before it (9 rows a head: the kernel's
    own, with AMX tiles too)."""
    rows, keys, new = 4, 900, 3
    query, key, value, _ = folded_inputs(rows, 3, 3, new, keys, 64)
    lengths = [895, 40, 333, 17]  # not multiples of 16: the ranges' edges fall inside blocks
    seen = torch.zeros(rows, 1, new, keys, dtype=torch.bool)
    for row, length in enumerate(lengths):
        seen[row, :, :, :length] = True
        seen[row, 0, :, keys - new :] = torch.ones(new, new, dtype=torch.bool).tril()
    mask = torch.zeros(seen.shape).masked_fill(~seen, masked).bfloat16()
    ours = kernel(query, key, value, mask, 0.125)
    repeated = mask.repeat(1, 1, 3, 1)
    exact = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), repeated.double(), scale=0.125)
    aten = F.scaled_dot_product_attention(query, key, value, repeated, scale=0.125)
    assert (ours.double() - exact).abs().max() <= (aten.double() - exact).abs().max() * 1.5 + 1e-3
    # and the keys it skips are ones it must skip: seen, they would change the answer
    seen[1, :, :, :keys] = True
    wider = torch.zeros(seen.shape).masked_fill(~seen, masked).bfloat16()
    assert (kernel(query, key, value, wider, 0.125)[1].double() - exact[1]).abs().max() > 0.05


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="a CPU with AMX tiles")
def test_with_amx_tiles_many_rows_over_many_keys_go_to_aten(kernel):
    """ATen's flash attention runs its products on the tiles: from 12 rows a head and 32,768 rows x keys it is the
    faster one."""
    for groups, queries, keys, through_aten in ((3, 4, 2800, True), (3, 6, 300, False), (3, 3, 4000, False)):
        query, key, value, mask = folded_inputs(1, 3, groups, queries, keys, 64)
        aten = F.scaled_dot_product_attention(query, key, value, mask.repeat(1, 1, groups, 1), scale=0.3)
        assert torch.equal(kernel(query, key, value, mask, 0.3), aten) == through_aten


def test_a_wrong_mask_row_would_be_caught(kernel):
    """The comparison above can fail: row g of a head reads mask row g % queries."""
    query, key, value, mask = folded_inputs(2, 3, 3, 4, 200, 64)
    ours = kernel(query, key, value, mask.flip(2), 0.3)
    exact = F.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), mask.double().repeat(1, 1, 3, 1), scale=0.3
    )
    assert (ours.double() - exact).abs().max() > 0.05


def test_grouped_attention_through_the_kernel_matches_transformers_sdpa(kernel, monkeypatch):
    monkeypatch.setattr(attention, "_decode_kernel", kernel)
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(4, 9, 2, 64, generator=generator).bfloat16()
    key, value = (torch.randn(4, 3, 300, 64, generator=generator).bfloat16() for _ in "kv")
    mask = torch.zeros(4, 1, 2, 300).bfloat16()
    mask[1, ..., 100:] = torch.finfo(torch.bfloat16).min
    module = type("Attention", (), {"num_key_value_groups": 3})()
    ours, _ = attention.grouped_sdpa_attention(module, query, key, value, mask, scaling=0.125)
    reference, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.125)
    assert ours.shape == reference.shape == (4, 2, 9, 64)
    torch.testing.assert_close(ours.float(), reference.float(), atol=2e-2, rtol=2e-2)


def test_attention_that_needs_gradients_goes_around_the_kernel(kernel, monkeypatch):
    """The kernel has no backward: with it in use, a head in training still gets SDPA's gradients."""
    monkeypatch.setattr(attention, "_decode_kernel", kernel)
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(2, 9, 3, 64, generator=generator).bfloat16().requires_grad_()
    key, value = (torch.randn(2, 3, 40, 64, generator=generator).bfloat16() for _ in "kv")
    mask = torch.zeros(2, 1, 3, 40).bfloat16()
    module = type("Attention", (), {"num_key_value_groups": 3})()
    ours, _ = attention.grouped_sdpa_attention(module, query, key, value, mask, scaling=0.125)
    ours.float().square().sum().backward()
    reference_query = query.detach().clone().requires_grad_()
    reference, _ = sdpa_attention_forward(module, reference_query, key, value, mask, scaling=0.125)
    reference.float().square().sum().backward()
    torch.testing.assert_close(query.grad.float(), reference_query.grad.float(), atol=2e-2, rtol=2e-2)


def test_a_mask_of_the_wrong_length_is_refused_as_sdpa_refuses_it(kernel):
    query, key, value, mask = folded_inputs(2, 3, 3, 1, 64, 64)
    with pytest.raises(RuntimeError):
        kernel(query, key, value, mask[..., :40], 0.125)


def test_float32_attention_goes_around_the_kernel(monkeypatch):
    """A float32 pass never holds the op: a package traced with it would need the kernel loaded to run."""

    def refuse(*args):
        raise AssertionError("float32 attention reached the kernel")

    monkeypatch.setattr(attention, "_decode_kernel", refuse)
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(2, 9, 1, 64, generator=generator)
    key, value = (torch.randn(2, 3, 20, 64, generator=generator) for _ in "kv")
    module = type("Attention", (), {"num_key_value_groups": 3})()
    ours, _ = attention.grouped_sdpa_attention(module, query, key, value, torch.zeros(2, 1, 1, 20), scaling=0.125)
    reference, _ = sdpa_attention_forward(module, query, key, value, torch.zeros(2, 1, 1, 20), scaling=0.125)
    torch.testing.assert_close(ours, reference)


@pytest.mark.parametrize(
    "shape, outputs, inputs, bias",
    [
        ((1,), 64, 32, False),  # a plain step's one row
        ((3,), 192, 96, True),  # one tile of three rows
        ((2, 5), 128, 64, False),  # [rows, tokens]: a tree pass
        ((7,), 64, 64, False),  # tiles of four and three rows
        ((13,), 320, 48, True),  # tiles of five, four and four
        ((10,), 128, 200, True),  # two tiles taking 100 input pairs in chunks of 32, the last one short
        ((30,), 64, 70, False),  # five tiles: each streams the whole group in turn
    ],
)
@pytest.mark.parametrize("int8", [False, True])
def test_packed_linear_computes_what_linear_computes(kernel, shape, outputs, inputs, bias, int8):
    generator = torch.Generator().manual_seed(outputs + inputs)
    weight = torch.randn(outputs, inputs, generator=generator).bfloat16()
    x = torch.randn(*shape, inputs, generator=generator).bfloat16()
    b = torch.randn(outputs, generator=generator).bfloat16() if bias else None
    ours = pack_weight(weight, int8)(x, b)
    exact_weight = weight.double()
    if int8:  # what it computes: the product over the weight its int8 values and scales stand for
        values, scales = torch.ops.specheads.quantize_int8(weight)
        exact_weight = values.double() * scales.double()[:, None]
        # each output's largest weight maps to +-127, every weight within half a step (and rounding) of its value
        assert values.dtype == torch.int8 and (values.abs().amax(1) == 127).all()
        assert ((exact_weight - weight.double()).abs() <= scales.double()[:, None] / 2 * (1 + 1e-4)).all()
        weight = exact_weight.bfloat16()
    exact = F.linear(x.double(), exact_weight, None if b is None else b.double())
    eager = F.linear(x, weight, b)
    assert ours.shape == eager.shape and ours.dtype == torch.bfloat16
    # as near the exact result as oneDNN's bfloat16 product: within a rounding of the output
    assert (ours.double() - exact).abs().max() <= (eager.double() - exact).abs().max() * 1.5 + 1e-3


def test_a_wrongly_packed_weight_would_be_caught(kernel):
    """The comparison above can fail: a weight packed with its columns one group out of place."""
    generator = torch.Generator().manual_seed(5)
    weight, x = torch.randn(128, 32, generator=generator).bfloat16(), torch.randn(2, 32, generator=generator).bfloat16()
    ops = torch.ops.specheads
    ours = ops.packed_linear(x, ops.pack_linear_weight(weight.roll(64, 0)), None)
    assert (ours.double() - F.linear(x.double(), weight.double())).abs().max() > 0.5


def test_a_weight_or_input_the_kernel_cannot_take_is_refused_saying_why(kernel):
    ops = torch.ops.specheads
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.pack_linear_weight(torch.zeros(100, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="32 features was expected"):
        ops.packed_linear(
            torch.zeros(2, 30, dtype=torch.bfloat16), ops.pack_linear_weight(torch.zeros(64, 32).bfloat16()), None
        )
    int8 = ops.pack_linear_weight(torch.zeros(64, 32, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="int8 weight takes its outputs' scales"):
        ops.packed_linear(torch.zeros(2, 32, dtype=torch.bfloat16), int8, None)
    with pytest.raises(RuntimeError, match="64 contiguous float32"):
        ops.packed_linear(torch.zeros(2, 32, dtype=torch.bfloat16), int8, None, torch.ones(64, dtype=torch.bfloat16))


@pytest.mark.parametrize("int8", [False, True])
def test_a_program_through_packed_products_computes_what_it_did(kernel, monkeypatch, int8):
    """A bfloat16 Llama's exported pass: queries, keys and values one product, gate and up one, the output and down
    projections one each, a layer, and the logits' projection: the same logits and hidden states as before (int8
    weights, as a draft's are packed, within their rounding)."""
    model = tiny_model("llama", vocab_size=128).bfloat16()
    if int8:  # weights that int8 values and scales hold exactly (every row's largest 127 / 1024): the same program
        with torch.no_grad():
            for layer in model.modules():
                if isinstance(layer, torch.nn.Linear):
                    values = torch.randint(-127, 128, layer.weight.shape, generator=torch.Generator().manual_seed(7))
                    values[:, 0] = 127
                    layer.weight.copy_(values / 1024)
    monkeypatch.setattr(kernels, "packs_products", lambda device, dtype: False)  # exported as it is, then routed
    program = export_decoding_pass(model)
    rows, tokens, cached = 2, 3, 4
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(128, (rows, tokens), generator=generator)
    positions = (torch.arange(tokens) + cached).expand(rows, -1).contiguous()
    mask = torch.zeros(rows, 1, tokens, cached + tokens, dtype=torch.bfloat16)
    mask[..., cached:] = torch.full((tokens, tokens), torch.finfo(torch.bfloat16).min).triu(1)
    stores = [torch.randn(rows, 2, EXAMPLE_CAPACITY, 16, generator=generator).bfloat16() for _ in range(4)]

    def run():
        keys, values = [s.clone() for s in stores[:2]], [s.clone() for s in stores[2:]]
        return program.module()(ids, positions, mask, torch.arange(tokens), keys, values)

    before = run()
    assert packed_products(program, int8=int8) == 2 * 4 + 1
    graph = program.graph_module.graph
    assert not graph.find_nodes(op="call_function", target=torch.ops.aten.linear.default)
    packs = graph.find_nodes(op="call_function", target=torch.ops.specheads.pack_linear_weight.default)
    assert {node.meta["val"].dtype for node in packs} == {torch.int8 if int8 else torch.bfloat16}
    after = run()
    for old, new in zip([before[0], *before[1]], [after[0], *after[1]], strict=True):
        torch.testing.assert_close(new.float(), old.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("int8", [False, True])
def test_a_context_vocabulary_drafts_through_one_packed_product(kernel, monkeypatch, int8):
    monkeypatch.setattr(kernels, "packs_products", lambda device, dtype: True)  # whatever this CPU would choose
    monkeypatch.setattr(packed, "DRAFT_WEIGHTS_INT8", int8)
    generator = torch.Generator().manual_seed(0)
    projection = torch.nn.Linear(32, 500, bias=True).bfloat16()
    context = ContextVocabulary(DraftVocabulary(projection, torch.arange(0, 500, 7)))  # 72 base rows
    text = torch.randperm(500, generator=generator)[:300]
    for end in (5, 6, 200, 300):  # past the first room: the buffer grows and is packed again
        vocab = context.read_texts([text[:end]])
        assert vocab.projection is not None and vocab.weight.shape[0] % 64 == 0
        features = torch.randn(3, 32, generator=generator).bfloat16()
        eager = F.linear(features, vocab.weight, vocab.bias)
        # the rows written into the packed buffer as they joined: as if the whole buffer were packed now
        assert torch.equal(vocab.logits(features), pack_weight(vocab.weight, int8)(features, vocab.bias))
        assert (vocab.logits(features) - eager).abs().max() <= 0.05 * eager.abs().max()
    # kept with the base for the next sequence, or copied while this one drafts: packed as the weight is
    for fresh in (context, ContextVocabulary(context.base)):
        fresh.reset()
        now = pack_weight(fresh.weight, int8)
        assert fresh.count == 0 and torch.equal(fresh.packed.packed, now.packed)
        assert (fresh.packed.scales is None) == (not int8)
        assert not int8 or torch.equal(fresh.packed.scales, now.scales)


def test_a_heads_pass_packs_its_weights_in_int8_and_the_targets_stay_bfloat16(kernel, monkeypatch):
    """Drafts read int8 weights (inference.packed.DRAFT_WEIGHTS_INT8); the target's pass, which decides every token,
    never does."""
    monkeypatch.setattr(kernels, "packs_products", lambda device, dtype: True)
    monkeypatch.setattr(packed, "DRAFT_WEIGHTS_INT8", True)
    model = tiny_model("llama", vocab_size=128).bfloat16()
    head = EagleHead(EagleConfig.for_target(model.config)).bfloat16().eval()

    def packed_dtypes(program) -> set[torch.dtype]:
        packs = program.graph_module.graph.find_nodes(
            op="call_function", target=torch.ops.specheads.pack_linear_weight.default
        )
        return {node.meta["val"].dtype for node in packs}

    assert packed_dtypes(export_head_pass(head)) == {torch.int8}
    assert packed_dtypes(export_decoding_pass(model)) == {torch.bfloat16}
    # without int8 drafts, the head's weights stay bfloat16, in a package of their own
    int8_package = CompiledHead(head).packages()[0][0]
    monkeypatch.setattr(packed, "DRAFT_WEIGHTS_INT8", False)
    assert packed_dtypes(export_head_pass(head)) == {torch.bfloat16}
    assert CompiledHead(head).packages()[0][0] != int8_package
