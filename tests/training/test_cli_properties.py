"""Property-based: bad command lines end in one stderr line naming the argument and exit code 2, never a traceback.

Generated arguments go through ``main()`` in-process (fast); a few real subprocesses check
what a user's shell sees.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from bad_input import ANY_VALUE, ODD_KEYS, yaml_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.training.cli import main

NUMBER_TEXT = st.one_of(
    st.sampled_from(["inf", "-inf", "nan", "-1", "0", "2.5", "1e9", "abc", "", "0x10", "True", "-0.0", "1e-300"]),
    st.integers(min_value=-(10**6), max_value=10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)
FLAGS = ["--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed"]


def one_line_error(captured) -> str:
    # transformers' own progress bar while it loads weights is not an error line
    err = "\n".join(line for line in captured.err.strip().splitlines() if "Loading weights" not in line).strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def test_generate_with_any_numeric_argument_works_or_names_it(tiny_target_dir, capsys):
    @settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(FLAGS), NUMBER_TEXT)
    def check(flag, value):
        argv = ["generate", "--target", str(tiny_target_dir), "--prompt", "the fox", "--max-new-tokens", "3", flag, value, "--json"]
        try:
            code = main(argv)
        except SystemExit as done:  # argparse's own refusal (a value of the wrong type)
            code = done.code
        captured = capsys.readouterr()
        if code == 0:
            return
        assert code == 2
        err = one_line_error(captured)
        assert flag in err or flag.lstrip("-").replace("-", "_") in err, err

    check()


def test_eval_with_any_override_works_or_names_it(tiny_target_dir, tmp_path_factory, capsys):
    root = tmp_path_factory.mktemp("eval_cli")
    domain = root / "code.jsonl"
    domain.write_text('{"prompt": "def add(a, b):\\n    return a + b\\n"}\n')
    config = root / "eval.yaml"
    config.write_text(yaml.safe_dump({"target": str(tiny_target_dir), "domains": {"code": str(domain)}, "output_dir": str(root / "out")}))
    keys = st.one_of(
        st.sampled_from(["num_prompts", "prompt_tokens", "max_new_tokens", "temperature", "top_p", "threads", "peers"]), ODD_KEYS
    )

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(keys, ANY_VALUE)
    def check(key, value):
        code = main(
            ["eval", "--config", str(config), f"{key}={yaml_text(value)}", "--no-progress", "num_prompts=1", "max_new_tokens=2"][:5]
        )
        captured = capsys.readouterr()
        if code == 0:
            return
        assert code == 2
        err = one_line_error(captured)
        assert key.strip() in err or repr(key.strip())[1:-1] in err or "override" in err, err

    check()


@pytest.mark.parametrize(
    "argv, names",
    [
        (["generate", "--target", "/nonexistent/model", "--prompt", "x"], "/nonexistent/model"),
        (["eval", "--config", "recipes/eval/demo.yaml", "num_prompts=eight"], "num_prompts"),
        (["demo", "--num-prompts", "0"], "num_prompts"),
        (["generate", "--target", "recipes/models/demo_target", "--prompt", "x", "--top-k", "2.5"], "--top-k"),
    ],
)
def test_a_users_shell_sees_one_line_and_exit_code_2(argv, names):
    done = subprocess.run([sys.executable, "-m", "draftsmith.training.cli", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and "Loading weights" not in line]
    assert len(lines) == 1 and names in lines[0] and "Traceback" not in done.stderr, done.stderr[-2000:]
