"""EAGLE heads: training and drafting agree, greedy identity on three architectures, the sampled law, checkpoints, bad input.

Heads are fitted for a few seconds by the EAGLE objective's own losses on the target's
greedy continuations (``fit_draft``), so drafts are accepted often and rejected often.
The law tests compare the joint of 3 sampled tokens with the target's exact law
(``tests/law.py``; chi-square at alpha = 1e-3); a broken residual must fail the check.
"""

from __future__ import annotations

import json

import pytest
import torch
from heads import fit, greedy_sequences, tiny_neox, tiny_qwen2
from law import V, assert_follows_law, assert_follows_law_deciding, assert_law_rejects, control_decisions
from safetensors.torch import load_file, save_file

import draftsmith.verify.rejection as rejection
from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import ProposeContext
from draftsmith.proposers.eagle import EagleProposer
from draftsmith.proposers.eagle_head import checkpoint_config, config_for_target, default_aux_layers, draft_for_target
from draftsmith.training.capture import capture
from draftsmith.training.eagle import EagleObjective, unrolled_logits
from draftsmith.verify import SpeculativeDecoder

PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [3, 3, 3, 3], [100, 7, 64, 2, 90], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
VARIANTS = {  # name -> (version, draft_vocab_size, proposer keys)
    "eagle1": (1, None, {"k": 4}),
    "eagle2": (1, None, {"k": 4, "tree_width": 3, "max_nodes": 10}),
    "eagle3": (3, None, {"k": 4, "tree_width": 3, "max_nodes": 10}),
    "eagle3_reduced_vocab": (3, 96, {"k": 4, "tree_width": 3, "max_nodes": 10}),
}


def fit_draft(target, version: int, draft_vocab_size: int | None = None, steps: int = 120):
    """A draft fitted by the EAGLE objective's own loss to the target's greedy continuations."""
    objective = EagleObjective(version=version, draft_vocab_size=draft_vocab_size, ttt_steps=3)
    return fit(objective, target, greedy_sequences(target), lr=3e-3, steps=steps, build_seed=0)


@pytest.fixture(scope="module")
def targets(make_llama):
    return {"llama": make_llama(layers=4), "qwen2": tiny_qwen2(layers=4), "gpt_neox": tiny_neox(layers=4)}


@pytest.fixture(scope="module")
def drafts(targets):
    """(target name, variant) -> fitted draft, for the variants each test asks for (fitted once)."""
    cache = {}

    def get(arch: str, variant: str):
        version, vocab, _ = VARIANTS[variant]
        key = (arch, version, vocab)
        if key not in cache:
            cache[key] = fit_draft(targets[arch], version, vocab)
        return cache[key]

    return get


# ---------------------------------------------------------------------------------------
# Training and drafting compute the same thing


