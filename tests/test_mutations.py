"""Runs scripts/check_mutations.py: deleting any finalize step, or rebinding a tensor where the contract
says copy in place, must make the lifecycle tests fail."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_mutations.py"


def test_every_lifecycle_mutation_is_caught(capsys):
    spec = importlib.util.spec_from_file_location("check_mutations", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    status = module.main([])
    report = capsys.readouterr().out
    assert status == 0, report
    caught = [line for line in report.splitlines() if line.startswith("caught")]
    assert len(caught) == len(module.MUTATIONS), report
