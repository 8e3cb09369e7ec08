"""scripts/gpu_check.py's dry run: every section's code runs on the CPU with tiny random models (a minute or two, most
of it compiling the tiny target and head), so that the GPU check cannot rot between GPU sessions; and the host reads
a decode step makes, counted on the CPU."""

import re
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_check  # noqa: E402
import host_syncs  # noqa: E402
from conftest import hf_greedy, tiny_model  # noqa: E402
from inference import (
    generate,  # noqa: E402
    medusa_tree_spec,  # noqa: E402
)
from inference.transfer import to_device  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-dry-run.md"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == out
    return out.read_text()


def section(report: str, title: str) -> str:
    """The text under one section's heading, up to the next heading."""
    return report.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_dry_run_writes_every_section_each_with_its_command(report):
    for title in gpu_check.RUNS:
        assert "Command: `python scripts/benchmark.py --model " in section(report, title), title
    for title in (gpu_check.SCALE, gpu_check.SYNCS):
        assert "Command: `python scripts/gpu_check.py --dry-run --out " in section(report, title), title


def test_dry_run_finds_the_tiny_models_exact_in_float32(report):
    text = section(report, "1. Float32, eager")
    overall = next(line for line in text.splitlines() if line.startswith("| overall"))
    assert overall.count("100% identical") == 2 and "Divergences" not in text, text  # the EAGLE and Medusa calls


def test_dry_run_reports_positive_speedups(report):
    batches = [float(x) for x in re.findall(r"\((\d+\.\d+)x, tau", section(report, "4. Batches of 1 and 8"))]
    scale = [float(x) for x in re.findall(r"\| (\d+\.\d+)x \|", section(report, gpu_check.SCALE))]
    assert len(batches) == 4 and len(scale) == 2  # the default call and the fixed tree at 1 and 8; HF and the replay
    assert all(ratio > 0 for ratio in batches + scale)


def test_dry_run_counts_host_reads_in_place_of_syncs_without_cuda(report):
    text = section(report, gpu_check.SYNCS)
    assert "HostReadRecorder" in text and "(`heads=None`)" in text and "The fixed tree's:" in text
    loop_rows = re.findall(r"\| \d+ \| (\d+\.\d+) \| `inference/loop\.py:\d+`", text)
    # the default call's rows, then the fixed tree's: the loop reads once a step (and a few times a call)
    assert loop_rows and all(float(per_step) <= 1.2 for per_step in loop_rows), text


def test_host_read_recorder_counts_reads_of_tensor_values_by_source_line():
    recorder_lines = []
    x = torch.arange(6)
    with host_syncs.recording_host_reads() as recorder:
        x.tolist()
        recorder_lines.append(sys._getframe().f_lineno - 1)
        if bool((x > 2).any()):  # a read
            y = x[x > 2]  # a boolean index: a read (its size depends on the values)
        recorder_lines.append(sys._getframe().f_lineno - 1)
        z = (x * 2 + y.sum()).clamp(max=9)  # arithmetic on the device: no read
        int(z[0])
        torch.tensor([1, 2], device=x.device)  # host values copied to the device synchronously: counted
        x.to(x.device)  # the same, for a tensor (on a GPU: a host tensor's upload)
        to_device([1, 2], x.device)  # pinned and non-blocking on a GPU: not counted
        x.to(x.device, non_blocking=True)
    here = "tests/test_gpu_check.py"
    assert recorder.count == 6
    assert recorder.sources[(f"{here}:{recorder_lines[0]}", "")] == 1
    assert recorder.sources[(f"{here}:{recorder_lines[1]}", "")] == 1


@pytest.mark.parametrize("drafted", [False, True], ids=["plain", "replayed chains"])
def test_the_loop_reads_the_host_once_a_decode_step(drafted):
    """On a GPU every read of a tensor's values waits for the device: a step reads its outcome (each row's accepted
    depth and first EOS, and a proposed chain's checks) back once. Two lengths of one prompt: each step more costs
    one read more (what a call reads once, the prefill's and the output's, cancels out)."""
    model = tiny_model(eos=None)
    prompt = torch.randint(1, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, prompt, 24)
    runs = []
    for new_tokens in (12, 24):
        drafter = None
        if drafted:
            continuation = torch.cat([prompt, torch.tensor(reference)])
            drafter = gpu_check.ReplayDrafter(continuation, 4, model.config.vocab_size, lengths=(1, 1, 1))
        with host_syncs.recording_host_reads() as reads:
            out = generate(model, drafter, prompt, max_new_tokens=new_tokens, lookup=False, fallback=False)
        assert out.token_ids == reference[:new_tokens]
        runs.append((out.stats.target_forwards, reads.count))
    (short_passes, short_reads), (long_passes, long_reads) = runs
    assert long_passes - short_passes >= 4
    assert long_reads - short_reads == long_passes - short_passes, runs