@pytest.mark.parametrize("kv_heads, bias", [(None, False), (1, True)])
def test_drafting_without_autograd_matches_the_modules_and_follows_weight_updates(kv_heads, bias):
    """The stacked q / k / v and gate / up copies give the modules' values (GQA, a missing bias), rebuilt after an optimizer step."""
    from draftsmith.proposers.core.draft_layers import MLP, Attention, rotate

    torch.manual_seed(0)
    attn, mlp = Attention(64, 32, 4, kv_heads or 4, 8, bias=bias), MLP(32, 48)
    if bias:
        attn.k_proj.bias = None  # one projection without a bias: zeros in the stacked copy
    x, h = torch.randn(1, 5, 64), torch.randn(1, 5, 32)
    angles = torch.randn(5, 8)
    cos, sin = angles.cos(), angles.sin()

    def by_modules():
        q = attn.q_proj(x).view(1, 5, attn.heads, 8).transpose(1, 2)
        k = attn.k_proj(x).view(1, 5, attn.kv_heads, 8).transpose(1, 2)
        v = attn.v_proj(x).view(1, 5, attn.kv_heads, 8).transpose(1, 2)
        return rotate(q, cos, sin), rotate(k, cos, sin), v, mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h))

    def fused():
        with torch.no_grad():
            return (*attn.qkv(x, cos, sin), mlp(h))

    for _ in range(2):
        with torch.no_grad():
            expected = by_modules()
        for got, want in zip(fused(), expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        stale = [t.clone() for t in fused()]
        optimizer = torch.optim.SGD([*attn.parameters(), *mlp.parameters()], lr=0.5)
        loss = sum(t.square().sum() for t in by_modules())
        loss.backward()
        optimizer.step()
    assert not torch.allclose(fused()[0], stale[0]), "the negative control: the step changed the weights"
    with torch.inference_mode():  # a head built under inference mode (its weights keep no version) drafts too
        built = Attention(64, 32, 4, kv_heads or 4, 8, bias=bias)
        if bias:
            built.k_proj.bias = None
        built.load_state_dict(attn.state_dict())
        torch.testing.assert_close(built.qkv(x, cos, sin)[2], attn.qkv(x, cos, sin)[2])


@pytest.mark.parametrize("draft_vocab_size", [None, 80])
def test_unrolled_training_steps_equal_the_drafts_chain(draft_vocab_size, make_llama):
    """Step j of the training-time test at the row before the root equals the proposer's depth j + 1 logits.

    The sequence continues with the draft's own greedy guesses, so the chain the proposer
    drafts is the one the unrolled steps read.
    """
    target = make_llama(layers=4, seed=3)
    cfg = config_for_target(target, 3, draft_vocab_size=draft_vocab_size)
    torch.manual_seed(4)
    draft = draft_for_target(cfg, target)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    if draft_vocab_size:
        draft.set_vocabulary(torch.randperm(128, generator=torch.Generator().manual_seed(5))[:draft_vocab_size])
    prompt = [5, 9, 17, 33, 5, 9, 17, 40]
    root = 12
    recorded = []
    proposer = EagleProposer(draft, target=target, k=3)
    original = proposer._target_logits
    proposer._target_logits = lambda hidden: recorded.append(original(hidden)) or recorded[-1]
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True)
    from draftsmith.proposers.core.types import TargetFeatures

    proposer.begin(prompt, TargetFeatures({layer: out.hidden_states[layer][0] for layer in proposer.hidden_layers}))
    chain = proposer.propose(ProposeContext(prompt + [root], 3, SamplingParams())).token_ids.tolist()
    sequence = torch.tensor([prompt + [root] + chain])
    captured = capture(target, sequence, proposer.hidden_layers, True)
    steps = list(unrolled_logits(draft, sequence, captured, proposer.hidden_layers, 3))
    columns = draft.draft_to_target()
    row = len(prompt) - 1  # reads the root token and the feature of the position before it
    for j, logits in enumerate(steps):
        torch.testing.assert_close(recorded[j][0, columns], logits[0, row], atol=1e-4, rtol=1e-4)


