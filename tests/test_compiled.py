"""Compiled passes (inference.compiled) decode exactly what the eager model does, from one package a model.

A tiny model compiles in about 30 s; the packages land in a temporary SPECHEADS_CACHE, so a second instance of
the same weights loads them instead of compiling. Faults with real processes: test_compile_faults.py.
"""

import io
import time
import warnings

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead, MedusaConfig, MedusaHeads
from inference import (
    DynamicTreeSpec,
    OracleDrafter,
    PromptLookupDrafter,
    best_static_paths,
    chain_paths,
    compile_target,
    compiled,
    compiled_heads,
    generate,
    warm_up,
)
from inference.compiled import decoding_pass, is_compiled, package_paths
from inference.padding import prefill_groups
from inference.tree_size import default_accuracy
from test_early_exit import early_exit
from test_exactness_tiny import random_prompts

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def package_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECHEADS_CACHE", str(tmp_path_factory.mktemp("specheads-cache")))
        yield


@pytest.fixture(scope="module")
def compiled_llama(package_cache):
    with pytest.MonkeyPatch.context() as patch:  # the narrow package kept whatever its timing here
        patch.setattr(compiled, "narrow_verdict", lambda passes, path: True)
        model = compile_target(tiny_model("llama"))
        assert warm_up(model, verbose=False) > 0 and is_compiled(model)
    return model


def without_narrow_package(model):
    """`model` compiled into one package only (the narrow passes' one is tested on compiled_llama)."""
    decoding_pass(compile_target(model)).gemm_template = False
    return model


def recorded_shapes(passes, monkeypatch, by_package: dict | None = None) -> list[tuple[int, int]]:
    """(rows, tokens) of every pass that runs through a compiled package (decoding_pass(model), a compiled head);
    `by_package` also gets them by package ("runner", "narrow_runner")."""
    shapes = []
    for name in ("runner", "narrow_runner"):
        runner = getattr(passes, name)
        if runner is not None:

            def recording(ids, *rest, runner=runner, name=name):
                shapes.append(tuple(ids.shape))
                if by_package is not None:
                    by_package.setdefault(name, []).append(tuple(ids.shape))
                return runner(ids, *rest)

            monkeypatch.setattr(passes, name, recording)
    return shapes