def test_a_fixed_eagle_tree_reads_the_host_twice_a_decode_step():
    """The EAGLE drafter keeps its state on the device (its copy input, its reliability, the context vocabulary):
    a step of a fixed tree reads the tree's checks and depth before its pass and its outcome after it."""
    from heads import EagleConfig, EagleHead
    from inference import DynamicTreeSpec

    model = tiny_model(eos=None)
    torch.manual_seed(0)
    config = EagleConfig.for_target(model.config, feature_layers=[1, -1], copy_input=True, draft_vocab_size=32)
    head = EagleHead(config).eval()  # its draft vocabulary, 32 tokens, grows with the tokens read
    prompt = torch.randint(1, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, prompt, 24)
    tree = DynamicTreeSpec(depth=4, top_k=3, nodes=8)
    runs = []
    for new_tokens in (12, 24):
        with host_syncs.recording_host_reads() as reads:
            out = generate(model, head, prompt, max_new_tokens=new_tokens, tree=tree, lookup=False, fallback=False)
        assert out.token_ids == reference[:new_tokens]
        runs.append((out.stats.target_forwards, reads.count))
    (short_passes, short_reads), (long_passes, long_reads) = runs
    assert long_passes - short_passes >= 4
    assert long_reads - short_reads == 2 * (long_passes - short_passes), runs


def test_the_default_calls_drafting_reads_the_host_at_most_twice_a_decode_step():
    """What the default call drafts with: prompt lookup merged into the EAGLE head's tree, priced by a measured cost.
    Lookup searches the loop's host copy of the text, the priced tree is read back once (best_nodes) and built on the
    host, the copied span is merged into it there and the merged tree is checked there: with the step's outcome, at
    most two reads a step."""
    from heads import EagleConfig, EagleHead
    from inference import DynamicTreeSpec
    from inference.tree_size import PassCost

    model = tiny_model(eos=None)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config, copy_input=True, draft_vocab_size=32)).eval()
    phrase = torch.randint(1, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([phrase, phrase, phrase[:3]])  # lookup finds what followed these tokens
    reference = hf_greedy(model, prompt, 24)
    cost = PassCost(tokens=(1, 16), relative=(1.0, 1.05), draft_level=0.02)  # drafting pays: most steps draft
    tree = DynamicTreeSpec(depth=4, top_k=3, nodes=8, cost=cost)
    runs = []
    for new_tokens in (12, 24):
        with host_syncs.recording_host_reads() as reads:
            out = generate(model, head, prompt, max_new_tokens=new_tokens, tree=tree, fallback=False)
        assert out.token_ids == reference[:new_tokens]
        runs.append((out.stats.target_forwards, reads.count, reads.sources))
    (short_passes, short_reads, _), (long_passes, long_reads, sources) = runs
    assert long_passes - short_passes >= 4
    assert long_passes - short_passes <= long_reads - short_reads <= 2 * (long_passes - short_passes), sources


@pytest.mark.parametrize("lookup", [False, True], ids=["heads", "lookup merged"])
def test_medusa_heads_read_the_host_twice_a_decode_step(lookup):
    """Medusa's step reads its candidates' tokens with their probabilities in one transfer; the tree is priced, built
    (StaticTree.host_tree) and merged with a copied span on the host, and checked there."""
    from heads import MedusaConfig, MedusaHeads
    from inference.tree_size import PassCost

    model = tiny_model(eos=None)
    torch.manual_seed(0)
    config = MedusaConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size, num_heads=3)
    heads = MedusaHeads(config).eval()
    phrase = torch.randint(1, model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(1))
    prompt = torch.cat([phrase, phrase, phrase[:3]])
    reference = hf_greedy(model, prompt, 24)
    cost = PassCost(tokens=(1, 16), relative=(1.0, 1.05))  # verifying is cheap: most steps draft
    tree = medusa_tree_spec(heads, cost=cost)
    generate(model, heads, prompt, max_new_tokens=24, tree=tree, lookup=lookup, fallback=False)  # shapes cached
    runs = []
    for new_tokens in (12, 24):
        with host_syncs.recording_host_reads() as reads:
            out = generate(model, heads, prompt, max_new_tokens=new_tokens, tree=tree, lookup=lookup, fallback=False)
        assert out.token_ids == reference[:new_tokens]
        runs.append((out.stats.target_forwards, reads.count, reads.sources))
    (short_passes, short_reads, _), (long_passes, long_reads, sources) = runs
    assert long_passes - short_passes >= 4
    assert long_reads - short_reads == 2 * (long_passes - short_passes), sources


