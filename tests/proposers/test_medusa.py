"""Medusa heads: greedy identity on three architectures, the sampled law, trees, checkpoints, bad input.

Heads that guess nothing would make every test below vacuous, so the fixtures fit them
for a second on the target's own greedy continuations (``fit_heads``): enough for
drafts to be accepted often, and rejected often. The law tests compare the joint of 3
sampled tokens with the target's exact law (``tests/law.py``; chi-square at
alpha = 1e-3); a broken residual must fail the same check.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from bad_input import assert_one_line_naming
from heads import fit, greedy_sequences, tiny_neox, tiny_qwen2
from hypothesis import given, settings
from hypothesis import strategies as st
from law import V, assert_follows_law, assert_follows_law_deciding, assert_law_rejects, control_decisions
from safetensors.torch import load_file, save_file

import draftsmith.verify.rejection as rejection
from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.static_tree import (
    cartesian_paths,
    expected_accepted_length,
    grow_tree_by_accuracy,
    grow_tree_by_frequency,
    static_tree,
)
from draftsmith.proposers.medusa import MedusaProposer
from draftsmith.proposers.medusa_head import MedusaHeads, load_heads, write_calibration
from draftsmith.training.medusa import MedusaObjective, path_counts
from draftsmith.verify import SpeculativeDecoder

TREE = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [3, 3, 3, 3], [100, 7, 64, 2, 90], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]


def fit_heads(target, num_heads: int = 3, steps: int = 150, seed: int = 0) -> MedusaHeads:
    """Heads fitted by the Medusa objective's own loss to the target's greedy continuations of random prompts."""
    return fit(MedusaObjective(num_heads=num_heads), target, greedy_sequences(target, seed=seed), lr=1e-2, steps=steps)


@pytest.fixture(scope="module")
def architectures(make_llama):
    """Llama, Qwen2 and GPT-NeoX targets (the last has no lean forward: hidden states come from the model's own), each with fitted heads."""
    targets = {"llama": make_llama(), "qwen2": tiny_qwen2(layers=2), "gpt_neox": tiny_neox(layers=2)}
    return {name: (target, fit_heads(target)) for name, target in targets.items()}


# ---------------------------------------------------------------------------------------
# Greedy identity


@pytest.mark.parametrize("fast_paths", [True, False], ids=["fast_paths", "plain_forward"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_greedy_is_token_identical_to_plain(arch, fast_paths, architectures):
    target, heads = architectures[arch]
    proposer = MedusaProposer(heads, tree=TREE, target=target)
    plain = SpeculativeDecoder(target, preallocated_cache=fast_paths, lean_forward=fast_paths)
    medusa = SpeculativeDecoder(target, proposer, preallocated_cache=fast_paths, lean_forward=fast_paths, adaptive=False)
    accepted = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        expected = plain.generate(ids, max_new_tokens=40).new_tokens
        result = medusa.generate(ids, max_new_tokens=40)
        assert result.new_tokens == expected, prompt
        accepted += sum(result.stats.accept_lengths)
        assert result.stats.target_forwards < 40  # some drafts were accepted on every prompt
    assert accepted > 40


def test_drafts_are_the_heads_top_guesses_after_the_last_accepted_position(architectures):
    """Node (r1, r2) holds head 1's rank-r1 guess and head 2's rank-r2 guess, from the last accepted position's hidden state."""
    target, heads = architectures["llama"]
    seen = []

    class Recording(MedusaProposer):
        def observe(self, result, features):
            super().observe(result, features)
            seen.append(features.hidden_states[-1].shape[0] == result.num_accepted + 1)

    proposer = Recording(heads, tree=TREE, target=target)
    SpeculativeDecoder(target, proposer, adaptive=False).generate(torch.tensor([PROMPTS[0]]), max_new_tokens=12)
    assert seen and all(seen)  # root + accepted rows arrived every step
    hidden = torch.randn(heads.hidden_size)
    proposer._hidden = hidden
    from draftsmith.proposers.core.types import ProposeContext

    draft = proposer.propose(ProposeContext([1, 2], 8, SamplingParams()))
    with torch.no_grad():
        ranked = heads(hidden).argsort(dim=-1, descending=True)  # [heads, vocab]
    for path, token, parent in zip(proposer.tree.paths, draft.token_ids.tolist(), draft.parents.tolist(), strict=True):
        assert token == int(ranked[len(path) - 1, path[-1]])
        assert parent == (proposer.tree.paths.index(path[:-1]) if len(path) > 1 else -1)
    assert draft.draft_probs is None  # point masses: the verifier stays exact at every temperature
    probs = heads(hidden).detach().softmax(-1)
    expected = [float(probs[len(path) - 1, token]) for path, token in zip(proposer.tree.paths, draft.token_list, strict=True)]
    assert draft.scores == pytest.approx(expected, rel=1e-5)  # each node's own probability, which the controller calibrates


def test_a_narrower_or_shallower_step_drafts_the_trees_part_that_the_decoders_cut_keeps(architectures):
    """``max_width`` / ``max_depth`` give the nodes ``limit_width(prune_depth(...))`` keeps, and no others (a chain: ranks 0)."""
    from draftsmith.proposers.core.tree import limit_width, prune_depth
    from draftsmith.proposers.core.types import ProposeContext

    target, heads = architectures["llama"]
    proposer = MedusaProposer(heads, tree=TREE, target=target)
    proposer._hidden = torch.randn(heads.hidden_size)
    full = proposer.propose(ProposeContext([1, 2], 8, SamplingParams()))
    assert proposer.draft_width() == proposer.tree.width > 1
    for depth, width in ((8, 1), (8, 2), (1, None), (2, 1)):
        part = proposer.propose(ProposeContext([1, 2], depth, SamplingParams(), max_width=width))
        cut = limit_width(prune_depth(full, depth), width)
        assert part.token_list == cut.token_list and part.parent_list == cut.parent_list, (depth, width)
    chain = proposer.propose(ProposeContext([1, 2], 8, SamplingParams(), max_width=1))
    assert chain.is_chain() and chain.num_nodes == proposer.tree.depth


def test_lean_forward_returns_the_models_hidden_states(make_llama):
    """The hidden states a proposer asks for equal ``output_hidden_states``, with the lean forward as without it."""
    from transformers import DynamicCache

    from draftsmith.proposers.core.lean_forward import LeanForward

    model = make_llama()
    lean = LeanForward.probe(model)
    assert lean is not None
    ids = torch.tensor([[5, 9, 17, 33, 5, 9]])
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states
        cache = DynamicCache(config=model.config)
        model(ids[:, :2], cache=cache, use_cache=True)
        logits, states = lean(ids[:, 2:], cache, torch.arange(2, 6)[None], hidden_layers=(0, 1, -1, 2))
    for layer in (0, 1, -1, 2):
        torch.testing.assert_close(states[layer], expected[layer][0, 2:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, model.lm_head(expected[-1][0, 2:]), atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------
# The sampled output law

N_LAW = 2500
N_CONTROL = 1000
LAW_CASES = {
    "t0.7": SamplingParams(0.7),
    "t1.0": SamplingParams(1.0),
    "t0.7_top_k5": SamplingParams(0.7, top_k=5),
    "t1.0_top_p0.9": SamplingParams(1.0, top_p=0.9),
}
FAST_LAW_CASES = ("t0.7", "t1.0_top_p0.9")
LAW_TREE = [[0], [1], [0, 0], [1, 0], [0, 1]]


@pytest.fixture(scope="module")
def law_target(make_llama):
    target = make_llama(vocab_size=V, hidden_size=16, layers=1, seed=5)
    return target, fit_heads(target, num_heads=2, steps=100)


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST_LAW_CASES else pytest.mark.slow) for c in LAW_CASES])
def test_sampled_output_follows_the_target_law(case, law_target, law_check):
    target, heads = law_target
    sampling = LAW_CASES[case]
    accepted = assert_follows_law(target, MedusaProposer(heads, tree=LAW_TREE, target=target), sampling, N_LAW, law_check, f"{case}, ")
    assert 0.05 < sum(a > 0 for a in accepted) / len(accepted) < 0.95  # first drafts accepted and rejected


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c == FAST_LAW_CASES[0] else pytest.mark.slow) for c in LAW_CASES])
def test_sampled_output_follows_the_target_law_with_the_controller_deciding(case, law_target, law_check):
    target, heads = law_target
    assert_follows_law_deciding(target, MedusaProposer(heads, tree=LAW_TREE, target=target), LAW_CASES[case], N_LAW, law_check, f"{case}, ")


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
def test_negative_control_broken_residual_fails_the_law_test(decisions, law_target, law_check, monkeypatch):
    monkeypatch.setattr(rejection, "residual_distribution", lambda target_probs, draft_probs, token: target_probs)
    target, heads = law_target
    sampling = LAW_CASES["t1.0"]
    proposer = MedusaProposer(heads, tree=LAW_TREE, target=target)
    controller, n = control_decisions(decisions, proposer, N_CONTROL)
    assert_law_rejects(target, proposer, sampling, n, law_check, controller)