def test_eagle1_training_row_equals_the_first_draft_level(make_llama):
    target = make_llama(layers=4, seed=3)
    torch.manual_seed(4)
    draft = draft_for_target(config_for_target(target, 1), target)
    for parameter in draft.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    objective = EagleObjective(version=1)
    objective.check(target, None)
    prompt, root = [5, 9, 17, 33, 5, 9, 17, 40], 12
    proposer = EagleProposer(draft, target=target, k=1)
    sequence = torch.tensor([prompt + [root]])
    captured = capture(target, sequence, (-1,), True)
    from draftsmith.proposers.core.types import TargetFeatures

    proposer.begin(prompt, TargetFeatures({-1: captured.hidden[-1][0, :-1]}))
    _, root_logits = proposer._catch_up(prompt + [root])
    from draftsmith.training.eagle import _run_step

    with torch.no_grad():
        out = _run_step(draft, sequence[:, 1:], captured.hidden[-1][:, :-1], torch.arange(len(prompt)), [])
        torch.testing.assert_close(root_logits[0], draft.logits(out)[0, -1], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# Greedy identity


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_greedy_is_token_identical_to_plain(arch, variant, targets, drafts):
    target = targets[arch]
    proposer = EagleProposer(drafts(arch, variant), target=target, **VARIANTS[variant][2])
    plain, eagle = SpeculativeDecoder(target), SpeculativeDecoder(target, proposer, adaptive=False)
    accepted = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        result = eagle.generate(ids, max_new_tokens=40)
        assert result.new_tokens == plain.generate(ids, max_new_tokens=40).new_tokens, prompt
        accepted += sum(result.stats.accept_lengths)
    assert accepted >= 20  # drafts were accepted


def test_greedy_identity_without_fast_paths(targets, drafts):
    target = targets["llama"]
    proposer = EagleProposer(drafts("llama", "eagle3"), target=target, **VARIANTS["eagle3"][2])
    plain = SpeculativeDecoder(target, preallocated_cache=False, lean_forward=False)
    eagle = SpeculativeDecoder(target, proposer, preallocated_cache=False, lean_forward=False, adaptive=False)
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        assert eagle.generate(ids, max_new_tokens=30).new_tokens == plain.generate(ids, max_new_tokens=30).new_tokens


# ---------------------------------------------------------------------------------------
# The sampled output law

N_LAW = 2000
N_CONTROL = 1000
LAW_CASES = {  # (variant, sample the tree?, sampling): sampled and top-k trees at T = 0.7 and 1, a reduced vocabulary in both
    "eagle3_sampled_t0.7": ("eagle3", True, SamplingParams(0.7)),
    "eagle3_reduced_sampled_t1.0": ("eagle3_reduced", True, SamplingParams(1.0)),
    "eagle3_reduced_top_k_tree_t0.7": ("eagle3_reduced", False, SamplingParams(0.7)),
    "eagle3_top_k_tree_t1.0": ("eagle3", False, SamplingParams(1.0)),
    "eagle1_chain_t1.0": ("eagle1", True, SamplingParams(1.0)),
}
FAST_LAW_CASES = ("eagle3_sampled_t0.7", "eagle3_reduced_top_k_tree_t0.7")


@pytest.fixture(scope="module")
def law_setup(make_llama):
    target = make_llama(vocab_size=V, hidden_size=16, layers=4, seed=5)
    return target, {
        "eagle3": fit_draft(target, 3, steps=60),
        "eagle3_reduced": fit_draft(target, 3, draft_vocab_size=6, steps=60),
        "eagle1": fit_draft(target, 1, steps=60),
    }


def law_proposer(law_setup, variant: str, sample: bool) -> EagleProposer:
    target, fitted = law_setup
    width = 1 if variant == "eagle1" else 2
    return EagleProposer(fitted[variant], target=target, k=2, tree_width=width, sample=sample)


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST_LAW_CASES else pytest.mark.slow) for c in LAW_CASES])
def test_sampled_output_follows_the_target_law(case, decisions, law_setup, law_check):
    variant, sample, sampling = LAW_CASES[case]
    target, proposer = law_setup[0], law_proposer(law_setup, variant, sample)
    if decisions == "controller":
        assert_follows_law_deciding(target, proposer, sampling, N_LAW, law_check, f"{case}, ")
    else:
        accepted = assert_follows_law(target, proposer, sampling, N_LAW, law_check, f"{case}, ")
        assert 0.05 < sum(a > 0 for a in accepted) / len(accepted) < 0.95  # first drafts accepted and rejected


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
@pytest.mark.parametrize("sample", [True, False], ids=["sampled_tree", "top_k_tree"])
def test_negative_control_broken_residual_fails_the_law_test(sample, decisions, law_setup, law_check, monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs, token: target_probs)
    # the reduced vocabulary keeps the draft far from the target, so rejections (and the broken residual) are frequent
    proposer = law_proposer(law_setup, "eagle3_reduced", sample)
    controller, n = control_decisions(decisions, proposer, N_CONTROL)
    assert_law_rejects(law_setup[0], proposer, SamplingParams(1.0), n, law_check, controller)


def test_reduced_vocabulary_drafts_only_its_tokens(law_setup):
    target, fitted = law_setup
    draft = fitted["eagle3_reduced"]
    allowed = set(draft.draft_to_target().tolist())
    proposer = EagleProposer(draft, target=target, k=2, tree_width=2)
    for seed in range(20):
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(
            torch.tensor([[1, 2, 7]]), max_new_tokens=3, temperature=1.0, seed=seed
        )
        assert result.stats.drafted_tokens > 0
    draft_rows = proposer._target_logits(torch.zeros(1, draft.cfg.hidden_size))
    assert set(torch.isfinite(draft_rows[0]).nonzero().flatten().tolist()) == allowed


# ---------------------------------------------------------------------------------------
# Checkpoints and bad input


