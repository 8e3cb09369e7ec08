"""Compiled passes (inference.compiled) decode exactly what the eager model does, from one package a model.

A tiny model compiles in about 20 s; the package lands in a temporary SPECHEADS_CACHE, so a second instance of
the same weights loads it instead of compiling.
"""

import importlib
import io
import json
import os
import shutil
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, tiny_model
from heads import EagleConfig, EagleHead
from inference import (
    DynamicTreeSpec,
    OracleDrafter,
    PromptLookupDrafter,
    best_static_paths,
    compile_target,
    compiled,
    compiled_heads,
    generate,
    warm_up,
)
from inference.compiled import decoding_pass, is_compiled, package_path
from inference.padding import prefill_groups
from inference.split_program import HalvesRunner
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
    model = compile_target(tiny_model("llama"))
    assert warm_up(model, verbose=False, wait=True) > 0 and is_compiled(model)
    return model


def without_narrow_package(model):
    """`model` compiled into one package only (the narrow passes' one is tested on compiled_llama): no compile left
    running in the background for the tests after."""
    decoding_pass(compile_target(model)).narrow_passes = False
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
    """An EAGLE head's and an early exit's dynamic trees, an oracle's 30-node tree, prompt lookup and plain steps:
    every width from 1 up, the cache growing and cropped, all through the one compiled pass (the heads' through
    their own); identical to HF greedy of the eager model."""
    model = compiled_llama
    torch.manual_seed(1)
    eagle = EagleHead(EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True)).eval()
    eagle3 = EagleHead(EagleConfig.for_target(model.config, feature_layers=[0, 1, -1], architecture="eagle3")).eval()
    exit_head = early_exit(model)
    tree30 = best_static_paths(30, default_accuracy(depth=6, ranks=4))
    shapes = recorded_shapes(decoding_pass(model), monkeypatch)
    head_shapes = {}
    for head in (eagle, eagle3, exit_head):  # the heads' passes compile with the target's
        kind = compiled_heads.CompiledEarlyExit if head is exit_head else compiled_heads.CompiledHead
        passes = compiled_heads.compiled_head(head, model, kind)
        assert passes is not head and passes.ready(verbose=False)
        head_shapes[head] = recorded_shapes(passes, monkeypatch)
    for prompt in random_prompts(model.config.vocab_size, 6, seed=3):
        reference = hf_greedy(model, prompt, NEW_TOKENS)
        full = torch.cat([prompt, torch.tensor(reference, dtype=torch.long)])
        drafters = {
            "eagle": (eagle, DynamicTreeSpec(depth=4, top_k=3, nodes=10)),
            "eagle3": (eagle3, DynamicTreeSpec(depth=3, top_k=2, nodes=6)),
            "early-exit": (exit_head, DynamicTreeSpec(depth=3, top_k=2, nodes=6)),
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


def test_passes_of_a_few_tokens_run_through_the_narrow_package_and_wider_ones_through_the_other(
    compiled_llama, monkeypatch
):
    model = compiled_llama
    passes = decoding_pass(model)
    assert passes.narrow_runner is not None and passes.narrow_package_path().exists()
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
    assert shapes[: len(groups)] == groups and max(groups)[0] > 1, "the first prompts prefilled there, padded"


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
    assert package_path(again) == package_path(compiled_llama)
    warm_up(again, verbose=False)
    prompt = random_prompts(again.config.vocab_size, 1, seed=4)[0]
    assert generate(again, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == hf_greedy(again, prompt, NEW_TOKENS)
    assert is_compiled(again)


def test_other_weights_dtype_or_config_get_their_own_package(compiled_llama):
    tuned = tiny_model("llama")
    with torch.no_grad():
        tuned.model.layers[0].mlp.up_proj.weight.add_(1e-3)  # a fine-tuned copy under the same name
    others = [tuned, tiny_model("llama").to(torch.bfloat16), tiny_model("llama", layers=3)]
    assert len({package_path(m) for m in [compiled_llama, *others]}) == 4


def test_a_model_that_does_not_compile_decodes_eagerly_after_one_warning(package_cache, monkeypatch):
    def fails(*args, **kwargs):
        raise torch._dynamo.exc.Unsupported("a graph break that cannot be traced")

    monkeypatch.setattr(compiled.torch.export, "export", fails)
    model = compile_target(tiny_model("llama", seed=2))
    prompt = random_prompts(model.config.vocab_size, 1, seed=5)[0]
    with pytest.warns(UserWarning, match="compiling failed on LlamaForCausalLM .*Unsupported.*running it eagerly"):
        out = generate(model, PromptLookupDrafter(), prompt, max_new_tokens=NEW_TOKENS)
    assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    assert not is_compiled(model) and not package_path(model).exists()
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
    path = package_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a package")  # say, copied from a machine it was not compiled for
    with pytest.warns(UserWarning, match="could not load the compiled package .* compiling it again"):
        warm_up(model, verbose=False)
    assert is_compiled(model) and path.stat().st_size > 1000
    prompt = random_prompts(model.config.vocab_size, 1, seed=6)[0]
    assert generate(model, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == hf_greedy(model, prompt, NEW_TOKENS)


def packages_compiled_here(monkeypatch) -> list:
    """The paths of the packages this process compiles from now on, in order (not the helper process's)."""
    compiled_here, package = [], compiled._package
    monkeypatch.setattr(
        compiled,
        "_package",
        lambda program, path, *options: compiled_here.append(path) or package(program, path, *options),
    )
    return compiled_here


def test_the_helper_process_builds_the_headers_once_a_machine(monkeypatch, tmp_path):
    # nothing waits on its success (inductor builds the headers itself when it fails), so only this sees it break
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a machine whose inductor has built nothing yet
    process = compiled._start_helper(torch.device("cpu"))
    assert process is not None and process.wait(timeout=600) == 0
    assert compiled._headers_built_marker().exists()
    assert compiled._start_helper(torch.device("cpu")) is None  # built, and no package to compile: no process
    assert compiled._start_helper(torch.device("meta")) is None  # only CPU packages share those headers


def test_the_helper_compiles_the_head_and_the_second_half_beside_the_target_then_the_narrow_package(
    package_cache, monkeypatch
):
    model = compile_target(tiny_model("llama", seed=11))
    torch.manual_seed(2)
    head = EagleHead(EagleConfig.for_target(model.config, feature_layers=[-1])).eval()
    compiled_here = packages_compiled_here(monkeypatch)
    assert warm_up(model, head, verbose=False) > 0
    passes, target = compiled_heads.compiled_head(head, model), decoding_pass(model)
    narrow = target.narrow_package_path()
    path = package_path(model)
    second = path.with_name(json.loads(compiled._wiring_path(path).read_text())["second_package"])
    assert compiled_here == [path.with_name(f"{path.stem}-first.pt2")], "the rest came from the other process"
    assert path.exists() and second.exists() and isinstance(target.runner, HalvesRunner)
    assert passes.runner is not None and passes.path.exists() and is_compiled(model)
    assert target.narrow_runner is not None or target.narrow_pending == narrow  # landed already, or still compiling
    warm_up(model, head, verbose=False, wait=True)
    assert target.narrow_runner is not None and target.narrow_path == narrow
    assert target.helper.wait(timeout=60) == 0
    assert not compiled._compiling_marker(narrow).exists()
    shapes = recorded_shapes(passes, monkeypatch)
    prompt = random_prompts(model.config.vocab_size, 1, seed=8)[0]
    out = generate(
        model, head, prompt, max_new_tokens=NEW_TOKENS, tree=DynamicTreeSpec(depth=3, top_k=2, nodes=6), fallback=False
    )
    assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS) and shapes, "it drafted through the package"


def test_the_helper_starts_on_the_heads_package_before_the_targets_program_is_exported(package_cache, monkeypatch):
    # the target's export takes 15 s for SmolLM2-135M: the head's package compiles meanwhile, the second half after
    model = compile_target(tiny_model("llama", seed=13))
    head = EagleHead(EagleConfig.for_target(model.config, feature_layers=[-1])).eval()
    events, start = [], compiled._start_helper

    def started(device, jobs, scratch):
        events.append([job if job == compiled.MORE_JOBS else Path(job[1]).name for job in jobs])
        return start(device, jobs, scratch)

    def export_fails(self):
        events.append("the target's export")
        raise torch._dynamo.exc.Unsupported("stopped here: the order is what this checks")

    monkeypatch.setattr(compiled, "_start_helper", started)
    monkeypatch.setattr(compiled.CompiledPasses, "export", export_fails)
    head_passes = compiled_heads.compiled_head(head, model)
    with pytest.warns(UserWarning, match="stopped here"):
        assert not decoding_pass(model).ready(verbose=False, alongside=[head_passes])
    assert events[0][:2] == [head_passes.package_path().name, compiled.MORE_JOBS]
    assert events[1] == "the target's export"


def test_a_second_half_the_helper_did_not_compile_is_compiled_here(package_cache, monkeypatch):
    model = without_narrow_package(tiny_model("llama", seed=12))
    compiled_here = packages_compiled_here(monkeypatch)
    monkeypatch.setattr(compiled, "_start_helper", lambda *args: None)  # a helper that was killed, say
    assert warm_up(model, verbose=False) > 0 and is_compiled(model)
    path, wiring_path = package_path(model), compiled._wiring_path(package_path(model))
    wiring = json.loads(wiring_path.read_text())
    assert compiled_here == [path.with_name(f"{path.stem}-first.pt2"), path.with_name(wiring["second_package"])]
    prompt = random_prompts(model.config.vocab_size, 1, seed=12)[0]
    assert generate(model, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == hf_greedy(model, prompt, NEW_TOKENS)
    # a first half cut elsewhere (two processes compiling at once, say) is refused, not run with the wrong wiring
    wiring_path.write_text(json.dumps({**wiring, "first_bytes": wiring["first_bytes"] + 1}))
    with pytest.raises(RuntimeError, match="not the one its wiring was written for"):
        compiled._load_package(path)


def test_a_narrow_package_compiling_elsewhere_is_waited_for_not_compiled_again(compiled_llama, monkeypatch, tmp_path):
    def compiles(*args, **kwargs):
        raise AssertionError("compiled again")

    landed = decoding_pass(compiled_llama).narrow_path
    kept = tmp_path / landed.name
    marker = compiled._compiling_marker(landed)
    shutil.move(landed, kept)  # the cache as it is while another process compiles it
    marker.write_text(f"{os.getpid()} {os.getppid()}")  # (a live process)
    try:
        monkeypatch.setattr(compiled, "_compile_package", compiles)
        again = compile_target(tiny_model("llama"))
        passes = decoding_pass(again)
        prompt = random_prompts(again.config.vocab_size, 1, seed=9)[0]
        reference = hf_greedy(again, prompt, NEW_TOKENS)
        assert generate(again, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == reference
        assert passes.narrow_runner is None and passes.narrow_pending == landed, "it waits for the package"
        shutil.move(kept, landed)
        assert generate(again, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == reference
        assert passes.narrow_path == landed and passes.narrow_pending is None, "the next call took it up"
        marker.write_text("999999999 1")  # no such process: a compile that ended without removing its marker
        assert not compiled._compiling_elsewhere(landed)
    finally:
        marker.unlink(missing_ok=True)
        if kept.exists():
            shutil.move(kept, landed)


def test_a_failed_narrow_compile_is_recorded_and_not_tried_again(compiled_llama, monkeypatch, tmp_path):
    def fails(*args, **kwargs):
        raise torch._inductor.exc.CppCompileError(["g++"], "internal compiler error")

    def compiles(*args, **kwargs):
        raise AssertionError("compiled again")

    landed = decoding_pass(compiled_llama).narrow_path
    kept, failed = tmp_path / landed.name, compiled._failed_marker(landed)
    shutil.move(landed, kept)
    try:
        # the helper's side, run here: the narrow package's compile fails, and it writes down why
        monkeypatch.setattr(compiled, "_lowest_priority", lambda: None)
        monkeypatch.setattr(compiled.torch.export, "load", lambda saved: None)
        monkeypatch.setattr(compiled, "_package", fails)
        saved = tmp_path / "program.pt2"
        saved.touch()
        compiled.run_helper(None, [(str(saved), str(landed), torch.get_num_threads(), True)])
        assert failed.read_text() == "CppCompileError: C++ compile error"
        # a later process compiles nothing, says once why those passes run through the other package, and decodes
        monkeypatch.setattr(compiled, "_compile_package", compiles)
        again = compile_target(tiny_model("llama"))
        prompt = random_prompts(again.config.vocab_size, 1, seed=10)[0]
        with pytest.warns(UserWarning, match=r"failed to compile .*C\+\+ compile error.*To try .* again, delete"):
            out = generate(again, None, prompt, max_new_tokens=NEW_TOKENS)
        assert out.token_ids == hf_greedy(again, prompt, NEW_TOKENS)
        passes = decoding_pass(again)
        assert passes.runner is not None and passes.narrow_runner is None and passes.narrow_pending is None
    finally:
        failed.unlink(missing_ok=True)
        shutil.move(kept, landed)


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


def _state(pid: int) -> str:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def _state_within(pid: int, wanted: str, seconds: float = 10.0) -> str:
    """The process's state once it reads `wanted`, or the last one read after `seconds`: a signal takes effect
    only when the process next runs, and on a loaded machine it may wait for a core ('R' until then)."""
    deadline = time.monotonic() + seconds
    while (state := _state(pid)) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc")
def test_a_background_compile_is_stopped_while_a_call_generates(monkeypatch):
    model = compile_target(tiny_model("llama", seed=13))
    passes = decoding_pass(model)
    monkeypatch.setattr(passes, "ready", lambda *args, **kwargs: False)  # decodes eagerly: nothing compiles here
    passes.helper = subprocess.Popen(["sleep", "60"], start_new_session=True)  # stands in for the helper
    states = []
    decoding = importlib.import_module("inference.generate")

    def stand_in_decode(*args, **kwargs):
        states.append(_state_within(passes.helper.pid, "T"))

    monkeypatch.setattr(decoding, "decode", stand_in_decode)
    try:
        with pytest.raises(TypeError):  # the stand-in decode returns nothing to read
            generate(model, None, [1, 2, 3], max_new_tokens=4)
        assert states == ["T"], "stopped while the call decoded"
        assert _state(passes.helper.pid) != "T", "and resumed after it, even though it failed"
    finally:
        passes.helper.kill()
        passes.helper.wait()


def test_a_pass_writes_its_entries_into_a_position_caches_buffers_and_any_other_cache_takes_them_in_too():
    from transformers import DynamicCache

    from inference.cache import PositionLayer, new_cache

    model = tiny_model("llama", layers=1)
    cached, new = torch.randn(2, 1, 3, 4), torch.randn(2, 1, 2, 4)
    expected = DynamicCache()
    expected.update(cached, -cached, 0)
    expected.update(new, -new, 0)
    for cache in (new_cache(model), DynamicCache()):
        cache.update(cached.clone(), -cached.clone(), 0)
        layer = cache.layers[0]
        keys, values = compiled._stores_with_room(layer, cached[:, :, :0], new.shape[2])
        assert keys.is_contiguous() and keys.shape[2] >= 5
        keys[:, :, 3:5], values[:, :, 3:5] = new, -new  # what the compiled pass writes (DecodingPass)
        compiled._take_entries(layer, keys, values, 3, 2)
        assert torch.equal(layer.keys, expected.layers[0].keys) and torch.equal(layer.values, expected.layers[0].values)
        if isinstance(layer, PositionLayer):  # the pass wrote into the cache's own buffer
            assert layer.keys.data_ptr() == keys.data_ptr()