# ---------------------------------------------------------------------------------------
# Trees


def all_trees(depth: int, width: int, nodes: int):
    """Every rank-path tree of exactly ``nodes`` nodes within ``depth`` x ``width`` (prefix-closed sets)."""
    candidates = [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]
    for chosen in itertools.combinations(candidates, nodes):
        present = set(chosen)
        if all(len(p) == 1 or p[:-1] in present for p in chosen):
            yield chosen


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    st.lists(st.lists(st.floats(0.0, 0.3), min_size=3, max_size=3), min_size=3, max_size=3),
    st.integers(1, 5),
)
def test_calibrated_tree_is_the_best_tree_for_its_budget(accuracy, budget):
    """Brute force over every tree of the budget (3 deep, 3 wide): none has a larger expected accepted length."""
    grown = grow_tree_by_accuracy(accuracy, budget)
    if grown:
        static_tree(grown)  # a valid tree: every prefix present
    best = max((expected_accepted_length(t, accuracy) for t in all_trees(3, 3, budget)), default=0.0)
    assert expected_accepted_length(grown, accuracy) == pytest.approx(best, abs=1e-12)
    assert len(grown) <= budget


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(*[st.integers(0, 3)] * 3), min_size=1, max_size=60), st.integers(1, 5))
def test_frequency_tree_is_the_best_tree_for_its_budget(tuples, budget):
    """Rank tuples per position (3 = no hit) -> path counts -> the grown tree; brute force finds none better."""
    histogram = torch.zeros(4**3, dtype=torch.long)
    for ranks in tuples:
        histogram[ranks[0] + 4 * ranks[1] + 16 * ranks[2]] += 1
    counts = path_counts(histogram, num_heads=3, ranks=3)
    for path, count in counts.items():  # a path is counted where every head along it hit at its rank
        assert count == sum(all(t[d] == r for d, r in enumerate(path)) for t in tuples)
    grown = grow_tree_by_frequency(counts, budget)
    if grown:
        static_tree(grown)
    best = max((sum(counts.get(p, 0) for p in t) for t in all_trees(3, 3, budget)), default=0)
    assert sum(counts[p] for p in grown) == best and len(grown) <= budget


