"""scripts/side_by_side.py's own arithmetic: vLLM's Prometheus counters read, and the report's tables from the records
its workers write. The peers themselves run in their own venvs (`make vllm-check`), not here."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import side_by_side  # noqa: E402

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_drafts_created 1.7e9
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 25.0
"""


def test_speculation_counters_read_the_totals_not_their_siblings():
    assert side_by_side.speculation_counters(METRICS) == {"drafts": 40.0, "accepted": 30.0, "per_position": [25.0, 5.0]}
    assert side_by_side.speculation_counters("") == {"drafts": 0.0, "accepted": 0.0, "per_position": []}


def test_report_tabulates_every_engine_and_the_engines_drafting_as_vllm_does():
    eos = 9

    def run(engine, at_once, seconds, outputs, **more):
        return {"engine": engine, "at_once": at_once, "round": 0, "outputs": outputs, "seconds": seconds, **more}

    a, b = [1, 2, 3, eos], [4, 5, eos]  # 3 and 2 tokens before EOS
    runs = [
        run("hf", 1, [1.0, 1.5], [a, b]),
        run("plain", 1, [0.5, 0.5], [a, b]),
        run("plain", 4, [0.5], [a, b]),
        run("chain", 4, [0.25], [a, [4, 6, eos]], forwards=[3, 2]),  # (4 - 1 + 3 - 1) / (2 + 1) tokens a step
        run("vllm", 4, [1.0], [a, b]),
        run("vllm-eagle3", 4, [2.0], [a, [4, 6, eos]], drafts=40.0, accepted=30.0, per_position=[25.0, 5.0]),
    ]
    setup = {"eos": [eos], "prompts": [[0], [0]], "max_new_tokens": 8, "dtype": "float32", "vllm_heads": "h"}
    setup["vllm_depth"] = 2
    args = argparse.Namespace(at_once=[1, 4], per_category=1, rounds=1, serve=True)
    text = side_by_side.report(args, setup, runs, ["--serve"])
    assert "| hf | 2.0: **2.0** (2/2) | - |" in text
    assert "| plain | 5.0: **5.0** (2/2) | 10.0: **10.0** (2/2) |" in text  # each against HF one at a time
    assert "| plain / hf | 2.50x | - |" in text and "| plain / vllm | - | 2.00x |" in text
    assert "| chain | 4 | 1.67 | - | 1/2 |" in text
    assert "| vllm-eagle3 | 4 | 1.75 | 0.62, 0.12 | 1/2 |" in text
    assert "vLLM through `vllm serve`" in text
