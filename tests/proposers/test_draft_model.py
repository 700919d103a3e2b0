"""The draft-model proposer: greedy identity, the sampled output law, cache rollback, construction checks.

The law tests decode 3 tokens after a fixed prompt with a V = 8 target and a different
V = 8 draft, one request per seed, and compare the joint of the 3 tokens with the exact
joint from the target's own processed next-token probabilities. Bound: chi-square at
alpha = 1e-3 (``law_check``). The negative control reports draft rows that ignore the
earlier siblings of a without-replacement draw and must fail the same check.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import shutil
import warnings

import pytest
import torch
from law import V, assert_follows_law_deciding, control_decisions, exact_law, law_statistics, sample_law
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import DynamicCache, PreTrainedTokenizerFast

import draftsmith.proposers.core.sampling as sampling
from draftsmith.proposers import load_proposer
from draftsmith.proposers.core.cache import fast_path_enabled
from draftsmith.proposers.core.errors import InputError
from draftsmith.proposers.core.sampling import SamplingParams
from draftsmith.proposers.core.types import ProposeContext
from draftsmith.proposers.draft_model import DraftModelProposer, load_draft_model
from draftsmith.verify import SpeculativeDecoder

MAX_NEW = 40


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models: on a shared 2-core machine a second thread makes each forward ~10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompt():
    torch.manual_seed(1)
    return torch.randint(3, 128, (1, 12))


@pytest.fixture(scope="module")
def reference(model, prompt):
    out = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.shape[1] :].tolist()


@pytest.fixture(scope="module")
def drafts(model, make_llama):
    """A different (smaller) random llama, an exact copy of the target, and a noisy copy that agrees often, not always."""
    near = copy.deepcopy(model)
    with torch.no_grad():
        head = near.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(0)) * head.std() * 0.5)
    return {"other": make_llama(hidden_size=16, seed=5), "copy": copy.deepcopy(model), "near": near}


CONFIGS = {
    "chain": {},
    "tree": {"tree_width": 3},
    "tree_budget": {"tree_width": 2, "max_nodes": 5},
    "dynamic_chain": {"dynamic": True},
    "dynamic_tree": {"tree_width": 2, "dynamic": True},
    "confident_chain": {"confidence_threshold": 0.5},
    "confident_tree": {"tree_width": 2, "confidence_threshold": 0.5},
    "wrapper_chain": {"lean_forward": False},  # the model's own forward instead of its submodules
    "wrapper_tree": {"tree_width": 3, "lean_forward": False},
}

# Measured with the copy draft over 40 tokens: 4.44 (k = 4: 4 accepted + 1 bonus per forward,
# less the last partial step), 5.71 when dynamic depth grows to k_max = 8, 2.86 when the
# node budget keeps the 5 best nodes of the tree (they reach depth 2 only).
COPY_MIN_TAU = {
    "chain": 4.0, "tree": 4.0, "tree_budget": 2.5, "dynamic_chain": 5.0, "dynamic_tree": 4.0, "wrapper_chain": 4.0, "wrapper_tree": 4.0,
}  # fmt: skip


@pytest.mark.parametrize("draft_name", ["other", "copy"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_is_token_identical_to_generate(config, draft_name, model, drafts, prompt, reference):
    proposer = DraftModelProposer(drafts[draft_name], k=4, target=model, **CONFIGS[config])
    # a stock Llama passes the lean probe (unless the environment turns fast paths off)
    assert (proposer.lean is None) == (config.startswith("wrapper") or not fast_path_enabled(None))
    result = SpeculativeDecoder(model, proposer, adaptive=False).generate(prompt, max_new_tokens=MAX_NEW)
    assert result.new_tokens == reference
    stats = result.stats
    mean_depth = stats.drafted_tokens / stats.steps if config.endswith("chain") else None
    if draft_name == "copy" and config in COPY_MIN_TAU:
        # The copy agrees with the target everywhere, so every draft is accepted in full.
        assert stats.tau > COPY_MIN_TAU[config], f"tau {stats.tau:.2f}"
    if config.startswith("dynamic"):
        assert proposer.depth == (proposer.k_max if draft_name == "copy" else proposer.k_min)
    if config == "confident_chain":
        # The draft's own confidence stops chains early, even when they would be accepted.
        assert mean_depth < 3.0 and (draft_name == "other" or stats.tau > 1.5), f"depth {mean_depth:.2f}, tau {stats.tau:.2f}"


def test_tree_children_are_the_top_tokens_after_their_path(drafts, prompt):
    """Scoring a depth with the tree mask gives each node the logits of its own linear path."""
    draft_lm = drafts["other"]
    proposer = DraftModelProposer(draft_lm, k=3, tree_width=3)
    tokens = prompt[0].tolist()
    proposer.begin(tokens[:-1], None)
    draft = proposer.propose(ProposeContext(tokens, max_depth=3, sampling=SamplingParams()))
    ids, parents = draft.token_ids.tolist(), draft.parents.tolist()
    assert draft.num_nodes == 3 + 9 + 9 and draft.draft_probs is None  # 3 root children, 3 expanded per depth
    for node in [-1] + sorted(set(parents) - {-1}):
        path, walk = [], node
        while walk >= 0:
            path.insert(0, ids[walk])
            walk = parents[walk]
        with torch.no_grad():
            logits = draft_lm(torch.tensor([tokens + path])).logits[0, -1]
        children = [ids[i] for i, p in enumerate(parents) if p == node]
        assert children == torch.topk(logits, len(children)).indices.tolist(), f"children of node {node}"


# ---------------------------------------------------------------------------------------
# The draft cache


def assert_cache_is_fresh_prefill(proposer: DraftModelProposer, tokens: list[int], extra: int = 0) -> None:
    """The cache holds ``tokens``' KV, as one prefill of them would (then ``extra`` tree nodes' KV)."""
    assert proposer.cached_tokens == tokens
    assert proposer.cache_len == len(tokens) + extra
    fresh = DynamicCache(config=proposer.model.config)
    with torch.no_grad():
        proposer.model(torch.tensor([tokens]), cache=fresh, use_cache=True)
    for mine, ref in zip(proposer.cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(mine.keys[..., : len(tokens), :], ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.values[..., : len(tokens), :], ref.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("config", ["chain", "tree"])
def test_draft_cache_holds_exactly_the_committed_tokens(config, temperature, model, drafts, prompt, monkeypatch):
    """After propose: the committed tokens, then the draft nodes fed to reach the deepest level
    (a chain's in path order; a tree's expanded nodes, out of path order).
    After observe: the committed tokens and the accepted guesses that were fed, never a rejected one."""
    proposer = DraftModelProposer(drafts["near"], target=model, **CONFIGS[config])
    propose, observe = proposer.propose, proposer.observe
    pending, steps, contexts = [], [], []  # steps: (kept, fed) per proposed draft

    def checked_propose(context):
        draft = propose(context)
        if config == "chain":
            fed, expanded = draft.token_ids.tolist()[: draft.num_nodes - 1], set()
            assert_cache_is_fresh_prefill(proposer, context.tokens + fed)
        else:  # no budget here, so the fed nodes are the ones with children
            fed, expanded = [], set(draft.parent_list) - {-1}
            assert_cache_is_fresh_prefill(proposer, context.tokens, extra=len(expanded))
        contexts.append(list(context.tokens))
        pending.append((list(context.tokens), fed, expanded))
        return draft

    def checked_observe(result, features):
        observe(result, features)
        if pending:  # a step without a draft (no room left) leaves the cache alone
            tokens, fed, expanded = pending.pop()
            if config == "chain":
                kept = result.accepted_tokens[: len(fed)]
            else:
                fed_on_path = list(itertools.takewhile(expanded.__contains__, result.accepted_nodes))
                kept = result.accepted_tokens[: len(fed_on_path)]
            assert_cache_is_fresh_prefill(proposer, tokens + kept)
            steps.append((len(kept), len(fed) if config == "chain" else len(expanded)))

    monkeypatch.setattr(proposer, "propose", checked_propose)
    monkeypatch.setattr(proposer, "observe", checked_observe)
    result = SpeculativeDecoder(model, proposer, adaptive=False).generate(prompt, max_new_tokens=16, temperature=temperature, seed=0)
    assert len(contexts) > 3 and result.stats.drafted_tokens > 0
    # Both cases happened: accepted guesses kept, fed guesses dropped.
    assert any(kept > 0 for kept, _ in steps) and any(kept < fed for kept, fed in steps), steps
    # Lazy catch-up also survives a history that diverged from the cache (a new request without begin).
    tokens = contexts[-1][:8] + [7, 8, 9]
    checked_propose(ProposeContext(tokens, max_depth=4, sampling=SamplingParams(temperature), generator=torch.Generator()))


# ---------------------------------------------------------------------------------------
# The sampled output law

N_LAW = 4000
N_CONTROL = 1000  # fewer samples only make a control harder to catch, so failing it is the stronger result
LAW_CASES = {  # the 2 x 2 grid: chain and sampled tree (siblings without replacement), T = 0.7 and 1.0
    "chain_t0.7": ({}, 0.7),
    "chain_t1.0": ({}, 1.0),
    "tree_t0.7": ({"tree_width": 3}, 0.7),
    "tree_t1.0": ({"tree_width": 3}, 1.0),
}


@pytest.fixture(scope="module")
def law_models(make_llama):
    """One-layer V = 8 target and draft: the law tests run thousands of requests.

    The draft is sharpened (like a trained draft, it is confident), which makes the
    first sibling often a confident miss: the case where sibling rows matter most.
    """
    target = make_llama(vocab_size=V, hidden_size=16, layers=1, seed=5)
    draft_lm = make_llama(vocab_size=V, hidden_size=16, layers=1, seed=11)
    with torch.no_grad():
        draft_lm.lm_head.weight.mul_(4.0)
    return target, draft_lm


FAST_LAW_CASES = ("chain_t0.7", "tree_t1.0")  # by default a chain and a tree; --slow runs the whole grid


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST_LAW_CASES else pytest.mark.slow) for c in LAW_CASES])
def test_sampled_output_follows_the_target_law(case, law_models, law_check):
    config, temperature = LAW_CASES[case]
    target, draft_lm = law_models
    counts, accepted = sample_law(target, DraftModelProposer(draft_lm, k=4, **config), SamplingParams(temperature), N_LAW)
    for name, (stat, critical, tv) in law_statistics(counts, exact_law(target, SamplingParams(temperature)), N_LAW, law_check).items():
        assert stat < critical, f"{case}, {name}: chi2 {stat:.1f} >= {critical:.1f} (TV {tv:.3f})"
    # Not vacuous: the first draft token is accepted in some requests and rejected in others.
    assert 0.05 < sum(a > 0 for a in accepted) / len(accepted) < 0.95


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in FAST_LAW_CASES else pytest.mark.slow) for c in LAW_CASES])
def test_sampled_output_follows_the_target_law_with_the_controller_deciding(case, law_models, law_check):
    config, temperature = LAW_CASES[case]
    target, draft_lm = law_models
    proposer = DraftModelProposer(draft_lm, k=4, **config)
    assert_follows_law_deciding(target, proposer, SamplingParams(temperature), N_LAW, law_check, f"{case}, ")


sample_without_replacement = sampling.sample_without_replacement


def sample_ignoring_earlier_siblings(probs, count, generator):
    """Broken: draws without replacement but reports the unconditioned draft law for every sibling."""
    return [(token, probs) for token, _ in sample_without_replacement(probs, count, generator)]


@pytest.mark.parametrize("decisions", ["fixed", "controller"])
def test_negative_control_wrong_draft_probs_fails_the_law_test(decisions, law_models, law_check, monkeypatch):
    monkeypatch.setattr(sampling, "sample_without_replacement", sample_ignoring_earlier_siblings)
    config, temperature = LAW_CASES["tree_t1.0"]
    target, draft_lm = law_models
    proposer = DraftModelProposer(draft_lm, k=4, **config)
    controller, n = control_decisions(decisions, proposer, N_CONTROL)
    counts, _ = sample_law(target, proposer, SamplingParams(temperature), n, controller)
    results = law_statistics(counts, exact_law(target, SamplingParams(temperature)), n, law_check)
    for name, (stat, critical, tv) in results.items():
        assert stat >= critical, f"broken draft_probs passed the law test on {name} (chi2 {stat:.1f} < {critical:.1f}, TV {tv:.3f})"


# ---------------------------------------------------------------------------------------
# Construction: config, vocabulary, size


def save_with_tokenizer(model, path, rename: dict[int, str] | None = None):
    """Save ``model`` with a word-level tokenizer over its vocabulary (``rename`` changes some token strings)."""
    names = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, model.config.vocab_size)]
    for i, name in (rename or {}).items():
        names[i] = name
    backend = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token=names[3]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = dict(zip(["pad_token", "bos_token", "eos_token", "unk_token"], names[:4], strict=True))
    model.save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=backend, **specials).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(model, drafts, tmp_path_factory):
    """Target, matching draft and mismatched drafts saved as directories with tokenizers."""
    root = tmp_path_factory.mktemp("draft_model")
    target_dir = save_with_tokenizer(model, root / "target")
    target = type(model).from_pretrained(target_dir, dtype=torch.float32).eval()
    return {
        "target": target,
        "draft": save_with_tokenizer(drafts["other"], root / "draft"),
        "renamed": save_with_tokenizer(drafts["other"], root / "renamed", rename={77: "w77x"}),
        "other_eos": save_with_tokenizer(drafts["other"], root / "other_eos", rename={2: "<eos>"}),
    }


def test_load_proposer_builds_a_draft_model_from_a_directory(checkpoints, prompt, reference):
    target = checkpoints["target"]
    proposer = load_proposer({"type": "draft_model", "model": checkpoints["draft"]}, target=target)
    assert isinstance(proposer, DraftModelProposer) and proposer.vocab_size == 128 and proposer.k == 4
    assert SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt, max_new_tokens=MAX_NEW).new_tokens == reference


def test_config_keys_are_the_constructor_arguments(checkpoints):
    """No copy of the signature to keep in step: the loader reads the constructor (``target`` comes from the caller)."""
    init = [p for p in inspect.signature(DraftModelProposer).parameters if p != "target"]
    with pytest.raises(ValueError, match=rf"valid keys: {init}".replace("[", r"\[").replace("]", r"\]")):
        load_proposer({"type": "draft_model", "model": checkpoints["draft"], "depth": 3}, target=checkpoints["target"])
    proposer = load_proposer({"type": "draft_model", "model": checkpoints["draft"], "k": 6, "lean_forward": False})
    assert (proposer.k, proposer.lean) == (6, None)


def test_config_errors(checkpoints):
    target = checkpoints["target"]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['depth'\].*valid keys"):
        load_proposer({"type": "draft_model", "model": checkpoints["draft"], "depth": 3}, target=target)
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['model'\]"):
        load_proposer({"type": "draft_model"}, target=target)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_proposer({"type": "draft_model", "model": "/nonexistent/draft"}, target=target)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"k": 0}, "k and tree_width"),
        ({"tree_width": 0}, "k and tree_width"),
        ({"max_nodes": 0}, "max_nodes"),
        ({"dynamic": True, "k": 9, "k_max": 8}, "k_min <= k <= k_max"),
        ({"confidence_threshold": 1.5}, "confidence_threshold"),
    ],
)
def test_bad_settings(kwargs, message, drafts):
    with pytest.raises(InputError, match=message):
        DraftModelProposer(drafts["other"], **kwargs)


def test_vocabulary_size_mismatch_is_refused(model, make_llama):
    with pytest.raises(InputError, match="draft vocabulary size 64 differs from the target's 128"):
        DraftModelProposer(make_llama(vocab_size=64, hidden_size=16), target=model)


@pytest.mark.parametrize(
    "name,message",
    [("renamed", "token id 77 is 'w77x' in the draft"), ("other_eos", "draft eos_token is '<eos>' but the target's is '</s>'")],
)
def test_tokenizer_mismatch_is_refused(name, message, checkpoints):
    with pytest.raises(InputError, match=message):
        load_proposer({"type": "draft_model", "model": checkpoints[name]}, target=checkpoints["target"])


def test_a_draft_bigger_than_the_target_warns(model, make_llama):
    with pytest.warns(UserWarning, match="cannot pay"):
        DraftModelProposer(make_llama(hidden_size=64), target=model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DraftModelProposer(make_llama(hidden_size=16), target=model)


# ---------------------------------------------------------------------------------------
# Loading: broken files are one InputError line naming the file (load_target shares the loader)

CORRUPTIONS = {
    "truncated weights": ("model.safetensors", lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])),
    "config not JSON": ("config.json", lambda f: f.write_text("{not json")),
    "config without model_type": ("config.json", lambda f: f.write_text(json.dumps({"vocab_size": 128}))),
    "tokenizer.json truncated": ("tokenizer.json", lambda f: f.write_text(f.read_text()[:100])),
    "tokenizer_config.json not JSON": ("tokenizer_config.json", lambda f: f.write_text("{oops")),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_load_draft_model_names_the_broken_file_in_one_line(kind, checkpoints, tmp_path):
    directory = tmp_path / "draft"
    shutil.copytree(checkpoints["draft"], directory)
    name, corrupt = CORRUPTIONS[kind]
    corrupt(directory / name)
    for load in (lambda: load_draft_model(directory), lambda: load_proposer({"type": "draft_model", "model": str(directory)})):
        with pytest.raises(InputError) as error:
            load()
        message = str(error.value)
        assert "draft " in message and str(directory / name) in message and "\n" not in message, message


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_vllm_export_round_trip(tied, model, drafts, tmp_path):
    """The export is a checkpoint that loads back equal, tensor by tensor, with the draft_model speculative config."""
    draft = copy.deepcopy(drafts["other"])
    if tied:
        draft.config.tie_word_embeddings = True
        draft.tie_weights()
    proposer = DraftModelProposer(draft, k=5, target=model)
    exported = proposer.export(tmp_path / "draft")
    assert exported.speculative_config == {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 5}
    assert json.loads((tmp_path / "draft" / "speculative_config.json").read_text()) == exported.speculative_config
    back = load_draft_model(tmp_path / "draft")
    for name, tensor in draft.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    again = DraftModelProposer(back, k=5, target=model)
    prompt = torch.tensor([[1, 5, 9, 5, 9, 17]])
    plain = SpeculativeDecoder(model).generate(prompt, max_new_tokens=12).new_tokens
    assert SpeculativeDecoder(model, again, adaptive=False).generate(prompt, max_new_tokens=12).new_tokens == plain


def test_vllm_export_warns_about_what_the_engine_does_not_draft_and_refuses_bad_requests(model, drafts, tmp_path):
    with pytest.warns(UserWarning, match="drafts a 4-token chain every step; tree_width, dynamic, confidence_threshold and min_path_prob"):
        DraftModelProposer(drafts["other"], tree_width=2, target=model).export(tmp_path / "tree")
    with pytest.raises(InputError, match=r"exports to \['vllm'\], got format 'sglang'"):
        DraftModelProposer(drafts["other"], target=model).export(tmp_path / "x", format="sglang")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "a").write_text("keep")
    with pytest.raises(InputError, match="is not empty"):
        DraftModelProposer(drafts["other"], target=model).export(tmp_path / "used")
    assert not (tmp_path / ".used.partial").exists()