def test_a_batchs_drafting_reads_the_host_at_most_twice_a_decode_step():
    """The default call over four prompts at once: each row's copied spans are grafted onto its pool of the head's
    drafts, the depth and width priced for all rows, and every row's tree built and checked on the host, after one
    read of the rows' drafts (_select_batch); with the step's outcome, two reads a step."""
    from heads import EagleConfig, EagleHead
    from inference import DynamicTreeSpec
    from inference.tree_size import PassCost

    model = tiny_model(eos=None)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(model.config, copy_input=True, draft_vocab_size=32)).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = []
    for length in range(6, 10):
        phrase = torch.randint(1, model.config.vocab_size, (length,), generator=generator)
        prompts.append(torch.cat([phrase, phrase, phrase[:3]]))  # lookup finds what followed these tokens
    references = [hf_greedy(model, prompt, 24) for prompt in prompts]
    cost = PassCost(tokens=(1, 16), relative=(1.0, 1.05), draft_level=0.02)  # drafting pays: most steps draft
    tree = DynamicTreeSpec(depth=4, top_k=3, nodes=8, cost=cost)
    runs = []
    for new_tokens in (12, 24):
        with host_syncs.recording_host_reads() as reads:
            outs = generate(model, head, prompts, max_new_tokens=new_tokens, tree=tree, fallback=False, batch_size=4)
        assert [out.token_ids for out in outs] == [reference[:new_tokens] for reference in references]
        runs.append((max(out.stats.target_forwards for out in outs), reads.count, reads.sources))
    (short_passes, short_reads, _), (long_passes, long_reads, sources) = runs
    assert long_passes - short_passes >= 4
    extra = 1  # the context vocabulary reads its size every few dozen tokens it reads
    assert long_passes - short_passes <= long_reads - short_reads <= 2 * (long_passes - short_passes) + extra, sources


def test_replay_drafter_makes_every_step_accept_the_drawn_length():
    model = tiny_model(eos=None)  # no EOS: every step decodes, and the last one exactly fills the budget
    prompt = torch.randint(1, model.config.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    reference = hf_greedy(model, prompt, 16)
    continuation = torch.cat([prompt, torch.tensor(reference)])
    drafter = gpu_check.ReplayDrafter(continuation, depth=4, vocab_size=model.config.vocab_size, lengths=(0, 0, 1))
    out = generate(model, drafter, prompt, max_new_tokens=16, lookup=False, fallback=False)
    assert out.token_ids == reference
    # the prefill's token, then 5 steps of 2 accepted drafts and the target's own token
    assert out.stats.target_forwards == 6 and out.stats.accepted_to_depth == [5, 5, 0, 0]
    assert gpu_check.expected_accepted((0, 0, 1), depth=4) == 2 and gpu_check.expected_accepted((0, 0, 1), depth=1) == 1


def test_sync_recorder_counts_sync_warnings_by_source_line():
    """The sync section's bookkeeping, fed warnings like the ones torch.cuda.set_sync_debug_mode("warn") raises."""
    recorder = host_syncs.SyncRecorder()
    here = "tests/test_gpu_check.py"
    with host_syncs.recorded_warnings(recorder):
        for _ in range(3):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        line = sys._getframe().f_lineno - 1
        warnings.warn("something else entirely", UserWarning, stacklevel=1)  # not a sync: not counted
        warnings.warn_explicit(  # a sync inside a library: attributed to the line of ours that called it
            "called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp:1.)",
            UserWarning,
            "/venv/lib/site-packages/transformers/masking_utils.py",
            7,
        )
        library_call = sys._getframe().f_lineno - 6
    assert recorder.count == 4
    assert host_syncs.source_text(f"{here}:{line}").startswith('warnings.warn("called a synchronizing CUDA operation"')
    assert recorder.sources.most_common() == [
        ((f"{here}:{line}", ""), 3),
        (("transformers/masking_utils.py:7", f"{here}:{library_call}"), 1),
    ]
