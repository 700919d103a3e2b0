"""The draftsmith command line."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from draftsmith.training.cli import main


def test_generate_prints_json_with_stats(tiny_target_dir, tmp_path, capsys):
    config = tmp_path / "ngram.yaml"
    config.write_text(yaml.safe_dump({"type": "ngram", "min_n": 1}))
    argv = ["generate", "--target", str(tiny_target_dir), "--proposer", str(config), "--prompt", "the quick brown fox"]
    assert main(argv + ["--max-new-tokens", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 1 <= len(out["new_tokens"]) <= 12
    assert out["stats"]["target_forwards"] >= 1 and out["stats"]["tau"] >= 1.0
    # the same request without a proposer gives the same greedy text
    assert main(["generate", "--target", str(tiny_target_dir), "--prompt", "the quick brown fox", "--max-new-tokens", "12", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["new_tokens"] == out["new_tokens"]


def test_generate_warms_up_unless_told_not_to(tiny_target_dir, capsys):
    argv = ["generate", "--target", str(tiny_target_dir), "--prompt", "def add", "--max-new-tokens", "6", "--json"]
    runs = {}
    for flag in ([], ["--no-warm-up"]):
        assert main(argv + flag) == 0
        runs[bool(flag)] = json.loads(capsys.readouterr().out)
    assert runs[False]["warm_up_s"] > 0.0 and runs[True]["warm_up_s"] == 0.0
    assert runs[False]["new_tokens"] == runs[True]["new_tokens"]  # the warm-up changes nothing in the output
    assert main(argv[:-1]) == 0
    assert re.search(r"after a \d+ ms warm-up\]", capsys.readouterr().out)


def test_generate_text_output_and_errors(tiny_target_dir, tmp_path, capsys):
    assert main(["generate", "--target", str(tiny_target_dir), "--prompt", "def add", "--max-new-tokens", "5"]) == 0
    assert "target forwards" in capsys.readouterr().out
    assert main(["generate", "--target", str(tmp_path), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"type": "nope"}))
    assert main(["generate", "--target", str(tiny_target_dir), "--proposer", str(bad), "--prompt", "x"]) == 2
    assert "unknown proposer type 'nope'" in capsys.readouterr().err
    assert main(["generate", "--target", str(tiny_target_dir), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


def test_export_writes_the_engine_layout_and_prints_the_serve_line(tiny_target_dir, tmp_path, capsys):
    from safetensors.torch import load_file

    from draftsmith.proposers.medusa_head import MedusaHeads
    from draftsmith.verify import load_target

    target, _ = load_target(tiny_target_dir)
    heads = MedusaHeads.for_target(target, num_heads=2)
    heads.save(tmp_path / "heads")
    config = tmp_path / "medusa.yaml"
    config.write_text(yaml.safe_dump({"type": "medusa", "model": str(tmp_path / "heads"), "tree": [[0], [0, 0]]}))
    out = tmp_path / "vllm"
    argv = ["export", "--proposer", str(config), "--output", str(out), "--target", str(tiny_target_dir)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert f"vllm serve {tiny_target_dir} --speculative-config" in printed and '"method": "medusa"' in printed
    written = load_file(str(out / "model.safetensors"))
    assert all(json.loads((out / "config.json").read_text())[k] == v for k, v in heads.config().items())
    assert all(written[name].equal(tensor) for name, tensor in heads.state_dict().items())
    # bad input: one line, exit code 2, nothing written
    assert main(argv) == 2
    assert "is not empty" in capsys.readouterr().err
    assert main([*argv[:4], str(tmp_path / "other"), "--format", "tensorrt"]) == 2
    assert "exports to ['vllm'], got format 'tensorrt'" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    composite = tmp_path / "composite.yaml"
    composite.write_text(yaml.safe_dump({"type": "composite", "proposers": [{"type": "ngram"}, {"type": "suffix"}]}))
    assert main(["export", "--proposer", str(composite), "--output", str(tmp_path / "c")]) == 2
    assert "CompositeProposer has no engine export" in capsys.readouterr().err
    ngram = tmp_path / "ngram.yaml"  # a settings-only export: the engine's speculative_config
    ngram.write_text(yaml.safe_dump({"type": "ngram", "match": "earliest", "wrap": False}))
    assert main(["export", "--proposer", str(ngram), "--output", str(tmp_path / "n")]) == 0
    assert '"method": "ngram"' in capsys.readouterr().out
    assert json.loads((tmp_path / "n" / "speculative_config.json").read_text())["prompt_lookup_max"] == 4


def test_help_and_a_bad_flag_answer_without_importing_torch():
    """``draftsmith --help`` took 2 s importing torch; the parser answers before any import of it."""
    code = (
        "import sys\nfrom draftsmith.training.cli import main\n"
        "for argv in (['--help'], ['generate', '--bogus'], ['train', '--help']):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout[-500:] + done.stderr[-500:]


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "--prompt is empty"),
        ("   \n", "--prompt is empty"),
        ("caf\udce9 au lait", r"--prompt is not valid UTF-8 \(byte 0xe9 at character 3\)"),
    ],
)
def test_an_empty_or_undecodable_prompt_is_one_line(prompt, message, capsys):
    """A Latin-1 file through $(cat ...) reaches Python as lone surrogates; it used to end in a tokenizer traceback."""
    assert main(["generate", "--target", "no/such/dir", "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err