def test_frequency_tree_beats_independent_heads_when_their_errors_correlate():
    """Head 2 is right only when head 1's first guess is: the product rule undervalues (0, 0)."""
    accuracy = [[0.3, 0.1], [0.3, 0.0]]
    counts = {(0,): 30, (1,): 10, (0, 0): 30}  # of 100 positions
    assert grow_tree_by_accuracy(accuracy, 2) == [(0,), (1,)]  # 0.3 + 0.1 expected, 0.4 measured
    assert grow_tree_by_frequency(counts, 2) == [(0,), (0, 0)]  # 0.3 + 0.3 measured


def test_calibrated_tree_prefers_accurate_heads_and_skips_hopeless_nodes():
    accuracy = [[0.6, 0.2, 0.1], [0.5, 0.1, 0.0], [0.0, 0.0, 0.0]]
    tree = grow_tree_by_accuracy(accuracy, 6)
    assert tree[:3] == [(0,), (0, 0), (1,)]  # 0.6, 0.3, 0.2
    assert all(len(p) < 3 for p in tree)  # head 3 is never right: no node of depth 3
    assert grow_tree_by_accuracy([[0.0], [0.0]], 4) == []


def test_cartesian_paths_are_breadth_first_and_cut_to_the_budget():
    assert cartesian_paths(2, 2, 5) == [(0,), (1,), (0, 0), (0, 1), (1, 0)]
    static_tree(cartesian_paths(3, 3, 20))


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "has no paths"),
        ([[0], [0, 0, 0]], r"path \[0, 0, 0\] has no parent path \[0, 0\]"),
        ([[0], [0]], r"path \[0\] appears twice"),
        ([[0], [-1]], "ranks are integers >= 0"),
        ([[0], []], "non-empty list of ranks"),
        ([[0], "01"], "non-empty list of ranks"),
        ([[0], [0.5]], "ranks are integers >= 0"),
    ],
)
def test_bad_trees_are_refused(paths, message):
    with pytest.raises(InputError, match=message):
        static_tree(paths, what="medusa tree")


