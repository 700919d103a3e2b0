"""MTP modules: drafting equals the teacher-forced modules at every step, greedy identity on two
architectures (separate modules and recursive reuse), the sampled law with a negative control,
checkpoints and bad input.

The modules are fitted briefly by the MTP objective on the target's greedy continuations,
so that drafts are accepted often and rejected often.
"""

from __future__ import annotations

import json

import pytest
import torch
from heads import fit, greedy_sequences, tiny_qwen2
from law import V, assert_follows_law, assert_follows_law_deciding, assert_law_rejects, control_decisions
from safetensors.torch import load_file, save_file

import draftsmith.verify.rejection as rejection
from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.mtp import MtpProposer
from draftsmith.training.mtp import MtpObjective
from draftsmith.verify import SpeculativeDecoder

N_LAW = 1200
N_CONTROL = 1500


def fit_modules(target, num_modules: int = 3, steps: int = 120):
    return fit(MtpObjective(num_modules=num_modules), target, greedy_sequences(target), lr=3e-3, steps=steps, build_seed=0)


def random_prompts(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 128, (count, 6), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def targets(make_llama):
    return {"llama": make_llama(layers=2), "qwen2": tiny_qwen2(layers=2)}


@pytest.fixture(scope="module")
def modules(targets):
    return {arch: fit_modules(target) for arch, target in targets.items()}


class Checked(MtpProposer):
    """Checks every chain against the modules run teacher-forced over the context plus the chain."""

    def __init__(self, modules, target, **kwargs):
        super().__init__(modules, target=target, **kwargs)
        self.target, self.checked = target, 0

    def propose(self, context):
        draft = super().propose(context)
        tokens, n = context.tokens, len(context.tokens)
        guesses = draft.token_ids.tolist()[: self.num_modules]
        if not guesses:
            return draft
        sequence = torch.tensor([tokens + guesses])
        with torch.no_grad():
            hidden = self.target(sequence[:, : n - 1], output_hidden_states=True).hidden_states[-1].float()
            for m, guess in enumerate(guesses):
                rows = n - 1  # positions 0 .. n - 2; row p reads token p + m + 1
                hidden = self.modules.causal(m, sequence[:, m + 1 : m + 1 + rows], hidden[:, :rows])
                logits = self.modules.logits(m, hidden[0, -1])
                assert int(logits.argmax()) == guess, (n, m)
                assert draft.scores[m] == pytest.approx(float(logits.float().softmax(-1).max()), rel=1e-4)  # its own confidence
        self.checked += 1
        return draft


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_drafts_equal_the_teacher_forced_modules_at_every_step(arch, targets, modules):
    target = targets[arch]
    proposer = Checked(modules[arch], target)
    for prompt in random_prompts(3, seed=7):
        SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt[None], max_new_tokens=30)
    assert proposer.checked >= 15


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(("k", "recursive", "width"), [(3, False, 1), (2, False, 1), (5, True, 1), (3, False, 2)])
def test_greedy_is_token_identical_to_plain(arch, k, recursive, width, targets, modules):
    target = targets[arch]
    proposer = MtpProposer(modules[arch], k=k, recursive=recursive, tree_width=width, max_nodes=8, target=target)
    decoder = SpeculativeDecoder(target, proposer, adaptive=False)
    plain = SpeculativeDecoder(target)
    accepted = 0
    for prompt in random_prompts(4, seed=3):
        result = decoder.generate(prompt[None], max_new_tokens=32)
        assert result.new_tokens == plain.generate(prompt[None], max_new_tokens=32).new_tokens
        accepted += sum(result.stats.accept_lengths)
    assert accepted > 0


@pytest.fixture(scope="module")
def law_setup(make_llama):
    target = make_llama(vocab_size=V, hidden_size=16, layers=2, seed=5)
    return target, fit_modules(target, num_modules=2, steps=80)


@pytest.mark.parametrize(("temperature", "width"), [(0.7, 1), (1.0, 1), (1.0, 2)])
def test_sampled_output_follows_the_target_law(temperature, width, law_setup, law_check):
    """Chains and sampled trees (siblings drawn without replacement, with their true distributions)."""
    target, fitted = law_setup
    sampling = SamplingParams(temperature)
    accepted = assert_follows_law(target, MtpProposer(fitted, tree_width=width, target=target), sampling, N_LAW, law_check)
    assert 0.05 < sum(a > 0 for a in accepted) / len(accepted) < 0.95  # first drafts accepted and rejected


