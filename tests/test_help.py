"""Every entry point answers --help with its options and an example command, and does nothing else."""

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = [
    "inference.__main__",
    "inference.calibrate",
    "inference.compile",
    "inference.convert",
    "inference.serve.__main__",
    "training.train_heads",
    "training.distill",
]
# the scripts run as commands; the others (common.py, the GPU check's sections) are imported by them
SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py") if '__name__ == "__main__"' in p.read_text())


def entry_point(name: str):
    if name in MODULES:
        return importlib.import_module(name).main
    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("name", MODULES + SCRIPTS)
def test_every_entry_point_answers_help_with_its_options_and_an_example(name, capsys):
    main = entry_point(name)
    try:
        main(["--help"])
    except SystemExit as end:
        assert end.code in (0, None), f"{name} --help exited {end.code}"
    shown = capsys.readouterr().out
    assert "usage:" in shown and "--" in shown, f"{name}: no usage or options"
    assert re.search(r"^\s*(\S*python3?|accelerate launch|make) \S", shown, re.M), f"{name}: no example command"
