import pytest

from inference.__main__ import main


def test_one_shot_prompt_streams_and_reports_stats(tiny_chat, capsys):
    main(["the cat runs", "--model", str(tiny_chat / "model"), "--lookup", "--max-new-tokens", "6", "--stats"])
    captured = capsys.readouterr()
    assert captured.out.strip()  # the streamed answer
    assert "tokens/s, tau" in captured.err


def test_chat_mode_answers_each_line(tiny_chat, capsys, monkeypatch):
    lines = iter(["the cat runs", "the dog jumps", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    main(["--chat", "--model", str(tiny_chat / "model"), "--max-new-tokens", "4", "--stats"])
    assert capsys.readouterr().err.count("tokens/s, tau") == 2


def test_a_prompt_or_chat_is_required(capsys):
    with pytest.raises(SystemExit):
        main([])
    assert "give a prompt" in capsys.readouterr().err


def test_eagle_head_gets_a_tree_calibrated_to_the_machine(tiny_chat, tmp_path, capsys, monkeypatch):
    from heads import EagleConfig, EagleHead, save_heads
    from inference import calibrate, load_target

    monkeypatch.setattr(calibrate, "CALIBRATION_DIR", tmp_path / "calibration")
    model, _ = load_target(tiny_chat / "model")
    save_heads(EagleHead(EagleConfig.for_target(model.config)), tmp_path / "eagle", model)
    main(["the cat runs", "--model", str(tiny_chat / "model"), "--heads", str(tmp_path / "eagle"), "--max-new-tokens", "6", "--stats"])
    assert "calibrating pass costs" in capsys.readouterr().out
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1
    main(["the cat runs", "--model", str(tiny_chat / "model"), "--heads", str(tmp_path / "eagle"), "--max-new-tokens", "6", "--tree", "3,2,4"])
    with pytest.raises(SystemExit, match="depth,top_k,nodes"):
        main(["the cat runs", "--model", str(tiny_chat / "model"), "--heads", str(tmp_path / "eagle"), "--tree", "3,2"])