@pytest.mark.parametrize(("temperature", "width"), [(0.7, 1), pytest.param(1.0, 2, marks=pytest.mark.slow)])
def test_sampled_output_follows_the_target_law_with_the_controller_deciding(temperature, width, law_setup, law_check):
    target, fitted = law_setup
    assert_follows_law_deciding(target, MtpProposer(fitted, tree_width=width, target=target), SamplingParams(temperature), N_LAW, law_check)


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
def test_negative_control_broken_residual_fails_the_law_test(decisions, law_setup, law_check, monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs, token: target_probs)
    target, fitted = law_setup
    sampling = SamplingParams(1.0)
    proposer = MtpProposer(fitted, target=target)
    controller, n = control_decisions(decisions, proposer, N_CONTROL)
    assert_law_rejects(target, proposer, sampling, n, law_check, controller)


def test_save_load_and_bad_checkpoints(targets, modules, make_llama, tmp_path):
    target = targets["llama"]
    modules["llama"].save(tmp_path / "mtp")
    loaded = load_proposer({"type": "mtp", "model": str(tmp_path / "mtp")}, target=target)
    for name, tensor in modules["llama"].state_dict().items():
        assert torch.equal(loaded.modules.state_dict()[name], tensor)
    with pytest.raises(InputError, match="deeper than the 3 MTP module"):
        load_proposer({"type": "mtp", "model": str(tmp_path / "mtp"), "k": 4}, target=target)
    with pytest.raises(InputError, match="MTP modules trained for a target of hidden size 32, this target's is 16"):
        load_proposer({"type": "mtp", "model": str(tmp_path / "mtp")}, target=make_llama(hidden_size=16))
    with pytest.raises(InputError, match="trained for a target of vocabulary 128, this target's is 64"):
        load_proposer({"type": "mtp", "model": str(tmp_path / "mtp")}, target=make_llama(vocab_size=64))
    with pytest.raises(InputError, match="recursive reuse drafts chains"):
        load_proposer({"type": "mtp", "model": str(tmp_path / "mtp"), "k": 4, "recursive": True, "tree_width": 2}, target=target)
    with pytest.raises(InputError, match="load them with the target"):
        load_proposer({"type": "mtp", "model": str(tmp_path / "mtp")})
    tensors = load_file(str(tmp_path / "mtp" / "model.safetensors"))
    del tensors["layers.2.eh_proj.weight"]
    save_file(tensors, str(tmp_path / "mtp" / "model.safetensors"))
    with pytest.raises(InputError, match=r"layers\.2\.eh_proj\.weight"):
        load_proposer({"type": "mtp", "model": str(tmp_path / "mtp")}, target=target)


def test_bad_objective_settings_are_refused():
    for kwargs, message in (({"num_modules": 0}, "num_modules"), ({"loss": "mse"}, "draft.loss"), ({"decay": -1.0}, "draft.decay")):
        with pytest.raises(InputError, match=message):
            MtpObjective(**kwargs)


# ---------------------------------------------------------------------------------------
# Modules shipped inside a model checkpoint


def write_native(modules, directory, layout: str, base_layers: int = 2):
    """``modules``' tensors renamed to ``layout``'s names, in a checkpoint directory whose config announces them."""
    from draftsmith.proposers.mtp_native import BIASES, BLOCK, LAYOUTS

    prefix, own, shared, hidden_first = LAYOUTS[layout]
    state = modules.state_dict()
    out = {}
    for i in range(modules.cfg.num_modules):
        where = prefix.format(n=base_layers + i, i=i)
        out |= {f"{where}{name}": state[f"layers.{i}.{name}"] for name in BLOCK + BIASES if f"layers.{i}.{name}" in state}
        for theirs, ours in (own | shared).items():
            tensor = state[f"layers.{i}.{ours}.weight"]
            if hidden_first and ours == "eh_proj":
                embed, hidden = tensor.chunk(2, dim=1)
                tensor = torch.cat([hidden, embed], dim=1)
            out[f"{where}{theirs}.weight" if theirs in own else f"{theirs}.weight"] = tensor
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, str(directory / "model-mtp.safetensors"))
    config = {"model_type": layout, "num_hidden_layers": base_layers, "num_nextn_predict_layers": modules.cfg.num_modules}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("layout", ["deepseek_v3", "qwen3_next", "mimo"])
