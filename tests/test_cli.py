"""The `dsv4` command line as a user meets it: fast help with every option's default, a version, one line and
exit status 2 for every user error (a traceback only with --debug), embedded models by name in every command,
convert keeping the source's formats and saying what it wrote, generate's per-prompt errors and speed line,
eval's argument checks and progress, and progress display (bar on a terminal, log lines otherwise)."""

from __future__ import annotations

import argparse
import io
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import dsv4
from dsv4.cli import COMMANDS, EXIT_OK, EXIT_USAGE, build_parser, main
from dsv4.embedded import EMBEDDED_MODELS
from dsv4.progress import Progress

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
SUBPROCESS_TIMEOUT_S = 300  # a generous bound on a contended machine; the commands take seconds


def _run(*args: str) -> subprocess.CompletedProcess:
    """`python -m dsv4 ARGS` as a user runs it (this checkout's sources first on the path)."""
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=SUBPROCESS_TIMEOUT_S, cwd=REPO)


# ---- help, version ----
@pytest.mark.parametrize("command", [None, *(c.name for c in COMMANDS)])
def test_help_imports_no_torch(command):
    """`dsv4 --help` and every `dsv4 COMMAND --help` run without importing torch (what keeps them fast)."""
    args = ["--help"] if command is None else [command, "--help"]
    result = _run("-X", "importtime", "-m", "dsv4", *args)
    assert result.returncode == EXIT_OK, result.stderr
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "torch" not in imported and "dsv4.cli" in imported
    assert result.stdout.startswith("usage: dsv4")


def test_version_is_the_package_version():
    result = _run("-m", "dsv4", "--version")
    assert result.returncode == EXIT_OK and result.stdout.strip() == f"dsv4 {dsv4.__version__}"
    pyproject = (REPO / "pyproject.toml").read_text()  # the package version has one definition
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "dsv4.__version__" }' in pyproject


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser([command])
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


@pytest.mark.parametrize("command", [c.name for c in COMMANDS])
def test_every_option_has_help_with_its_default(command):
    parser = _subparser(command)
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction) or action.dest == "debug":
            continue
        assert action.help, f"{command} {action.option_strings}: no help text"
        if not action.required:
            assert f"(default: {action.default})" in " ".join(text.split()), (command, action.option_strings)


# ---- user errors: one line, exit 2; --debug adds the traceback ----
USER_ERRORS = {
    "eval --n 0": (["eval", "--n", "0"], "argument --n: must be a positive integer, got 0"),
    "eval --n -3": (["eval", "--n", "-3"], "argument --n: must be a positive integer, got -3"),
    "generate --max-tokens 0": (["generate", "--max-tokens", "0"], "--max-tokens: must be a positive integer"),
    "generate --temperature inf": (["generate", "--temperature", "inf"], "finite number >= 0, got inf"),
    "missing model": (["generate", "--model", "/nonexistent/ckpt"], "'/nonexistent/ckpt': no such directory"),
    "generate narrower activations": (["generate", "--dtype", "float32", "--activation-dtype", "bfloat16"],
                                      "activation_dtype: 'bfloat16' is narrower than dtype 'float32'"),
    "inspect missing dir": (["inspect", "/nonexistent/ckpt"], "no such directory"),
    "convert hf fp8": (["convert", "dsv4-tiny-dummy", "{tmp}/out", "--layout", "hf", "--experts", "fp8"],
                       "--layout hf stores every tensor in float: --experts fp8 needs --layout native"),
    "convert hf dense fp8": (["convert", "dsv4-tiny-dummy", "{tmp}/out", "--layout", "hf", "--dense", "fp8"],
                             "--dense fp8 needs --layout native"),
    "convert into a checkpoint": (["convert", "dsv4-tiny-dummy", "{sort}", "--layout", "native"],
                                  "already holds a checkpoint"),
    "convert into a file": (["convert", "dsv4-tiny-dummy", "{tmp}/file/out", "--layout", "native"],
                            "is not a directory"),
    "unknown command": (["bogus"], "invalid choice: 'bogus'"),
}


@pytest.mark.parametrize("case", list(USER_ERRORS))
def test_user_error_is_one_line_and_exit_status_2(case, tmp_path, capsys, no_weight_loading):
    args, expected = USER_ERRORS[case]
    (tmp_path / "file").write_text("not a directory")
    args = [a.format(tmp=tmp_path, sort=EMBEDDED_MODELS["dsv4-sort"].path) for a in args]
    code = main(args)
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert expected in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_the_installed_entry_point_prints_one_line_and_debug_the_traceback():
    plain = _run("-m", "dsv4", "inspect", "/nonexistent/ckpt")
    assert plain.returncode == EXIT_USAGE
    assert plain.stderr == "dsv4 inspect: error: model '/nonexistent/ckpt': no such directory, and not an " \
                           "embedded model's name (dsv4-sort, dsv4-sort-bf16, dsv4-sort-dspark, dsv4-tiny-dummy)\n"
    debug = _run("-m", "dsv4", "inspect", "/nonexistent/ckpt", "--debug")
    assert debug.returncode == EXIT_USAGE
    assert "Traceback (most recent call last)" in debug.stderr and "ConfigError" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.strip()


