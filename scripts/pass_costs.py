"""The pass-cost probe: what a compiled target pass costs on this CPU against what the hardware allows.

    python scripts/pass_costs.py --dtypes bfloat16 float32 --out docs/results/pass-costs-xeon-amx

For the target's compiled pass over 1 to 64 tokens, as a chain and as a tree, at 1, 4, 8 and 16 rows, with a short
and a long cache: milliseconds, the ratio to a one-token pass, GFLOP/s and GB/s against this CPU's peaks measured here
(a large matrix product, a 1 GiB sum). Besides: an EAGLE head's draft level priced as calibration prices it, and where
an eager pass's time goes (a profiler sees the compiled package as one call). Writes OUT.md and OUT.json.
"""

from __future__ import annotations

from functools import partial

import torch

from common import SHIPPED_EAGLE, header, instruction_set, load, parser, table, timed, write_results
from inference import calibrate, warm_up
from inference.cache import new_cache
from inference.compiled import decoding_pass, is_compiled
from inference.packed import packed_linear
from inference.tree import Tree, attention_mask, position_ids
from inference.tree_size import DynamicTreeSpec

TOKENS, ROWS, CONTEXTS = (1, 2, 4, 8, 16, 32, 64), (1, 4, 8, 16), {"short": 64, "long": 1024}
MATRIX_PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"}


def peaks(dtype: torch.dtype) -> tuple[float, float]:
    """(GFLOP/s of a large matrix product in `dtype`, GB/s of reading 1 GiB), the best of a few runs each; the
    product through torch's own kernel or oneDNN's over a packed weight, whichever is faster (on an EPYC torch's
    float32 product ran at two thirds of the passes' own)."""
    n = 4096 if dtype == torch.bfloat16 else 2048
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    data, packed = torch.ones(2**28), packed_linear(b)  # 1 GiB of float32; a @ b.T
    best_mm = min(timed(product)[1] for _ in range(5) for product in (lambda: a @ b, lambda: packed(a)))
    best_sum = min(timed(data.sum)[1] for _ in range(5))
    return 2 * n**3 / best_mm / 1e9, data.numel() * 4 / best_sum / 1e9