def test_a_tree_deeper_than_the_heads_is_refused(architectures):
    target, heads = architectures["llama"]
    with pytest.raises(InputError, match=r"path \[0, 0, 0, 0\] is 4 deep, more than the 3 heads"):
        MedusaProposer(heads, tree=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], target=target)


@pytest.mark.parametrize("max_nodes", [0, -3])
def test_a_node_budget_under_one_is_refused(max_nodes, architectures):
    target, heads = architectures["llama"]
    with pytest.raises(InputError, match=f"max_nodes must be >= 1.*got {max_nodes}"):
        MedusaProposer(heads, tree=TREE, max_nodes=max_nodes, target=target)
    with pytest.raises(InputError, match="max_nodes must be >= 1"):
        grow_tree_by_accuracy([[0.5]], max_nodes)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.one_of(st.integers(-5, 0), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3)))
def test_bad_node_budgets_are_one_line_errors(value):
    heads = MedusaHeads(8, 16, 2)
    with pytest.raises(InputError) as error:
        MedusaProposer(heads, tree=[[0]], max_nodes=value)
    assert_one_line_naming(error.value, "max_nodes")


# ---------------------------------------------------------------------------------------
# Checkpoints: native (vLLM) layout, FasterDecoding's, calibration, bad files


@pytest.fixture
def saved(architectures, tmp_path):
    target, heads = architectures["llama"]
    heads.save(tmp_path / "heads")
    write_calibration(tmp_path / "heads", [[0.5, 0.2, 0.1], [0.4, 0.1, 0.05], [0.3, 0.1, 0.0]], tokens=1000, max_nodes=5)
    return target, heads, tmp_path / "heads"


def test_load_proposer_grows_the_stored_calibrated_tree(saved):
    target, heads, path = saved
    proposer = load_proposer({"type": "medusa", "model": str(path)}, target=target)
    assert proposer.tree.paths == ((0,), (1,), (2,), (0, 0), (1, 0))  # values 0.5, 0.2, 0.1, 0.2, 0.08
    bigger = load_proposer({"type": "medusa", "model": str(path), "max_nodes": 9}, target=target)
    assert bigger.tree.num_nodes == 9 and set(proposer.tree.paths) < set(bigger.tree.paths)
    for name, tensor in heads.state_dict().items():
        assert torch.equal(proposer.heads.state_dict()[name], tensor)