def test_save_and_load_round_trip_every_tensor(targets, drafts, tmp_path):
    target = targets["llama"]
    for variant in ("eagle1", "eagle3_reduced_vocab"):
        draft = drafts("llama", variant)
        draft.save(tmp_path / variant)
        written = load_file(str(tmp_path / variant / "model.safetensors"))
        assert set(written) == set(draft.tensors()) and not any("embed" in k for k in written)
        for name, tensor in draft.tensors().items():
            assert torch.equal(written[name], tensor), name
        proposer = load_proposer({"type": "eagle", "model": str(tmp_path / variant)}, target=target)
        for name, tensor in draft.state_dict().items():
            assert torch.equal(proposer.draft.state_dict()[name], tensor), name
    config = json.loads((tmp_path / "eagle3_reduced_vocab" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 96
    assert config["eagle_aux_hidden_state_layer_ids"] == config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert written["d2t"].dtype == torch.int64 and written["t2d"].dtype == torch.bool and written["fc.weight"].shape == (32, 96)


def test_a_head_for_another_target_is_refused(targets, drafts, tmp_path, make_llama):
    drafts("llama", "eagle3").save(tmp_path / "head")
    for other, what in ((make_llama(hidden_size=64, layers=4), "hidden size 32"), (make_llama(layers=6), "number of layers 4")):
        with pytest.raises(InputError, match=f"trained for a target of {what}"):
            EagleProposer(tmp_path / "head", target=other)
    with pytest.raises(InputError, match="vocabulary 128, this target's is 200"):
        EagleProposer(tmp_path / "head", target=make_llama(vocab_size=200, layers=4))


def test_a_wrong_d2t_is_refused(targets, drafts, tmp_path):
    drafts("llama", "eagle3_reduced_vocab").save(tmp_path / "head")
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    save_file({**tensors, "d2t": tensors["d2t"][:-1]}, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(InputError, match="d2t has shape \\(95,\\), expected \\(96,\\)"):
        EagleProposer(tmp_path / "head", target=targets["llama"])
    save_file({**tensors, "d2t": -torch.arange(96)}, str(tmp_path / "head" / "model.safetensors"))  # every draft id -> target id 0
    with pytest.raises(InputError, match="onto the same target id twice"):
        EagleProposer(tmp_path / "head", target=targets["llama"])
    save_file({**tensors, "t2d": ~tensors["t2d"]}, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(InputError, match="t2d does not mark exactly the target ids d2t maps to"):
        EagleProposer(tmp_path / "head", target=targets["llama"])


@pytest.mark.parametrize(
    "aux, message",
    [
        ([0, 1, 2], r"must be ascending ids of layer outputs in \[1, 3\]"),
        ([1, 2, 4], r"in \[1, 3\]"),
        ([2, 1, 3], "ascending"),
        ([1, 2], "three"),
    ],
)
def test_aux_layer_ids_out_of_range_are_refused(aux, message, targets):
    with pytest.raises(InputError, match=message):
        EagleObjective(version=3, aux_layers=aux).check(targets["llama"], None)


def test_a_tree_budget_below_the_depth_is_refused(targets, drafts):
    with pytest.raises(InputError, match="max_nodes must be at least the depth k=5"):
        EagleProposer(drafts("llama", "eagle3"), target=targets["llama"], k=5, tree_width=2, max_nodes=4)
    with pytest.raises(InputError, match="needs the target model"):
        EagleProposer(drafts("llama", "eagle3"))


def test_default_aux_layers():
    assert default_aux_layers(32) == [2, 16, 29] and default_aux_layers(8) == [2, 4, 5] and default_aux_layers(4) == [1, 2, 3]
    with pytest.raises(InputError, match="at least 4 layers"):
        default_aux_layers(3)


# ---------------------------------------------------------------------------------------
# Engine export

EAGLE3_KEYS = {
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight",
    "fc.weight",
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


@pytest.fixture(scope="module")
def deep_target(make_llama):
    """Six layers: EAGLE-3's default aux ids [2, 3, 3] collide, so [1, 3, 5]... the export needs ids >= 2: given [2, 3, 5]."""
    return make_llama(layers=6, seed=7)


def eagle3_head(target, aux=(2, 3, 5), draft_vocab_size=96):
    torch.manual_seed(0)
    draft = draft_for_target(config_for_target(target, 3, aux_layers=list(aux), draft_vocab_size=draft_vocab_size), target)
    draft.set_vocabulary(torch.randperm(128, generator=torch.Generator().manual_seed(1))[:draft_vocab_size])
    return draft


@pytest.mark.parametrize("format", ["vllm", "sglang"])
def test_eagle3_export_has_the_engines_files_and_keys(format, deep_target, tmp_path):
    proposer = EagleProposer(eagle3_head(deep_target), target=deep_target, k=4, tree_width=2, max_nodes=8)
    exported = proposer.export(tmp_path / "out", format=format)
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(written) == EAGLE3_KEYS  # no embed_tokens
    assert written["fc.weight"].shape == (32, 96) and written["lm_head.weight"].shape == (96, 32)
    assert written["midlayer.self_attn.q_proj.weight"].shape == (32, 64)  # the doubled input width
    assert written["d2t"].dtype == torch.int64 and written["t2d"].dtype == torch.bool and written["t2d"].sum() == 96
    for name, tensor in proposer.draft.tensors().items():
        assert torch.equal(written[name], tensor), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (1, 128, 96, 32)
    assert config["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [2, 3, 5]}
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    reloaded = EagleProposer(tmp_path / "out", target=deep_target)
    for name, tensor in proposer.draft.state_dict().items():
        assert torch.equal(reloaded.draft.state_dict()[name], tensor), name
    if format == "vllm":
        assert exported.speculative_config == {"method": "eagle3", "model": str(tmp_path / "out"), "num_speculative_tokens": 4}
    else:
        assert exported.speculative_config["speculative-algorithm"] == "EAGLE3"
        assert "python -m sglang.launch_server --model-path T" in exported.serve_commands("T")[0]


def test_the_export_check_catches_a_missing_d2t_or_aux_field(deep_target, tmp_path, monkeypatch):
    proposer = EagleProposer(eagle3_head(deep_target), target=deep_target)
    real_tensors = proposer.draft.tensors
    monkeypatch.setattr(proposer.draft, "tensors", lambda: {k: v for k, v in real_tensors().items() if k != "d2t"})
    with pytest.raises(InputError, match="a reduced draft vocabulary needs its d2t"):
        proposer.export(tmp_path / "a")
    monkeypatch.setattr(proposer.draft, "tensors", real_tensors)
    save = proposer.draft.save  # a writer that drops d2t: the read-back check refuses it and nothing lands

    def save_without_d2t(directory):
        save(directory)
        tensors = load_file(str(directory / "model.safetensors"))
        save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(directory / "model.safetensors"))

    monkeypatch.setattr(proposer.draft, "save", save_without_d2t)
    with pytest.raises(InputError, match=r"missing \['d2t'\]"):
        proposer.export(tmp_path / "b")
    assert not (tmp_path / "b").exists() and not (tmp_path / ".b.partial").exists()
    monkeypatch.setattr(proposer.draft, "save", save)
    real_config = checkpoint_config

    def without_top_level_ids(cfg):
        config = real_config(cfg)
        config.pop("eagle_aux_hidden_state_layer_ids")
        return config

    monkeypatch.setattr(proposer.draft, "save", lambda d, dtype=torch.float32: _save_with(proposer.draft, d, without_top_level_ids))
    with pytest.raises(InputError, match="eagle_aux_hidden_state_layer_ids is None, expected \\[2, 3, 5\\]"):
        proposer.export(tmp_path / "c")


def _save_with(draft, directory, make_config):
    from safetensors.torch import save_file as write

    directory.mkdir(parents=True, exist_ok=True)
    write({k: v.contiguous() for k, v in draft.tensors().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(make_config(draft.cfg)))


def test_export_refuses_a_first_aux_id_below_two_and_unknown_formats(deep_target, tmp_path):
    proposer = EagleProposer(eagle3_head(deep_target, aux=(1, 3, 5)), target=deep_target)
    with pytest.raises(InputError, match=r"aux_layers \[1, 3, 5\] start below 2"):
        proposer.export(tmp_path / "x")
    with pytest.raises(InputError, match=r"exports to \['vllm', 'sglang'\], got format 'onnx'"):
        proposer.export(tmp_path / "y", format="onnx")


def test_eagle1_export_round_trip(targets, drafts, tmp_path):
    target = targets["llama"]
    proposer = EagleProposer(drafts("llama", "eagle1"), target=target, k=4)
    exported = proposer.export(tmp_path / "e1")
    written = load_file(str(tmp_path / "e1" / "model.safetensors"))
    assert set(written) == set(proposer.draft.tensors()) and "fc.weight" in written and "layers.0.self_attn.q_proj.weight" in written
    assert not any(k.startswith(("lm_head", "embed")) for k in written)  # the target's own are used
    assert exported.speculative_config["method"] == "eagle"
    for name, tensor in proposer.draft.tensors().items():
        assert torch.equal(written[name], tensor), name