def pass_inputs(model, shape: str, rows: int, k: int, context: int) -> dict:
    """`rows` rows of k random tokens after `context` cached ones, as a chain or as a binary tree (node i > 0 the
    child of (i - 1) // 2: as wide as it is deep for its size)."""
    tokens, parents = torch.zeros(k, dtype=torch.long), torch.tensor([-1] + [(i - 1) // 2 for i in range(1, k)])
    tree = Tree.chain(tokens) if shape == "chain" else Tree.from_parents(tokens, parents)
    return {
        "input_ids": torch.randint(model.config.vocab_size, (rows, k)),
        "position_ids": position_ids(tree, context).expand(rows, -1).contiguous(),
        "attention_mask": attention_mask(tree, context, model.dtype).expand(rows, -1, -1, -1).contiguous(),
    }


def pass_work(model, rows: int, k: int, context: int) -> tuple[float, float]:
    """(FLOP, bytes read) of a pass of `rows` x `k` tokens over `context` cached ones, every token's logits kept."""
    config, size = model.config, model.dtype.itemsize
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    heads, layers = config.num_attention_heads, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", heads)
    attention = 4 * layers * heads * head_dim * k * (context + k) * rows
    kv_bytes = 2 * layers * kv_heads * head_dim * (context + k) * rows * size
    return 2 * weights * rows * k + attention, weights * size + kv_bytes


@torch.inference_mode()
def time_passes(model, peak: tuple[float, float], repeats: int) -> list[dict]:
    """Each pass at each of ROWS and CONTEXTS, interleaved (calibrate's medians), its entries cropped again."""
    step, results = decoding_pass(model), []
    for cache_name, context in CONTEXTS.items():
        for rows in ROWS:
            cache = new_cache(model)
            prompt = torch.randint(model.config.vocab_size, (rows, context))
            step(input_ids=prompt, cache=cache, position_ids=torch.arange(context).expand(rows, -1), use_cache=True)

            def verify(inputs: dict, k: int, cache=cache) -> None:
                step(cache=cache, use_cache=True, output_hidden_states=True, **inputs)
                cache.crop(-k)

            shapes = [(s, k) for k in TOKENS for s in ("chain", "tree") if rows * k <= 256 and (s == "chain" or k > 2)]
            runs = [partial(verify, pass_inputs(model, s, rows, k, context), k) for s, k in shapes]
            seconds = calibrate.interleaved_medians(runs, repeats)
            for (shape, k), spent in zip(shapes, seconds):
                flop, read = pass_work(model, rows, k, context)
                gflops, gbps = flop / spent / 1e9, read / spent / 1e9
                row = {"cache": cache_name, "rows": rows, "tokens": k, "shape": shape, "ms": 1e3 * spent}
                row |= {"relative": spent / seconds[0], "gflops": gflops, "gbps": gbps}
                results.append(row | {"compute_share": gflops / peak[0], "memory_share": gbps / peak[1]})
    return results


@torch.inference_mode()
def eager_split(model, k: int, context: int = 64) -> dict[str, float]:
    """Shares of an eager pass's CPU time: matrix products, attention, the rest (torch.profiler's self times)."""
    cache = new_cache(model)
    model(input_ids=torch.randint(100, (1, context)), cache=cache, use_cache=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        model(cache=cache, use_cache=True, **pass_inputs(model, "chain", 1, k, context))
    parts = dict.fromkeys(["matrix products", "attention", "the rest"], 0.0)
    for event in profile.key_averages():
        attention = any(word in event.key for word in ("attention", "sdpa", "flash"))
        part = "matrix products" if event.key in MATRIX_PRODUCTS else "attention" if attention else "the rest"
        parts[part] += event.self_cpu_time_total
    return {part: spent / sum(parts.values()) for part, spent in parts.items()}


def markdown(report: dict) -> str:
    lines = [f"{report['header']}  \nInstruction set: {report['instruction set']}."]
    columns = ["cache", "rows", "tokens", "shape", "ms", "x one token", "GFLOP/s (share of peak)"]
    for name, run in report["dtypes"].items():
        split = "; ".join(
            f"{k} tokens " + ", ".join(f"{part} {share:.0%}" for part, share in parts.items())
            for k, parts in run["eager_split"].items()
        )
        rows = [
            [p["cache"], p["rows"], p["tokens"], p["shape"], f"{p['ms']:.1f}", f"{p['relative']:.2f}"]
            + [f"{p['gflops']:.0f} ({p['compute_share']:.0%})", f"{p['gbps']:.1f} ({p['memory_share']:.0%})"]
            for p in run["passes"]
        ]
        lines += [
            f"\n## {name} ({'compiled' if run['compiled'] else 'EAGER: compiling failed'})\n",
            f"Peaks measured here: {run['peak_gflops']:.0f} GFLOP/s (a large matrix product), {run['peak_gbps']:.1f} "
            f"GB/s (reading 1 GiB). A draft level (calibration's pricing): {run['draft_level']:.3f} of a one-token "
            f"pass. An eager pass's time: {split}\n",
            table([*columns, "GB/s (share of peak)"], rows),
        ]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = parser(__doc__)
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--heads", default=str(SHIPPED_EAGLE), help="the EAGLE head whose draft level is priced")
    p.add_argument("--repeats", type=int, default=7, help="rounds of every pass, interleaved (medians)")
    p.add_argument("--out", required=True, help="write OUT.md and OUT.json")
    args = p.parse_args(argv)
    report = {"header": header("pass_costs.py", argv, torch.device("cpu")), "instruction set": instruction_set()}
    report["dtypes"] = {}
    for name in args.dtypes:
        model, _, head = load(None, args.heads, dtype=name, tokenizer=False)
        warm_up(model, head)
        peak = peaks(model.dtype)
        level = calibrate.measure(model, head, DynamicTreeSpec(depth=5, top_k=8, nodes=15)).cost.draft_level
        measured = {"compiled": is_compiled(model), "peak_gflops": peak[0], "peak_gbps": peak[1], "draft_level": level}
        measured["eager_split"] = {k: eager_split(model, k) for k in (1, 16)}
        report["dtypes"][name] = measured | {"passes": time_passes(model, peak, args.repeats)}
    write_results(args.out, markdown(report), report, indent=1)
    print(markdown(report))


if __name__ == "__main__":
    from inference.cli import run

    run(main, "pass_costs.py")
