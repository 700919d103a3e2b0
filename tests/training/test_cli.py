"""The draftsmith command line."""

from __future__ import annotations

import json

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