def test_faster_decoding_checkpoints_load(saved, tmp_path):
    """FasterDecoding's names ({h}.{l}.linear.*, {h}.{L}.weight) in medusa_lm_head.safetensors or .pt."""
    target, heads, _ = saved
    original = {}
    for h in range(heads.num_heads):
        for layer in range(heads.num_layers):
            original[f"{h}.{layer}.linear.weight"] = heads.blocks[h].layers[layer].weight.detach().clone()
            original[f"{h}.{layer}.linear.bias"] = heads.blocks[h].layers[layer].bias.detach().clone()
        original[f"{h}.{heads.num_layers}.weight"] = heads.lm_heads[h].weight.detach().clone()
    config = {"medusa_num_heads": heads.num_heads, "medusa_num_layers": heads.num_layers, "base_model_name_or_path": "a-target"}
    for name in ("medusa_lm_head.safetensors", "medusa_lm_head.pt"):
        path = tmp_path / name.replace(".", "_")
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        save_file(original, str(path / name)) if name.endswith("safetensors") else torch.save(original, path / name)
        loaded = load_heads(path)
        for key, tensor in heads.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], tensor), (name, key)
    with pytest.raises(InputError, match="no calibration.json.*tree: \\[\\[0\\]"):
        MedusaProposer(path, target=target)
    assert MedusaProposer(path, tree=TREE, target=target).tree.num_nodes == len(TREE)


def test_a_checkpoint_with_missing_heads_is_refused(saved):
    _, _, path = saved
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if not k.startswith(("blocks.2.", "lm_heads.2."))}, str(path / "model.safetensors"))
    with pytest.raises(InputError, match=r"miss 3 tensor\(s\) of the 3 heads config.json announces .*heads with weights: \[0, 1\]"):
        load_heads(path)


def test_heads_for_another_target_are_refused(saved, make_llama):
    _, _, path = saved
    with pytest.raises(
        InputError, match="Medusa heads trained for a target of hidden size 32, this target's is 64: they belong to another target"
    ):
        MedusaProposer(path, target=make_llama(hidden_size=64))
    with pytest.raises(InputError, match="trained for a target of vocabulary 128, this target's is 200"):
        MedusaProposer(path, target=make_llama(vocab_size=200))


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda p: (p / "config.json").write_text("{not json"), "is not valid JSON"),
        (lambda p: (p / "config.json").write_text("{}"), r"states none of \['num_heads', 'medusa_num_heads'\]"),
        (lambda p: (p / "model.safetensors").write_bytes(b"\x00" * 10), "cannot be read"),
        (lambda p: (p / "model.safetensors").unlink(), "has no weights file"),
        (lambda p: (p / "calibration.json").write_text('{"rank_accuracy": [[2.0]]}'), "calibration .* cannot be used"),
    ],
    ids=["config_json", "config_counts", "weights_corrupt", "weights_missing", "calibration"],
)
def test_broken_files_are_one_line_errors_naming_them(breakage, message, saved):
    target, _, path = saved
    breakage(path)
    with pytest.raises(InputError, match=message) as error:
        load_proposer({"type": "medusa", "model": str(path)}, target=target)
    assert_one_line_naming(error.value, str(path))


def test_vllm_export_round_trip(saved, tmp_path):
    """The export holds every tensor vLLM's Medusa loader reads, under its names, and the config fields it reads."""
    target, heads, path = saved
    proposer = MedusaProposer(path, target=target)
    exported = proposer.export(tmp_path / "vllm")
    assert exported.speculative_config == {"method": "medusa", "model": str(tmp_path / "vllm"), "num_speculative_tokens": 3}
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "hidden_size", "vocab_size", "num_heads", "num_hidden_layers")} == {
        "model_type": "medusa", "hidden_size": 32, "vocab_size": 128, "num_heads": 3, "num_hidden_layers": 1,
    }  # fmt: skip
    written = load_file(str(tmp_path / "vllm" / "model.safetensors"))
    expected_names = {f"blocks.{h}.layers.0.{p}" for h in range(3) for p in ("weight", "bias")} | {f"lm_heads.{h}.weight" for h in range(3)}
    assert set(written) == expected_names
    for name, tensor in heads.state_dict().items():
        assert torch.equal(written[name], tensor), name
    reloaded = MedusaProposer(tmp_path / "vllm", target=target)  # the calibration travels with it
    assert reloaded.tree.paths == proposer.tree.paths
    with pytest.raises(InputError, match="is not empty"):
        proposer.export(tmp_path / "vllm")
    with pytest.raises(InputError, match=r"exports to \['vllm'\], got format 'onnx'"):
        proposer.export(tmp_path / "other", format="onnx")