# ---- generate ----
def test_a_reader_that_stops_early_is_not_an_error():
    """`dsv4 inspect ... | true`: the reader exits before the first line is written (the command must first
    read the checkpoint), so every write meets a closed pipe; that ends the command quietly."""
    dsv4_bin = Path(sys.executable).with_name("dsv4")
    done = subprocess.run(f"'{dsv4_bin}' inspect dsv4-sort | true; echo status $PIPESTATUS", shell=True,
                          executable="/bin/bash", capture_output=True, text=True, timeout=120)
    assert done.stderr == "" and done.stdout.strip() == "status 0", (done.stdout, done.stderr)


def test_generate_reports_a_rejected_prompt_in_its_place(capsys):
    """Out-of-vocabulary ids reject that prompt only: its error is printed where its answer would be, the
    others are answered, and the exit status says something was rejected."""
    code = main(["generate", "9999,3", "5,6,7", "--model", "dsv4-tiny-dummy", "--max-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == EXIT_USAGE
    lines = out.splitlines()
    assert lines[0] == "prompt: 9999,3"
    assert lines[1].startswith("error: request ")
    assert "token id 9999 at position 0 is outside the vocabulary [0, 512)" in lines[1]
    assert lines[2] == "prompt: 5,6,7" and lines[3].startswith("answer: ")
    assert "1 of 2 prompt(s) rejected" in err and "Traceback" not in err


def test_generate_speed_line_separates_load_first_token_and_decode(capsys):
    assert main(["generate", "sort 321=", "sort 9=", "--max-tokens", "8"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "answer: 123  [stop]" in out and "answer: 9  [stop]" in out
    speed = out.splitlines()[-1]
    parts = speed.split("; ")
    assert parts[0].startswith("load ") and parts[1].startswith("first token ")
    assert parts[2].startswith("decode ") and parts[2].endswith("tok/s)") and parts[3] == "weights version 0"


def test_generate_with_bf16_weights_and_fp32_activations(capsys):
    assert main(["generate", "sort 321=", "--dtype", "bfloat16", "--activation-dtype", "float32",
                 "--max-tokens", "8"]) == EXIT_OK
    assert "answer: 123  [stop]" in capsys.readouterr().out


def test_generate_with_the_mtp_drafter_prints_its_acceptance(capsys):
    assert main(["generate", "sort 86420135=", "--draft", "mtp", "--num-speculative-tokens", "2",
                 "--max-tokens", "12"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "answer: 01234568  [stop]" in out
    line = next(line for line in out.splitlines() if line.startswith("speculation (k=2): "))
    assert "drafts accepted" in line and "acceptance per draft position [" in line


def test_generate_answers_in_prompt_order_with_duplicate_prompts(capsys):
    prompts = ["sort 21=", "sort 8=", "sort 21=", "sort 543="]
    assert main(["generate", *prompts, "--max-tokens", "6"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    answers = [line.split()[1] for line in lines if line.startswith("answer: ")]
    assert [line[len("prompt: "):] for line in lines if line.startswith("prompt: ")] == prompts
    assert answers == ["12", "8", "12", "345"]


# ---- embedded models by name ----
@pytest.mark.parametrize("name", list(EMBEDDED_MODELS))
def test_inspect_takes_embedded_models_by_name(name, capsys):
    assert main(["inspect", name, "--json"]) == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(EMBEDDED_MODELS[name].path) and report["loadable"]
    assert report["load_format"] == EMBEDDED_MODELS[name].load_format
    tokenizer_expected = name != "dsv4-tiny-dummy"
    assert (report["companion_files"]["tokenizer_tokens"] is not None) == tokenizer_expected
    assert report["companion_files"]["chat_template"] == tokenizer_expected


def _dtypes(path: Path) -> dict[str, str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


def test_convert_keeps_the_source_formats_and_says_what_it_wrote(tmp_path, capsys):
    """The release-format default model converted with no format options: FP8 dense linears stay FP8, FP4
    experts stay FP4, bit for bit; the summary says so, read back from the written files."""
    source = EMBEDDED_MODELS["dsv4-sort"].path
    assert main(["convert", "dsv4-sort", str(tmp_path / "out"), "--layout", "native"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "dense linears: FP8 e4m3 with block scales (kept from the source)" in out
    assert "routed experts: fp4 (kept from the source)" in out and "loadable: yes" in out
    written, original = _dtypes(tmp_path / "out"), _dtypes(source)
    assert written["layers.0.attn.wq_a.weight"] == original["layers.0.attn.wq_a.weight"] == "F8_E4M3"
    assert written["layers.1.ffn.experts.3.w2.weight"] == "I8"
    with safe_open(str(source / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as b:
        for name in ("layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "layers.1.ffn.experts.3.w2.weight"):
            assert a.get_tensor(name).view(torch.uint8).equal(b.get_tensor(name).view(torch.uint8)), name
    assert (tmp_path / "out" / "tokenizer_config.json").exists()


def test_convert_to_hf_says_what_it_dequantized(tmp_path, capsys):
    assert main(["convert", "dsv4-sort", str(tmp_path / "hf"), "--layout", "hf"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "dense linears: bfloat16 (dequantized from the source's FP8: the HF layout holds floats only)" in out
    assert "routed experts: dense (bfloat16) (dequantized from the source's fp4" in out
    assert _dtypes(tmp_path / "hf")["model.layers.0.self_attn.q_a_proj.weight"] == "BF16"


def test_convert_refuses_an_unwritable_destination_before_loading(tmp_path, capsys, no_weight_loading):
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    assert main(["convert", "dsv4-sort", str(blocked / "out"), "--layout", "native"]) == EXIT_USAGE
    assert "cannot be created" in capsys.readouterr().err


# ---- inspect: what a load would refuse besides tensors ----
def test_inspect_and_load_reject_a_broken_tokenizer_naming_it(tmp_path, capsys, no_weight_loading):
    broken = tmp_path / "broken"
    shutil.copytree(EMBEDDED_MODELS["dsv4-sort"].path, broken)
    (broken / "tokenizer.json").write_text('{"model": "truncated')
    assert main(["inspect", str(broken)]) == EXIT_USAGE
    out = capsys.readouterr().out
    assert f"{broken / 'tokenizer.json'}: not a valid tokenizer" in out and "loadable: no" in out
    from dsv4 import LLM
    from dsv4.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tokenizer\.json: not a valid tokenizer"):
        LLM(broken)  # before any weight loads (no_weight_loading)


# ---- eval ----
def test_eval_logs_each_variant(caplog):
    from dsv4.evaluate import evaluate

    with caplog.at_level(logging.INFO, logger="dsv4"):
        result = evaluate(n=2, variants=("bf16",))
    assert result.n == 2 and set(result.accuracy) == {"bf16"}
    assert any(r.getMessage().startswith("eval: bf16 (1/1) accuracy ") for r in caplog.records)


def test_eval_reports_speculative_acceptance():
    from dsv4.evaluate import evaluate, format_table

    result = evaluate(n=4, variants=("shipped",))
    spec = result.speculation
    assert spec["draft_tokens"] > 0 and 0 < spec["accepted_tokens"] <= spec["draft_tokens"]
    assert result.to_json()["speculation"] == spec
    assert "speculative decoding with it (k=3): acceptance " in format_table(result)


def test_eval_defaults_come_from_the_library():
    from dsv4 import evaluate

    parser = _subparser("eval")
    defaults = {a.dest: a.default for a in parser._actions}
    assert defaults["n"] == evaluate.DEFAULT_N and defaults["seed"] == evaluate.DEFAULT_SEED


# ---- progress display ----
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal(caplog):
    terminal = _Terminal()
    with caplog.at_level(logging.INFO, logger="dsv4"), Progress(3, "work", "item", stream=terminal) as progress:
        for _ in range(3):
            progress.update()
    assert "work" in terminal.getvalue() and "3/3" in terminal.getvalue()
    assert not caplog.records


def test_progress_is_periodic_log_lines_otherwise(caplog):
    pipe = io.StringIO()
    with caplog.at_level(logging.INFO, logger="dsv4"):
        with Progress(4, "work", "item", stream=pipe, log_interval_s=0.0) as progress:
            progress.update(2)
            progress.update(2)
        with Progress(4, "quiet", "item", stream=pipe, log_interval_s=3600.0) as progress:
            progress.update(4)  # shorter than one interval: no line at all
        with Progress(4, "off", "item", stream=pipe, log_interval_s=0.0, enabled=False) as progress:
            progress.update(4)
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(",")[0] for m in messages] == ["work: 2/4 item (50%)", "work: 4/4 item (100%)",
                                                   "work: 4/4 item (100%)"]
    assert pipe.getvalue() == ""
