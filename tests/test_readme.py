"""Every code block of README.md runs as written: ```python blocks with this checkout's `python`, ```sh blocks
with bash and a `dsv4` command, each in a fresh process in an empty directory. When a ```text block follows,
it is the expected stdout (`...` stands for any text, as in doctest). A block that cannot run here says so
on its first line (`# not run: <reason>`); there are only a few of those."""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RUNNABLE = ("python", "sh")
NOT_RUN_MARK = "# not run"
MAX_NOT_RUN = 3  # the set-up commands, a user's own checkpoint, a long-lived server; more would hollow out this test
BLOCK_TIMEOUT_S = 600  # `dsv4 eval` on a contended two-core machine; typical blocks take seconds
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```\n", re.S | re.M)


@dataclass(frozen=True)
class Block:
    language: str
    code: str
    line: int  # 1-based line of the opening fence
    expected: str | None  # the ```text block right after it, if any

    @property
    def runs(self) -> bool:
        return self.language in RUNNABLE and not self.code.startswith(NOT_RUN_MARK)


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, each with the text block that directly follows it."""
    fences = list(_FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        following = fences[i + 1] if i + 1 < len(fences) else None
        expected = None
        if following is not None and following.group(1) == "text" and not text[fence.end():following.start()].strip():
            expected = following.group(2)
        blocks.append(Block(fence.group(1), fence.group(2), text.count("\n", 0, fence.start()) + 1, expected))
    return blocks


BLOCKS = [b for b in readme_blocks(README.read_text()) if b.language in RUNNABLE]


def test_readme_has_runnable_python_and_shell_blocks_and_few_unrun_ones():
    assert sum(b.runs and b.language == "python" for b in BLOCKS) >= 4
    assert sum(b.runs and b.language == "sh" for b in BLOCKS) >= 2
    assert sum(not b.runs for b in BLOCKS) <= MAX_NOT_RUN


def _environment(tmp_path: Path) -> dict[str, str]:
    """This checkout's sources first on the path, and a `dsv4` command that runs them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "dsv4"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dsv4 "$@"\n')
    wrapper.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO / "src")
    return env


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.runs], ids=lambda b: f"{b.language}-line{b.line}")
def test_readme_block_runs(block: Block, tmp_path: Path):
    work = tmp_path / "work"
    work.mkdir()
    command = [sys.executable, "-"] if block.language == "python" else ["bash", "-e", "-"]
    result = subprocess.run(command, input=block.code, capture_output=True, text=True, cwd=work,
                            env=_environment(tmp_path), timeout=BLOCK_TIMEOUT_S)
    assert result.returncode == 0, f"README.md line {block.line}:\n{result.stdout}\n{result.stderr}"
    if block.expected is not None:
        checker = doctest.OutputChecker()
        assert checker.check_output(block.expected, result.stdout, doctest.ELLIPSIS), (
            f"README.md line {block.line}: expected\n{block.expected}\ngot\n{result.stdout}"
        )


def test_block_parser_pairs_expected_output():
    """The parser itself: a text block right after a code block is its expected output, and only then."""
    text = "```python\nprint(1)\n```\n\n```text\n1\n```\n\nprose\n\n```sh\necho 2\n```\nmore prose\n```text\nx\n```\n"
    python, text_block, sh, _ = readme_blocks(text)
    assert python.expected == "1\n" and python.line == 1 and sh.expected is None and text_block.language == "text"
