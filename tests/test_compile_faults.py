"""Compiled passes under real faults (inference.compiled, inference.store): two processes building one package, a
cache that cannot be written, a damaged package, changed weights, a build killed with SIGKILL. Each ends in the
target's own greedy output."""

import fcntl
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy, tiny_model
from inference import compile_target, generate, store, warm_up
from inference.compiled import decoding_pass, is_compiled, package_paths
from test_exactness_tiny import random_prompts

NEW_TOKENS = 20
REPO = Path(__file__).resolve().parents[1]

# A process that builds a tiny model's package (no narrow one: one package keeps these tests short), says each
# build it ran, and checks its output against HF greedy of the same weights.
BUILDER = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{repo!r}, {tests!r}]
    from conftest import hf_greedy, tiny_model
    from inference import compile_target, compiled, generate, warm_up
    package = compiled._package
    compiled._package = lambda *args: print("BUILT", flush=True) or package(*args)
    model = compile_target(tiny_model("llama", seed={seed}))
    compiled.decoding_pass(model).gemm_template = False
    warm_up(model, verbose=False)
    from test_exactness_tiny import random_prompts
    prompt = random_prompts(model.config.vocab_size, 1, seed=4)[0]
    exact = generate(model, None, prompt, max_new_tokens=20).token_ids == hf_greedy(model, prompt, 20)
    print("EXACT" if exact and compiled.is_compiled(model) else "WRONG", flush=True)
    """
)


def builder(cache: Path, seed: int) -> subprocess.Popen:
    code = BUILDER.format(repo=str(REPO), tests=str(REPO / "tests"), seed=seed)
    env = dict(os.environ, SPECHEADS_CACHE=str(cache), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)


def one_package(model):
    decoding_pass(compile_target(model)).gemm_template = False
    return model


def exact(model, seed: int = 4) -> bool:
    prompt = random_prompts(model.config.vocab_size, 1, seed=seed)[0]
    return generate(model, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == hf_greedy(model, prompt, NEW_TOKENS)


def test_two_processes_building_the_same_package_build_it_once(tmp_path):
    processes = [builder(tmp_path, seed=21) for _ in range(2)]
    outputs = [process.communicate(timeout=600)[0].split() for process in processes]
    assert all(process.returncode == 0 for process in processes), outputs
    assert [out[-1] for out in outputs] == ["EXACT", "EXACT"]
    assert sum(out.count("BUILT") for out in outputs) == 1, "the second waited for the first one's package"
    assert len(list((tmp_path / "compiled").glob("*.pt2"))) == 1, "and no staging file was left behind"


def test_a_build_killed_with_sigkill_leaves_nothing_a_later_process_trusts(tmp_path, monkeypatch):
    process = builder(tmp_path, seed=22)
    lock_files = []
    deadline = time.monotonic() + 300
    while not lock_files and time.monotonic() < deadline:  # the build has begun once its lock is taken
        lock_files = [path for path in (tmp_path / "compiled").glob("*.lock") if held(path)]
        time.sleep(0.05)
    assert lock_files, "the build took its lock"
    process.send_signal(signal.SIGKILL)
    process.wait()
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = one_package(tiny_model("llama", seed=22))
    assert exact(model) and is_compiled(model)
    assert not held(lock_files[0]), "the kernel released the killed build's lock"
    assert [p.name for p in (tmp_path / "compiled").iterdir() if ".tmp" in p.name] == []


def held(lock: Path) -> bool:
    with open(lock) as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(file, fcntl.LOCK_UN)
        return False


def test_a_cache_that_cannot_be_written_decodes_eagerly_after_one_warning(tmp_path, monkeypatch):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("not a folder")
    monkeypatch.setenv("SPECHEADS_CACHE", str(in_the_way / "cache"))  # a path through a regular file
    model = compile_target(tiny_model("llama", seed=23))
    with pytest.warns(UserWarning, match=r"running it eagerly") as caught:
        assert exact(model)
    assert any("SPECHEADS_CACHE" in str(w.message) for w in caught), "the warning says what to do"
    assert not is_compiled(model)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_package_is_built_again(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    assert exact(one_package(tiny_model("llama", seed=24)))
    [path] = package_paths(one_package(tiny_model("llama", seed=24)))
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2] if damage == "truncated" else b"not a package")
    again = one_package(tiny_model("llama", seed=24))
    with pytest.warns(UserWarning, match="could not load the compiled package .* compiling it again"):
        warm_up(again, verbose=False)
    assert is_compiled(again) and exact(again)


def test_a_package_never_serves_other_weights(tmp_path, monkeypatch):
    """One row of the output projection changed, far from any value a sample of each tensor would read: the changed
    model gets its own package and decodes its own greedy output, not the first model's."""
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    first = one_package(tiny_model("llama", seed=25))
    prompt = random_prompts(first.config.vocab_size, 1, seed=4)[0]
    before = generate(first, None, prompt, max_new_tokens=NEW_TOKENS).token_ids
    changed = one_package(tiny_model("llama", seed=25))
    with torch.no_grad():
        changed.lm_head.weight[before[3], 1:] += 3.0  # its greedy output now differs
    assert package_paths(changed) != package_paths(first)
    reference = hf_greedy(changed, prompt, NEW_TOKENS)
    assert reference != before
    assert generate(changed, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == reference


def test_a_package_of_another_version_is_not_loaded(monkeypatch):
    model = tiny_model("llama", seed=26)
    paths = package_paths(model)
    monkeypatch.setattr(store, "VERSION", store.VERSION + 1)
    assert all(a != b for a, b in zip(paths, package_paths(model)))


def test_a_compile_error_is_recorded_and_an_os_error_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    path = tmp_path / "compiled" / "x.pt2"

    def full_disk(staging):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        store.build_once(path, full_disk, what="x")
    assert store.recorded_failure(path) is None and not path.exists()
    assert list(path.parent.iterdir()) == [path.with_name("x.pt2.lock")], "no staging file left"


def test_weights_changed_in_place_after_compiling_get_their_own_package(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    model = one_package(tiny_model("llama", seed=27))
    prompt = random_prompts(model.config.vocab_size, 1, seed=4)[0]
    before = generate(model, None, prompt, max_new_tokens=NEW_TOKENS).token_ids
    first = decoding_pass(model).paths
    with torch.no_grad():
        model.lm_head.weight[before[3], 1:] += 3.0  # fine-tuned in place, say
    reference = hf_greedy(model, prompt, NEW_TOKENS)
    assert reference != before
    assert generate(model, None, prompt, max_new_tokens=NEW_TOKENS).token_ids == reference
    assert decoding_pass(model).paths != first and is_compiled(model)
