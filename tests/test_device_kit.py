"""scripts/device_kit.py: the target travels to a device machine in parts and is rebuilt exactly, and the tracked
folders too large to travel leave git's index and come back unchanged."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import device_kit  # noqa: E402


def git(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


@pytest.fixture
def kit_dir(tmp_path, monkeypatch):
    """A repository root with a kit of a 1,000-byte "GGUF" in two parts, and a device root beside it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(device_kit, "DEVICE_ROOT", tmp_path / "device")
    device_kit.KIT.mkdir()
    source = tmp_path / "model.gguf"
    source.write_bytes(bytes(range(256)) * 3 + b"tail" * 58)
    parts = device_kit.split_file(source, device_kit.KIT, 600)
    manifest = {"file": "model.gguf", "package": "fake_package", "parts": parts, "wheels": []}
    manifest["sha256"] = hashlib.sha256(source.read_bytes()).hexdigest()
    (device_kit.KIT / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path, source


def test_parts_carried_in_two_calls_rebuild_the_file_exactly(kit_dir):
    root, source = kit_dir
    second = (device_kit.KIT / "part-1").read_bytes()
    (device_kit.KIT / "part-1").unlink()  # the first call carries part 0 alone
    device_kit.unpack()
    package = root / "device" / "site" / "fake_package"
    assert not package.exists() and (root / "device" / "kit" / "part-0").is_file()
    (device_kit.KIT / "part-0").unlink()  # the second call carries part 1; part 0 waits outside the repository
    (device_kit.KIT / "part-1").write_bytes(second)
    device_kit.unpack()
    assert (package / "model.gguf").read_bytes() == source.read_bytes()
    assert (package / "__init__.py").is_file()


def test_parts_that_do_not_make_the_file_are_refused(kit_dir):
    root, _ = kit_dir
    part = device_kit.KIT / "part-1"
    part.write_bytes(part.read_bytes()[:-1] + b"x")
    with pytest.raises(SystemExit, match="sha256 differs"):
        device_kit.unpack()
    assert not (root / "device" / "site" / "fake_package" / "model.gguf").exists()


def test_the_calls_carry_every_part_once_each_within_the_room_and_the_last_runs_the_check(kit_dir):
    manifest = json.loads((device_kit.KIT / "manifest.json").read_text())
    (device_kit.KIT / "wheels").mkdir()
    (device_kit.KIT / "wheels" / "w.whl").write_bytes(b"w" * 500)
    (device_kit.KIT / "dev.jsonl").write_text("{}\n" * 100)
    room = 1000
    planned = device_kit.calls(manifest, room)
    carried = [path for carry, _ in planned for path in carry if not path.endswith("manifest.json")]
    assert sorted(carried) == sorted(
        [
            ".device-kit/part-0",
            ".device-kit/part-1",
            ".device-kit/wheels",
            ".device-kit/dev.jsonl",
            *device_kit.gpu_heads(),
        ]
    )
    assert len(planned) == 3  # 600 + 400 bytes of parts, 500 of wheels: no two fit one call beside the manifest
    assert all(device_kit.size(carry) <= room for carry, _ in planned[:-1])
    assert [("gpu_check.py" in command) for _, command in planned] == [False, False, True]


def test_a_training_plan_carries_the_recipes_corpus_and_prompts_and_brings_the_heads_back(kit_dir):
    manifest = json.loads((device_kit.KIT / "manifest.json").read_text())
    recipe = Path("recipe.yaml")
    recipe.write_text("data:\n  corpus: data/distill/some-corpus\n")
    carry, command = device_kit.calls(manifest, 10**9, check=False, train=(str(recipe),))[-1]
    assert "data/distill/some-corpus" in carry and ".device-kit/prompts.jsonl" in carry
    assert "gpu_check.py" not in command and "--config recipe.yaml --data.path .device-kit/prompts.jsonl" in command
    assert command.endswith(f"cp {device_kit.DEVICE_ROOT}/out/recipe/* $OUT/recipe/")
    recipe.write_text("data:\n  path: prompts.jsonl\n")
    with pytest.raises(SystemExit, match="names no data.corpus"):
        device_kit.calls(manifest, 10**9, check=False, train=(str(recipe),))
    with pytest.raises(SystemExit, match="nothing to run"):
        device_kit.calls(manifest, 10**9, check=False)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with code and two large tracked folders, committed."""
    for path, text in [
        (".gitignore", "/.device-kit/\n"),
        ("code.py", "x = 1\n"),
        ("checkpoints/h/model.bin", "w" * 5000),
        ("data/c.jsonl", "d" * 3000),
    ]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    for args in (["init", "-q"], ["add", "."], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init"]):
        assert git(tmp_path, *args).returncode == 0
    monkeypatch.setattr(device_kit, "REPO", tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_hide_takes_the_large_folders_out_of_what_travels_and_restore_puts_them_back(repo):
    before = device_kit.travelling_bytes()
    exclude = repo / ".git" / "info" / "exclude"
    exclude_before = exclude.read_text() if exclude.exists() else ""
    device_kit.hide()
    assert device_kit.travelling_bytes() == before - 8000
    assert (repo / "checkpoints" / "h" / "model.bin").is_file()  # the files stay where they are
    committed = git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "would delete the heads")
    assert committed.returncode != 0 and "device_kit.py restore" in committed.stderr
    with pytest.raises(SystemExit, match="already hidden"):
        device_kit.hide()
    device_kit.restore()
    assert device_kit.travelling_bytes() == before
    assert git(repo, "status", "--porcelain").stdout == ""
    assert (exclude.read_text() if exclude.exists() else "") == exclude_before
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()


def test_hide_refuses_to_replace_a_hook_of_the_users_own(repo):
    hook = repo / ".git" / "hooks" / "pre-commit"
    hook.write_text("#!/bin/sh\nexit 0\n")
    with pytest.raises(SystemExit, match="hook"):
        device_kit.hide()
    assert git(repo, "ls-files", "checkpoints").stdout.strip() == "checkpoints/h/model.bin"


def commit_refused(repo: Path) -> bool:
    committed = git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "would delete the heads")
    return committed.returncode != 0 and "device_kit.py restore" in committed.stderr


def test_prepare_never_removes_the_guard_while_the_folders_are_hidden(repo):
    device_kit.hide()
    (device_kit.KIT / "part-0").write_text("an earlier kit")
    (device_kit.KIT / "wheels").mkdir()
    device_kit.clear_kit()  # what prepare does first
    assert [p.name for p in device_kit.KIT.iterdir()] == ["HIDDEN"]
    assert commit_refused(repo)
    device_kit.restore()
    assert git(repo, "status", "--porcelain").stdout == ""


def test_without_its_marker_hide_still_refuses_a_second_run_and_the_hook_still_refuses_commits(repo):
    device_kit.hide()
    (device_kit.KIT / "HIDDEN").unlink()  # deleted by hand, say
    with pytest.raises(SystemExit, match="already hidden"):
        device_kit.hide()
    assert commit_refused(repo), "the hook reads the index too"
    assert git(repo, "ls-files", "checkpoints").stdout == "", "still out of the index"


def test_restore_always_puts_the_index_back(repo):
    device_kit.hide()
    (device_kit.KIT / "HIDDEN").unlink()
    (repo / ".git" / "info" / "exclude").unlink()  # the exclusion gone too
    device_kit.restore()
    assert git(repo, "ls-files", "checkpoints", "data").stdout.split() == ["checkpoints/h/model.bin", "data/c.jsonl"]
    assert git(repo, "status", "--porcelain").stdout == ""
    assert not (repo / ".git" / "hooks" / "pre-commit").exists()
    device_kit.restore()  # twice is harmless
    assert git(repo, "status", "--porcelain").stdout == ""
