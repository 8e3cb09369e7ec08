import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from inference.__main__ import main
from inference.cli import run

ROOT = Path(__file__).resolve().parents[1]


def test_one_shot_prompt_streams_and_reports_stats(tiny_chat, capsys):
    main(["the cat runs", "--model", str(tiny_chat / "model"), "--no-lookup", "--max-new-tokens", "6", "--stats"])
    captured = capsys.readouterr()
    assert captured.out.strip()  # the streamed answer
    assert "tokens/s, tau" in captured.err and "ms/token; acceptance by depth" in captured.err


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

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    monkeypatch.setattr(calibrate, "doubt_about", lambda *args: None)  # kept whatever the machine's load
    model, _ = load_target(tiny_chat / "model", compile=False)
    save_heads(EagleHead(EagleConfig.for_target(model.config)), tmp_path / "eagle", model)
    main(
        [
            "the cat runs",
            "--model",
            str(tiny_chat / "model"),
            "--heads",
            str(tmp_path / "eagle"),
            "--max-new-tokens",
            "6",
            "--stats",
        ]
    )
    assert "calibrating pass costs" in capsys.readouterr().err
    assert len(list((tmp_path / "calibration").glob("*.json"))) == 1
    main(
        [
            "the cat runs",
            "--model",
            str(tiny_chat / "model"),
            "--heads",
            str(tmp_path / "eagle"),
            "--max-new-tokens",
            "6",
            "--tree",
            "3,2,4",
        ]
    )
    for tree, message in [
        ("3,2", "is auto or depth,top_k,nodes"),
        ("a,b,c", "got 'a,b,c'"),
        ("5,100000,15", "top_k <= 64"),
        ("2.5,4,15", "depth,top_k,nodes"),
        ("20,64,15", "candidate nodes a step"),
    ]:
        assert (
            cli(
                [
                    "the cat runs",
                    "--model",
                    str(tiny_chat / "model"),
                    "--heads",
                    str(tmp_path / "eagle"),
                    "--tree",
                    tree,
                ],
                capsys,
            )
            == 2
        )
        assert message in capsys.readouterr().err


def cli(argv, capsys) -> int:
    """The command line as a user runs it: its exit code; stderr must be one line, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        run(main, "python -m inference", argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1 and lines[0].startswith("python -m inference: "), err
    print(err, file=sys.stderr)  # for the caller's capsys
    return exit_info.value.code


def test_errors_are_one_line_and_exit_2(tiny_chat, tmp_path, capsys):
    model = str(tiny_chat / "model")
    (tmp_path / "not-heads").mkdir()
    for argv, message in [
        (["hi", "--model", model, "--heads", str(tmp_path / "not-heads")], "is not a head checkpoint"),
        (["hi", "--model", str(tmp_path / "nowhere")], "nowhere"),
        (["hi", "--model", model, "--temperature", "-1"], "temperature must be >= 0"),
    ]:
        assert cli(argv, capsys) == 2
        assert message in capsys.readouterr().err


def test_ctrl_c_exits_130_without_a_traceback(tiny_chat, capsys, monkeypatch):
    def interrupt(prompt=""):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupt)
    assert cli(["--chat", "--model", str(tiny_chat / "model")], capsys) == 130
    assert "interrupted" in capsys.readouterr().err


def test_the_installed_command_line_reports_errors_and_ctrl_c_in_one_line(tiny_chat):
    """`python -m inference` itself, as a user runs it: a bad setting, then Ctrl-C at the chat prompt."""
    command = [sys.executable, "-m", "inference", "--model", str(tiny_chat / "model")]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    bad = subprocess.run(
        command + ["hi", "--temperature", "-1"], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("python -m inference: error: temperature must be >= 0")

    # a runner started in the background (`cmd &`) ignores SIGINT and its children inherit that: give the chat a
    # terminal's default
    chat = subprocess.Popen(
        command + ["--chat"],
        cwd=ROOT,
        env=environment,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    watchdog = threading.Timer(120, chat.kill)
    watchdog.start()
    try:
        assert chat.stdout.read(2) == "> "  # waiting for the first question
        # stdin stays open until it exits (an end of input quits with 0). A signal that lands after input() wrote its
        # prompt but before it blocks in read() is only noticed at the next one, as a user's second Ctrl-C would be.
        for _ in range(30):
            chat.send_signal(signal.SIGINT)
            try:
                chat.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                continue
        err = chat.stderr.read()
    finally:
        watchdog.cancel()
        chat.stdin.close()
    assert (
        chat.returncode == 130 and "Traceback" not in err and err.strip().endswith("python -m inference: interrupted")
    ), err


def test_compile_builds_packages_ahead_of_time_and_a_second_run_loads_them(tiny_chat, tmp_path, capsys, monkeypatch):
    from inference.compile import main as compile_main

    monkeypatch.setenv("SPECHEADS_CACHE", str(tmp_path))
    compile_main(["--model", str(tiny_chat / "model"), "--dtype", "float32"])
    captured = capsys.readouterr()
    assert "compiling the target's decoding pass" in captured.err
    built = [line.split(": ", 1)[1] for line in captured.out.splitlines() if line.startswith("  ")]
    assert built and all(Path(path).is_file() for path in built)
    compile_main(["--model", str(tiny_chat / "model"), "--dtype", "float32"])
    again = capsys.readouterr()
    assert "compiling" not in again.err, "loaded, not built again"
