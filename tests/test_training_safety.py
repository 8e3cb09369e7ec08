"""Training never destroys what it did not write, never ships a diverged head, and names bad inputs clearly."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from heads.io import non_finite_parameters
from test_training import recipe
from training.train_heads import main as train


def checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step-*"))


@pytest.mark.parametrize(
    "save_every, problem",
    [
        # learning rate 1e30: finite weights of 1e30 after step 1, infinite ones after step 2, a NaN loss at step 3
        (50, "training diverged at step 3: the loss is nan"),
        (1, "training diverged at step 2: the weights hold NaN or infinity"),  # caught before its checkpoint is written
    ],
    ids=["loss", "weights"],
)
def test_a_diverging_run_stops_and_saves_nothing_broken(tiny_chat, tmp_path, capsys, save_every, problem):
    out = tmp_path / "heads"
    with pytest.raises(SystemExit) as exit_info:
        train(recipe(tiny_chat, out, learning_rate=1e30, warmup_steps=0, max_steps=6, save_every=save_every))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert problem in error and "Lower learning_rate" in error
    assert not out.exists()
    for checkpoint in (tmp_path / "heads.train-state").glob("step-*"):
        assert not non_finite_parameters(load_file(checkpoint / "model.safetensors")), checkpoint.name


def make_folder_with_files(path: Path) -> None:
    (path / "sub").mkdir(parents=True)
    (path / "precious.txt").write_text("mine")


@pytest.mark.parametrize(
    "setup, output, state, message",
    [
        (make_folder_with_files, "d", None, "holds files that are not a head checkpoint (precious.txt, sub)"),
        (lambda p: p.write_text("mine"), "d", None, "a file of that name exists"),
        (lambda p: p.write_text("mine"), "d/heads", None, "d is a file, not a folder"),
        (lambda p: p.write_text("mine"), "heads", "d", "cannot keep training checkpoints in"),
        (lambda p: p.write_text("mine"), "heads", "d/state", "d is a file, not a folder"),
    ],
    ids=["folder-with-files", "file", "under-a-file", "state-dir-is-a-file", "state-dir-under-a-file"],
)
def test_output_that_would_destroy_files_is_refused_before_any_work(
    tiny_chat, tmp_path, capsys, setup, output, state, message
):
    setup(tmp_path / "d")
    before = sorted((p.relative_to(tmp_path), p.is_file() and p.read_text()) for p in tmp_path.rglob("*"))
    extra = {"data.cache_dir": tmp_path / "cache"} | ({"state_dir": tmp_path / state} if state else {})
    with pytest.raises(SystemExit) as exit_info:
        train(recipe(tiny_chat, tmp_path / output, max_steps=1, **extra))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    # refused before the data was prepared, and nothing was touched
    assert sorted((p.relative_to(tmp_path), p.is_file() and p.read_text()) for p in tmp_path.rglob("*")) == before


def test_resuming_a_finished_run_trains_nothing_and_keeps_its_heads(tiny_chat, tmp_path, capsys):
    out, state = tmp_path / "heads", tmp_path / "heads.train-state"
    common = dict(max_steps=2, save_every=1, eval_every=1)
    train(recipe(tiny_chat, out, **common))
    heads, saved = (out / "model.safetensors").read_bytes(), checkpoints(state)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()

    resumed = train(recipe(tiny_chat, out, **common) + ["--resume"])
    assert resumed["steps"] == 2 and checkpoints(state) == saved
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert "the run is finished (step 2" in capsys.readouterr().out

    # killed between the last checkpoint and the final save: the heads are written from the checkpoint
    (out / "model.safetensors").unlink()
    (out / "config.json").unlink()
    resumed = train(recipe(tiny_chat, out, **common) + ["--resume"])
    assert resumed["steps"] == 2 and checkpoints(state) == saved
    assert (out / "model.safetensors").read_bytes() == heads
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 2

    # more steps asked for: training goes on
    resumed = train(recipe(tiny_chat, out, **{**common, "max_steps": 3}) + ["--resume"])
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 3
    assert json.loads((out / "config.json").read_text())["training"]["steps"] == 3


def test_resuming_a_run_that_ran_out_of_time_trains_nothing(tiny_chat, tmp_path, capsys):
    out = tmp_path / "heads"
    common = dict(max_steps=100, max_minutes=1e-6)  # out of time after the first step
    assert train(recipe(tiny_chat, out, **common))["steps"] == 1
    capsys.readouterr()
    assert train(recipe(tiny_chat, out, **common) + ["--resume"])["steps"] == 1
    assert "the run is finished (step 1" in capsys.readouterr().out
    assert checkpoints(tmp_path / "heads.train-state") == ["step-0000001"]


def test_staging_folders_of_a_killed_run_are_removed_at_the_start(tiny_chat, tmp_path):
    state = tmp_path / "heads.train-state"
    (state / ".step-0000003.tmp").mkdir(parents=True)
    (state / ".step-0000003.tmp" / "model.safetensors").write_text("half-written")
    (state / "notes.txt").write_text("not ours")
    train(recipe(tiny_chat, tmp_path / "heads", max_steps=1))
    assert not list(state.glob(".step-*")) and (state / "notes.txt").read_text() == "not ours"
    assert checkpoints(state) == ["step-0000001"]


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("empty.jsonl", "", "is empty"),
        ("blank.jsonl", "\n  \n", "holds no records"),
        ("broken.jsonl", '{"prompt": "a"}\n{"prompt": "b"\n{"prompt": "c"}\n', "broken.jsonl, line 2: not valid JSON"),
        ("list.jsonl", '{"prompt": "a"}\n["b"]\n', "list.jsonl, line 2: a JSON list, not an object"),
        ("garbage.json", "garbage {{{", "garbage.json is not valid JSON (line 1, column 1"),
        ("none.json", "[]", "holds no records"),
        ("garbage.parquet", "not parquet at all", "garbage.parquet cannot be read as parquet"),
    ],
    ids=["empty", "blank", "broken-line", "not-an-object", "garbage-json", "empty-list", "garbage-parquet"],
)
def test_malformed_data_files_are_named_with_the_line(tmp_path, name, content, message):
    from training.config import ConfigError, DataConfig
    from training.data import load_records

    (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match="data file .*") as error:
        load_records(DataConfig(path=str(tmp_path / name)))
    assert message in str(error.value)


def test_valid_json_files_still_load(tmp_path):
    from training.config import DataConfig
    from training.data import load_records

    records = [{"prompt": "a", "response": "b"}, {"prompt": "c\u2028d", "response": "e"}]
    (tmp_path / "list.json").write_text(json.dumps(records))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n\n" for r in records))
    for name in ("list.json", "lines.json"):
        assert load_records(DataConfig(path=str(tmp_path / name)))["prompt"] == ["a", "c\u2028d"]


def test_a_broken_data_file_is_a_clear_error_from_the_command_line(tiny_chat, tmp_path, capsys):
    lines = (tiny_chat / "prompts.jsonl").read_text().splitlines()
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines[:5] + ['{"prompt": "cut off'] + lines[5:]) + "\n")
    with pytest.raises(SystemExit) as exit_info:
        train(
            recipe(
                tiny_chat,
                tmp_path / "heads",
                max_steps=1,
                **{"data.path": tmp_path / "prompts.jsonl", "data.cache_dir": tmp_path / "cache"},
            )
        )
    assert exit_info.value.code == 2
    assert f"{tmp_path / 'prompts.jsonl'}, line 6: not valid JSON" in capsys.readouterr().err
