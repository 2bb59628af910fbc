"""The repository stands alone and keeps itself clean: `make test` lints before it tests, and no tracked file
points at material outside the repository."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Spellings of places outside this repository that documentation or comments once pointed at.
OUTSIDE_REFERENCES = ("../shared", "/work/shared", "shared/DESIGN.md", "development workspace")
TEXT_SUFFIXES = (".py", ".md", ".toml", ".cfg", ".txt", ".json", ".c", ".sh")


def test_make_test_runs_ruff_on_every_python_folder_before_pytest(tmp_path):
    # A stamp newer than pyproject.toml stands in for the installed venv. It must not be the Makefile itself:
    # make remakes its own makefiles even under -n, so `STAMP=Makefile` ran the pip installs for real.
    stamp = tmp_path / "installed"
    stamp.touch()
    dry_run = subprocess.run(["make", "-n", "test", f"STAMP={stamp}"], capture_output=True, text=True, cwd=REPO,
                             check=True, timeout=60).stdout.splitlines()
    ruff = next(i for i, line in enumerate(dry_run) if "ruff check" in line)
    pytest = next(i for i, line in enumerate(dry_run) if "pytest" in line)
    assert ruff < pytest
    present = [d for d in ("src", "tests", "scripts", "benchmarks", "examples") if (REPO / d).is_dir()]
    assert dry_run[ruff].split("ruff check", 1)[1].split() == present


def test_no_tracked_file_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=REPO, check=True,
                             timeout=60).stdout.split()
    offenders = []
    for name in tracked:
        if not name.endswith(TEXT_SUFFIXES) or name == "tests/test_repository.py":
            continue
        text = (REPO / name).read_text(errors="replace")
        offenders += [f"{name}: {ref}" for ref in OUTSIDE_REFERENCES if ref in text]
    assert offenders == []
