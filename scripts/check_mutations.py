"""Mutation check for the weight lifecycle: each mutation below breaks one rule of the contract (skip a
finalize step, rebind a tensor instead of copying into it, write where the model no longer reads); the
lifecycle tests must catch every one.

For each mutation the source tree is copied, one exact line is rewritten, and the lifecycle tests run
against the copy. Exit status 0 means every mutation made at least one test fail.

    python scripts/check_mutations.py [--tests tests/test_lifecycle.py ...]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TESTS = ("tests/test_lifecycle.py",)
TIMEOUT_S = 600


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to src/dsv4
    original: str  # must occur exactly once
    mutated: str


MUTATIONS = (
    Mutation(
        "finalize skips the derived-tensor copy",
        "model/derived.py",
        "            target.copy_(value)\n",
        "            pass\n",
    ),
    Mutation(
        "finalize rebinds the derived buffer instead of copying into it",
        "model/derived.py",
        "            target.copy_(value)\n",
        "            self.register_buffer(derived.name, value, persistent=False)\n",
    ),
    Mutation(
        "the loader never finalizes",
        "weights/loader.py",
        "    loaded.ignored = writer.ignored\n    loaded.finalize()\n",
        "    loaded.ignored = writer.ignored\n    for model in loaded.models.values():\n        model._ready = True\n",
    ),
    Mutation(
        "drafters are never finalized",
        "weights/loader.py",
        "        for role in (TARGET, *DRAFTERS):\n",
        "        for role in (TARGET,):\n",
    ),
    Mutation(
        "the writer rebinds parameter storage instead of copying",
        "weights/convert.py",
        "        dest.copy_(value)\n        return\n",
        "        dest.data = value.clone()\n        return\n",
    ),
    Mutation(
        "the writer rebinds expert storage instead of copying",
        "weights/slots.py",
        "            slot = Slot(native, role, param_name, experts.format, param, views[e], scale,\n",
        "            slot = Slot(native, role, param_name, experts.format, param, param.detach().clone()[e], scale,\n",
    ),
    Mutation(
        "the weight plan outlives the storage it points into",
        "weights/loader.py",
        "        if not self._routes.table.addresses.items() <= addresses.items():\n",
        "        if False:\n",
    ),
    Mutation(
        "a tensor placed in the model's storage is never read from its file",
        "weights/checkpoint.py",
        "        done = first + os.preadv(fd, views, start + first)\n",
        "        done = stop\n",
    ),
    Mutation(
        "the writer takes every value for one already in its destination",
        "weights/writer.py",
        "        if not _in_place(dest, value):\n            copy_into(dest, value)\n",
        "        pass\n",
    ),
    Mutation(
        "an atomic commit skips the staged values it copies as raw bytes",
        "weights/writer.py",
        "        return copy_bytes_streamed(copies)\n",
        "        return True\n",
    ),
    Mutation(
        "forward does not check readiness",
        "model/deepseek_v4.py",
        "        self.require_ready()\n        cache.begin_step",
        "        cache.begin_step",
    ),
)


def apply(mutation: Mutation, tree: Path) -> None:
    path = tree / "src" / "dsv4" / mutation.file
    text = path.read_text()
    count = text.count(mutation.original)
    if count != 1:
        raise SystemExit(f"mutation {mutation.name!r}: expected one match in {mutation.file}, found {count}")
    path.write_text(text.replace(mutation.original, mutation.mutated))


def tests_fail(tree: Path, tests: tuple[str, ...]) -> bool:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    result = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    return result.returncode != 0


def caught(mutation: Mutation, tests: tuple[str, ...]) -> bool:
    """Whether `tests` fail on a copy of the sources with `mutation` applied."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp)
        shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        shutil.copytree(ROOT / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
        apply(mutation, tree)
        return tests_fail(tree, tests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", nargs="+", default=list(DEFAULT_TESTS))
    args = parser.parse_args(argv)
    tests = tuple(args.tests)
    # One test process per core: each spends most of its time single-threaded (start-up, small models), so
    # the mutations run side by side in about half the time on two cores.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        outcomes = list(pool.map(lambda mutation: caught(mutation, tests), MUTATIONS))
    survivors = []
    for mutation, was_caught in zip(MUTATIONS, outcomes, strict=True):
        print(f"{'caught  ' if was_caught else 'SURVIVED'}  {mutation.name}")
        if not was_caught:
            survivors.append(mutation.name)
    if survivors:
        print(f"{len(survivors)} mutation(s) survived the lifecycle tests: {survivors}")
        return 1
    print(f"all {len(MUTATIONS)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
