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