def test_native_layouts_load_and_draft_as_the_modules_written(layout, targets, modules, tmp_path):
    target = targets["llama"]
    source = modules["llama"] if layout != "qwen3_next" else fit_modules(target, num_modules=1, steps=40)  # one shared fc / norms
    directory = write_native(source, tmp_path / layout, layout)
    loaded = load_proposer({"type": "mtp", "model": str(directory)}, target=target)
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.modules.state_dict()[name], tensor), name
    reference = MtpProposer(source, target=target)
    for prompt in random_prompts(3, seed=11):
        drafted = SpeculativeDecoder(target, loaded, adaptive=False).generate(prompt[None], max_new_tokens=24)
        assert (
            drafted.stats.accept_lengths
            == SpeculativeDecoder(target, reference, adaptive=False).generate(prompt[None], max_new_tokens=24).stats.accept_lengths
        )


def test_native_checkpoints_that_do_not_hold_what_they_announce_are_refused(targets, modules, tmp_path):
    target = targets["llama"]
    directory = write_native(modules["llama"], tmp_path / "short", "deepseek_v3")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 4}))
    with pytest.raises(InputError, match=r"announces 4 MTP module\(s\).*lack \['model\.layers\.5\."):
        load_proposer({"type": "mtp", "model": str(directory)}, target=target)
    tensors = load_file(str(directory / "model-mtp.safetensors"))
    tensors["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(directory / "model-mtp.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError, match="MLA attention or MoE experts"):
        load_proposer({"type": "mtp", "model": str(directory)}, target=target)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "num_nextn_predict_layers": 1}))
    save_file({"model.norm.weight": torch.ones(4)}, str(directory / "model-mtp.safetensors"))
    with pytest.raises(InputError, match="no known layout"):
        load_proposer({"type": "mtp", "model": str(directory)}, target=target)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vllm_export_is_the_target_with_its_modules_in_mimos_layout(arch, targets, modules, tmp_path):
    """The export loads back (the native MiMo reader) as the same modules, and as a Qwen2 it computes the target's logits."""
    from transformers import AutoModelForCausalLM

    target = targets[arch]
    proposer = MtpProposer(modules[arch], k=1, target=target)
    exported = proposer.export(tmp_path / "mimo")
    assert exported.speculative_config == {"method": "mtp", "num_speculative_tokens": 1} and exported.model == tmp_path / "mimo"
    assert exported.serve_commands("ignored")[0].startswith(f"vllm serve {tmp_path / 'mimo'} ")  # the engine serves the export
    config = json.loads((tmp_path / "mimo" / "config.json").read_text())
    assert (config["architectures"], config["model_type"], config["num_nextn_predict_layers"]) == (["MiMoForCausalLM"], "qwen2", 3)
    written = load_file(str(tmp_path / "mimo" / "model.safetensors"))
    assert {"model.mtp_layers.0.input_proj.weight", "model.mtp_layers.2.final_layernorm.weight"} <= set(written)
    assert "model.mtp_layers.0.self_attn.q_proj.bias" in written and "model.layers.1.self_attn.v_proj.bias" in written
    back = MtpProposer(str(tmp_path / "mimo"), target=target)
    for name, tensor in modules[arch].state_dict().items():
        assert torch.equal(back.modules.state_dict()[name], tensor), name
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "mimo", dtype=torch.float32).eval()
    assert type(served).__name__ == "Qwen2ForCausalLM"
    ids = random_prompts(2, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(served(ids).logits, target(ids).logits, rtol=1e-5, atol=1e-5)


def test_vllm_export_warns_past_depth_one_and_refuses_what_mimo_cannot_hold(targets, modules, tmp_path):
    from heads import tiny_neox

    with pytest.warns(UserWarning, match="drafts every depth with module 1"):
        MtpProposer(modules["llama"], k=3, target=targets["llama"]).export(tmp_path / "deep")
    with pytest.raises(InputError, match=r"exports to \['vllm'\], got format 'sglang'"):
        MtpProposer(modules["llama"], k=1, target=targets["llama"]).export(tmp_path / "x", format="sglang")
    with pytest.raises(InputError, match="load the proposer with the target"):
        MtpProposer(modules["llama"], k=1).export(tmp_path / "y")
    neox = tiny_neox(layers=2)
    with pytest.raises(InputError, match=r"a 'gpt_neox' target .* cannot be written in it; targets of types \['llama', 'qwen2'\]"):
        from draftsmith.proposers.mtp_native import mimo_checkpoint

        mimo_checkpoint(modules["llama"], neox)
    assert not (tmp_path / "y").exists() and not (tmp_path / ".y.partial").exists()