def test_compiled_decoding_matches_hf_greedy_over_trees_of_every_width(compiled_llama, monkeypatch):
    """An EAGLE head's and an early exit's dynamic trees, Medusa heads' trees, an oracle's 30-node tree, prompt lookup
    and plain steps: every width from 1 up, the cache growing and cropped, all through the one compiled pass (the
    heads' through their own); identical to HF greedy of the eager model."""
    model = compiled_llama
    torch.manual_seed(1)
    eagle = EagleHead(EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True)).eval()
    eagle3 = EagleHead(EagleConfig.for_target(model.config, feature_layers=[0, 1, -1], architecture="eagle3")).eval()
    exit_head = early_exit(model)
    medusa = MedusaHeads(MedusaConfig.for_target(model.config, num_heads=3, num_layers=2)).eval()
    for parameter in medusa.parameters():  # not the zeros they start from: drafts of their own
        torch.nn.init.normal_(parameter, std=0.05)
    tree30 = best_static_paths(30, default_accuracy(depth=6, ranks=4))
    shapes = recorded_shapes(decoding_pass(model), monkeypatch)
    head_shapes, fusion_shapes = {}, {}
    for head in (eagle, eagle3, exit_head):  # the heads' passes compile with the target's
        kind = compiled_heads.CompiledEarlyExit if head is exit_head else compiled_heads.CompiledHead
        passes = compiled_heads.compiled_head(head, model, kind)
        assert passes is not head and passes.ready(verbose=False)
        head_shapes[head] = recorded_shapes(passes, monkeypatch)
        if head is not exit_head:  # and an EAGLE head's feature fusion through its own package
            assert passes.fusion.runner is not None
            assert compiled_heads.head_passes(head, model) == [passes, passes.fusion]  # what warm_up and the CLI see
            fusion_shapes[head] = recorded_shapes(passes.fusion, monkeypatch)
    medusa_passes = compiled_heads.compiled_head(medusa, model, compiled_heads.CompiledMedusa)
    assert compiled_heads.head_passes(medusa, model) == [medusa_passes] and medusa_passes.ready(verbose=False)
    medusa_shapes = recorded_shapes(medusa_passes, monkeypatch)
    for prompt in random_prompts(model.config.vocab_size, 6, seed=3):
        reference = hf_greedy(model, prompt, NEW_TOKENS)
        full = torch.cat([prompt, torch.tensor(reference, dtype=torch.long)])
        drafters = {
            "eagle": (eagle, DynamicTreeSpec(depth=4, top_k=3, nodes=10)),
            "eagle3": (eagle3, DynamicTreeSpec(depth=3, top_k=2, nodes=6)),
            "early-exit": (exit_head, DynamicTreeSpec(depth=3, top_k=2, nodes=6)),
            "medusa": (medusa, None),
            "oracle-tree-30": (OracleDrafter(full, tree30, model.config.vocab_size), None),
            "lookup": (PromptLookupDrafter(max_ngram=2), None),
            "plain": (None, None),
        }
        for name, (heads, tree) in drafters.items():
            out = generate(model, heads, prompt, max_new_tokens=NEW_TOKENS, tree=tree, lookup=False, fallback=False)
            assert out.token_ids == reference, (name, prompt.tolist())
    widths = {tokens for _, tokens in shapes}
    assert 1 in widths and max(widths) > 10, "plain steps and wide trees both ran through the compiled pass"
    prompts = {len(prompt) for prompt in random_prompts(model.config.vocab_size, 6, seed=3)}
    assert prompts <= widths, "every prompt was prefilled through the compiled pass"
    for head, calls in head_shapes.items():  # committed tokens read (1 a step or more) and draft levels (top_k wide)
        assert {shape[1] for shape in calls} >= {1, 3 if head is eagle else 2}, calls
        # and every prompt's first read: an EAGLE head's n pairs, the early exit's n tokens and the first new one
        first_reads = {n + 1 for n in prompts} if head is exit_head else prompts
        assert first_reads <= {shape[1] for shape in calls}, calls
    for calls in fusion_shapes.values():  # every committed read's features, the prompts' included
        assert 1 in {shape[1] for shape in calls} and prompts <= {shape[1] for shape in calls}, calls
    assert medusa_shapes and all(rows == 1 for rows, _ in medusa_shapes), "Medusa drafted through its package"


def test_passes_of_a_few_tokens_run_through_the_narrow_package_and_wider_ones_through_the_other(
    compiled_llama, monkeypatch
):
    model = compiled_llama
    passes = decoding_pass(model)
    assert passes.narrow_runner is not None and all(path.exists() for path in passes.paths)
    by_package = {}
    recorded_shapes(passes, monkeypatch, by_package)
    tree = best_static_paths(6, default_accuracy(depth=3, ranks=2))
    prompts = random_prompts(model.config.vocab_size, 3, seed=12)
    references = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in prompts]
    for prompt, reference in zip(prompts, references):
        oracle = OracleDrafter(torch.cat([prompt, torch.tensor(reference)]), tree, model.config.vocab_size)
        for heads in (None, oracle):
            assert generate(model, heads, prompt, max_new_tokens=NEW_TOKENS, fallback=False).token_ids == reference
    batch = generate(model, None, [p.tolist() for p in prompts], max_new_tokens=NEW_TOKENS, batch_size=3)
    assert [out.token_ids for out in batch] == references
    tokens = {name: {rows * width for rows, width in shapes} for name, shapes in by_package.items()}
    assert 1 in tokens["narrow_runner"], "plain steps ran through the narrow package"
    assert max(tokens["narrow_runner"]) <= compiled.NARROW_TOKENS
    assert min(tokens["runner"]) > compiled.NARROW_TOKENS, "trees, batches and prompts through the other"


