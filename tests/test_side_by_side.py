"""scripts/vllm_check.py's own arithmetic: vLLM's Prometheus counters summed, and the concurrency report (table and
chart) from the records its steps write. vLLM itself runs in its own venv (`make vllm-check`), not here."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import vllm_check  # noqa: E402

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_drafts_created 1.7e9
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 25.0
"""


def test_metric_totals_read_the_counter_not_its_siblings():
    assert vllm_check._metric_total(METRICS, "vllm:spec_decode_num_drafts") == 40.0
    assert vllm_check._metric_total(METRICS, "vllm:spec_decode_num_accepted_tokens") == 30.0
    assert vllm_check._metric_total(METRICS, "vllm:absent") == 0.0


def test_concurrency_report_tabulates_every_engine_and_counts_identical_outputs(tmp_path, capsys):
    def level(seconds, texts):
        return {"seconds": seconds, "tokens": 100, "texts": texts}

    plain = {"levels": {"1": level(10.0, ["a", "b"]), "4": level(4.0, ["a", "b"])}}
    spec = {"levels": {"1": level(5.0, ["a", "b"]), "4": level(5.0, ["a", "x"])}, "acceptance_length": 1.5}
    (tmp_path / "serve-plain.json").write_text(json.dumps(plain))
    (tmp_path / "serve-spec.json").write_text(json.dumps(spec))
    ours = {"ours-default": {"1": 30.0, "4": 60.0}, "ours-plain": {"1": 15.0, "4": 40.0}}
    (tmp_path / "ours-throughput.json").write_text(json.dumps(ours))
    vllm_check.concurrency_report(
        tmp_path, {"prompts": [[1], [2]], "heads": "checkpoints/served-head", "engine_heads": "checkpoints/own-head"}
    )
    printed = capsys.readouterr().out
    assert "| vLLM, no heads | 10.0 | 25.0 |" in printed
    assert "| vLLM with the heads (served-head) | 20.0 | 20.0 |" in printed
    assert "| this project, default call (own-head) | 30.0 | 60.0 |" in printed
    assert "identical to without | 2/2 | 1/2 |" in printed
    assert "acceptance length through the server 1.50" in printed
    assert (tmp_path / "concurrency.png").stat().st_size > 0