def test_a_narrow_package_timed_slower_is_dropped_and_not_loaded_again(compiled_llama, monkeypatch):
    narrow, other = compiled.one_token_seconds(decoding_pass(compiled_llama), rounds=2)
    assert narrow > 0 and other > 0 and decoding_pass(compiled_llama).narrow_runner is not None
    monkeypatch.setattr(compiled, "one_token_seconds", lambda passes: (2e-3, 1e-3))
    model = compile_target(tiny_model("llama"))  # compiled_llama's weights: its packages load
    assert warm_up(model, verbose=False) > 0 and decoding_pass(model).narrow_runner is None
    assert len(package_paths(model)) == 2 and decoding_pass(model).paths == package_paths(model)[:1]
    prompt = random_prompts(model.config.vocab_size, 1, seed=16)[0]
    assert generate(model, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    verdict = compiled._verdict_path(package_paths(model)[1])
    try:
        monkeypatch.setattr(compiled, "one_token_seconds", lambda passes: pytest.fail("timed again"))
        loaded = []
        monkeypatch.setattr(compiled, "_load_or_build", lambda path, *args: loaded.append(path) or object())
        again = compile_target(tiny_model("llama"))
        assert warm_up(again, verbose=False) >= 0 and decoding_pass(again).narrow_runner is None
        assert loaded == package_paths(again)[:1], "the recorded verdict kept the narrow package unloaded"
    finally:
        verdict.unlink()


def test_a_narrow_package_that_fails_when_run_is_dropped_with_a_warning(compiled_llama, monkeypatch):
    def fails(passes):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(compiled, "one_token_seconds", fails)
    model = compile_target(tiny_model("llama"))  # compiled_llama's weights: its packages load
    with pytest.warns(UserWarning, match="does not run .*a kernel failed"):
        warm_up(model, verbose=False)
    assert decoding_pass(model).narrow_runner is None and is_compiled(model)
    assert not compiled._verdict_path(package_paths(model)[1]).exists(), "nothing recorded: the next process tries"


def test_where_the_gemm_template_serves_every_pass_one_package_does(package_cache, monkeypatch):
    """With AMX tiles in bfloat16 one package of inductor's GEMM template runs plain steps, trees and prompts."""
    monkeypatch.setattr(compiled, "template_serves_every_pass", lambda dtype: True)
    model = compile_target(tiny_model("llama", seed=14))
    [path] = package_paths(model)
    assert "-template-" in path.name
    assert warm_up(model, verbose=False) > 0 and decoding_pass(model).narrow_runner is None
    shapes = recorded_shapes(decoding_pass(model), monkeypatch)
    prompt = random_prompts(model.config.vocab_size, 1, seed=15)[0]
    reference = hf_greedy(model, prompt, NEW_TOKENS)
    oracle = OracleDrafter(torch.cat([prompt, torch.tensor(reference)]), chain_paths(6), model.config.vocab_size)
    for heads in (None, oracle):
        assert generate(model, heads, prompt, max_new_tokens=NEW_TOKENS, fallback=False).token_ids == reference
    assert {1, 7, len(prompt)} <= {tokens for _, tokens in shapes}


def test_compiled_batches_match_each_row_alone(compiled_llama, monkeypatch):
    model = compiled_llama
    shapes = recorded_shapes(decoding_pass(model), monkeypatch)
    prompts = random_prompts(model.config.vocab_size, 5, seed=9)
    references = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
    outs = generate(
        model,
        PromptLookupDrafter(max_ngram=2),
        [p.tolist() for p in prompts],
        max_new_tokens=NEW_TOKENS,
        batch_size=3,
        fallback=False,
    )
    assert [o.token_ids for o in outs] == references
    assert {rows for rows, _ in shapes} >= {3, 1}, "batches of several rows and of one ran through the one package"
    lengths = [len(p) for p in prompts[:3]]
    groups = [(len(group), max(lengths[row] for row in group)) for group in prefill_groups(lengths)]
    # shortest group first: its rows start before a longer group's prefill
    assert shapes[: len(groups)] == groups[::-1] and max(groups)[0] > 1, "the first prompts prefilled there, padded"


def test_a_prompt_longer_than_the_compiled_prefill_takes_is_prefilled_eagerly(compiled_llama, monkeypatch):
    model = compiled_llama
    monkeypatch.setattr(compiled, "COMPILED_PREFILL_TOKENS", 8)
    shapes = recorded_shapes(decoding_pass(model), monkeypatch)
    short, long = torch.arange(4, 10), torch.arange(4, 30)
    for prompt in (short, long):
        out = generate(model, None, prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    assert (1, 6) in shapes and (1, 26) not in shapes


def test_a_second_instance_of_the_same_weights_loads_the_package(compiled_llama, monkeypatch):
    def compiles(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", compiles)
    again = compile_target(tiny_model("llama"))
    assert package_paths(again) == package_paths(compiled_llama)
    warm_up(again, verbose=False)
    prompt = random_prompts(again.config.vocab_size, 1, seed=4)[0]
    assert generate(again, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == hf_greedy(again, prompt, NEW_TOKENS)
    assert is_compiled(again)


def test_other_weights_dtype_or_config_get_their_own_package(compiled_llama):
    tuned = tiny_model("llama")
    with torch.no_grad():
        tuned.model.layers[0].mlp.up_proj.weight.add_(1e-3)  # a fine-tuned copy under the same name
    others = [tuned, tiny_model("llama").to(torch.bfloat16), tiny_model("llama", layers=3)]
    assert len({package_paths(m)[0] for m in [compiled_llama, *others]}) == 4


def test_a_model_that_does_not_compile_decodes_eagerly_after_one_warning(package_cache, monkeypatch):
    def fails(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("a graph break that cannot be traced")

    monkeypatch.setattr(compiled.torch.export, "export", fails)
    model = compile_target(tiny_model("llama", seed=2))
    prompt = random_prompts(model.config.vocab_size, 1, seed=5)[0]
    with pytest.warns(UserWarning, match="compiling failed on LlamaForCausalLM .*Unsupported.*running it eagerly"):
        out = generate(model, PromptLookupDrafter(), prompt, max_new_tokens=NEW_TOKENS)
    assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    assert not is_compiled(model) and not package_paths(model)[0].exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the next call decodes eagerly in silence
        generate(model, None, prompt, max_new_tokens=4)

    def tries_again(*args, **kwargs):
        raise AssertionError("exported again")

    monkeypatch.setattr(compiled.torch.export, "export", tries_again)
    again = compile_target(tiny_model("llama", seed=2))  # a later process: the failure was recorded
    with pytest.warns(UserWarning, match=r"\(Unsupported: a graph break .*, when this machine tried; to try again"):
        assert generate(again, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == out.token_ids
    assert not is_compiled(again)


def test_the_models_own_forward_stays_eager(compiled_llama):
    assert decoding_pass(compiled_llama) is not compiled_llama
    assert decoding_pass(tiny_model("llama")).__class__.__name__ == "LlamaForCausalLM"


def test_a_package_that_does_not_load_is_compiled_again(package_cache):
    model = without_narrow_package(tiny_model("llama", seed=7))
    [path] = package_paths(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a package")  # say, copied from a machine it was not compiled for
    with pytest.warns(UserWarning, match="could not load the compiled package .* compiling it again"):
        warm_up(model, verbose=False)
    assert is_compiled(model) and path.stat().st_size > 1000
    prompt = random_prompts(model.config.vocab_size, 1, seed=6)[0]
    assert generate(model, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == hf_greedy(model, prompt, NEW_TOKENS)


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_compile_on_a_terminal_counts_its_seconds_and_a_log_gets_no_counter():
    terminal, log = Terminal(), io.StringIO()
    with compiled.seconds_counted("  compiling", stream=terminal, every=0.05):
        time.sleep(1.3)
    with compiled.seconds_counted("  compiling", stream=log, every=0.05):
        time.sleep(0.2)
    shown = terminal.getvalue().split("\r")
    assert "  compiling: 00:00" in shown and "  compiling: 00:01" in shown, "the seconds go on"
    assert shown[-1] == "", "and the line is cleared at the end"
    assert log.getvalue() == ""


def test_a_pass_writes_its_entries_into_a_position_caches_buffers_and_any_other_cache_takes_them_in_too():
    from transformers import DynamicCache

    from inference import passes
    from inference.cache import PositionLayer, new_cache

    model = tiny_model("llama", layers=1)
    cached, new = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 2, 4)
    expected = DynamicCache()
    expected.update(cached, -cached, 0)
    expected.update(new, -new, 0)
    for cache in (new_cache(model), DynamicCache()):
        cache.update(cached.clone(), -cached.clone(), 0)
        layer = cache.layers[0]
        keys, values = passes.stores_with_room(layer, cached[:, :, :0], new.shape[2])
        assert keys.is_contiguous() and keys.shape[2] >= 5
        keys[:, :, 3:5], values[:, :, 3:5] = new, -new  # what the compiled pass writes (DecodingPass)
        passes.take_entries(layer, keys, values, 3, 2)
        assert torch.equal(layer.keys, expected.layers[0].keys) and torch.equal(layer.values, expected.layers[0].values)
        if isinstance(layer, PositionLayer):  # the pass wrote into the cache's own buffer
            assert layer.keys.data_ptr() == keys.data_ptr()
