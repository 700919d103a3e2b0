"""The tree layer: structure, masks and positions, the dynamic tree builder, KV-cache helpers.

The builder tests drive ``grow_dynamic_tree`` with a fake draft over V = 8 tokens whose
logits depend only on the path of token ids (a seeded table), so every tree is cheap and
exactly reproducible.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from draftsmith.proposers.core.cache import compact_cache, crop_cache
from draftsmith.proposers.core.dynamic_tree import best_nodes, grow_dynamic_tree
from draftsmith.proposers.core.lean_forward import causal_mask
from draftsmith.proposers.core.sampling import SamplingParams, logits_to_probs
from draftsmith.proposers.core.tree import (
    children_lists,
    incremental_tree_mask,
    keep_nodes,
    limit_width,
    node_depths,
    node_paths,
    prune_depth,
    tree_attention_mask,
    tree_position_ids,
    validate_draft,
)
from draftsmith.proposers.core.types import Draft, StopRule
from draftsmith.verify.target import Target

PARENTS = [-1, -1, 0, 0, 2, 1, -1]
ALLOWED = [  # PARENTS' ancestor-or-self matrix; position 0 is the root, position i + 1 node i
    [1, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0, 0],
    [1, 1, 0, 1, 0, 1, 0, 0],
    [1, 0, 1, 0, 0, 0, 1, 0],
    [1, 0, 0, 0, 0, 0, 0, 1],
]


def test_depths_paths_children():
    assert node_depths(PARENTS) == [1, 1, 2, 2, 3, 2, 1]
    assert node_paths(PARENTS) == [[0], [1], [0, 2], [0, 3], [0, 2, 4], [1, 5], [6]]
    assert children_lists(PARENTS) == [[0, 1, 6], [2, 3], [5], [4], [], [], [], []]


def test_verifier_mask_and_positions():
    mask = tree_attention_mask(PARENTS, past_len=3)
    assert mask.shape == (1, 1, 8, 11)
    assert (mask[0, 0, :, :3] == 0).all()  # everyone sees the cached prefix
    assert (mask[0, 0, :, 3:] == 0).int().tolist() == ALLOWED
    assert mask.min() == torch.finfo(torch.float32).min
    assert tree_attention_mask([], past_len=2).tolist() == [[[[0.0, 0.0, 0.0]]]]  # the root alone
    assert tree_position_ids(PARENTS, past_len=3).tolist() == [[3, 4, 4, 5, 5, 6, 5, 4]]


def test_incremental_mask_equals_the_verifier_mask_where_they_overlap():
    """Fed depth by depth (the cache then holds the nodes out of tree order) or all at once,
    each node's row is its row of the verifier's mask, with the root moved into the prefix."""
    past = 3  # the verifier's cache; the draft's holds the root as well
    verifier = tree_attention_mask(PARENTS, past)[0, 0]
    all_at_once = incremental_tree_mask(PARENTS, [], list(range(len(PARENTS))), past + 1)[0, 0]
    torch.testing.assert_close(all_at_once, verifier[1:], rtol=0, atol=0)
    cached: list[int] = []
    for nodes in ([6, 1, 0], [3, 2, 5], [4]):  # an expansion order a draft could use
        mask = incremental_tree_mask(PARENTS, cached, nodes, past + 1)[0, 0]
        assert mask.shape == (len(nodes), past + 1 + len(cached) + len(nodes))
        columns = [past + 1 + node for node in cached + nodes]  # where each fed node sits in the verifier's layout
        torch.testing.assert_close(mask, verifier[[n + 1 for n in nodes]][:, list(range(past + 1)) + columns], rtol=0, atol=0)
        cached += nodes
    with pytest.raises(KeyError):  # node 4's parent (node 2) is not in the cache
        incremental_tree_mask(PARENTS, [0], [4], past + 1)
    # A chain fed at once is plain causal attention: the lean forward's own mask.
    torch.testing.assert_close(incremental_tree_mask([-1, 0, 1], [], [0, 1, 2], 2), causal_mask(2, 3, torch.float32), rtol=0, atol=0)


def test_tree_forward_matches_each_linear_path(model):
    """Every node's logits equal those of a plain forward over its own path."""
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (1, 9))
    tokens = torch.randint(0, 128, (len(PARENTS),))
    target = Target(model)
    target.prefill(prompt[:, :-1])
    out = target.score(int(prompt[0, -1]), Draft(tokens, torch.tensor(PARENTS)))
    for node, path in enumerate(node_paths(PARENTS)):
        ref = model(torch.cat([prompt[0], tokens[path]])[None]).logits[0, -1]
        torch.testing.assert_close(out.logits[node + 1], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[0], model(prompt).logits[0, -1], atol=1e-5, rtol=1e-5)


def test_prune_depth_renumbers_parents():
    probs = torch.softmax(torch.randn(len(PARENTS), 16), -1)
    draft = Draft(torch.arange(len(PARENTS)), torch.tensor(PARENTS), probs)
    pruned = prune_depth(draft, 2)
    assert pruned.token_ids.tolist() == [0, 1, 2, 3, 5, 6]
    assert pruned.parents.tolist() == [-1, -1, 0, 0, 1, -1]
    assert torch.equal(pruned.draft_probs, probs[[0, 1, 2, 3, 5, 6]])
    assert prune_depth(draft, 0).num_nodes == 0
    assert prune_depth(draft, 5) is draft
    assert keep_nodes(draft, [1, 5]).parents.tolist() == [-1, 0]


def test_depths_computed_once_stay_right_through_the_cuts():
    """``validate_draft`` caches each node's depth as it checks the parents; a cut (``keep_nodes``,
    ``prune_depth``) carries the kept nodes' depths: each equals the depths computed afresh."""
    draft = Draft(torch.arange(len(PARENTS)), torch.tensor(PARENTS))
    validate_draft(draft, 16)
    assert draft.__dict__["depth_list"] == node_depths(PARENTS)
    for cut in (keep_nodes(draft, [0, 1, 2, 5]), keep_nodes(draft, [0, 1, 2]), prune_depth(draft, 1), limit_width(draft, 1)):
        assert "depth_list" in cut.__dict__
        assert cut.depth_list == node_depths(cut.parents.tolist())
    fresh = Draft(torch.arange(3), torch.tensor([-1, 0, 0]))  # never validated: computed when first read
    assert "depth_list" not in fresh.__dict__ and fresh.depth_list == [1, 2, 2]


def test_chain_detection():
    assert Draft.chain([4, 5, 6]).is_chain()
    assert not Draft(torch.tensor([1, 2]), torch.tensor([-1, -1])).is_chain()
    assert Draft.empty().is_chain()


# ---------------------------------------------------------------------------------------
# The dynamic tree builder

V = 8


def fake_logits(path: tuple[int, ...]) -> torch.Tensor:
    """``[V]`` draft logits after the token path ``path``: a seeded table, the same on every call."""
    seed = sum((t + 1) * 31**i for i, t in enumerate(path)) % (2**31)
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 2.0


class FakeDraft:
    """A ``score`` callback over ``fake_logits`` that records every call."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def __call__(self, tree, nodes):
        self.calls.append(list(nodes))
        paths = node_paths(tree.parents)
        return torch.stack([fake_logits(tuple(tree.tokens[j] for j in paths[n])) for n in nodes])


def grow(depth=4, width=3, temperature=0.0, sampled=False, seed=0, **kwargs):
    score = FakeDraft()
    generator = torch.Generator().manual_seed(seed)
    grown = grow_dynamic_tree(fake_logits(()), score, depth, width, SamplingParams(temperature), sampled, generator=generator, **kwargs)
    return grown, score


def path_scores(draft: Draft) -> list[float]:
    """Cumulative draft log-prob of each node, recomputed in float64 from its path."""
    tokens = draft.token_ids.tolist()
    scores = []
    for path in node_paths(draft.parent_list):
        prefix = tuple(tokens[j] for j in path[:-1])
        log_probs = torch.log_softmax(fake_logits(prefix).double(), -1)
        scores.append((scores[path[-2]] if len(path) > 1 else 0.0) + float(log_probs[tokens[path[-1]]]))
    return scores


def test_deterministic_tree_expands_the_best_leaves_with_top_k_children():
    grown, score = grow(depth=3, width=2)
    draft = grown.draft
    assert draft.num_nodes == 2 + 4 + 4 and grown.depth == 3 and draft.draft_probs is None
    tokens, parents, scores = draft.token_ids.tolist(), draft.parent_list, path_scores(draft)
    paths = node_paths(parents)
    for parent, children in enumerate(children_lists(parents)):
        prefix = () if parent == 0 else tuple(tokens[j] for j in paths[parent - 1])
        if children:
            assert [tokens[c] for c in children] == torch.topk(fake_logits(prefix), len(children)).indices.tolist()
    for call, expanded in zip(score.calls, ([0, 1], [2, 3, 4, 5]), strict=True):  # the 2 best leaves of each depth
        assert sorted(call) == sorted(sorted(expanded, key=lambda n: -scores[n])[:2])
        assert call == sorted(call, key=lambda n: -scores[n])


def test_budget_rerank_is_the_best_n_closed_under_ancestors():
    """A deterministic tree is grown in full, then cut to the N best nodes by cumulative log-prob (EAGLE-2)."""
    full, _ = grow(depth=4, width=3)
    scores = path_scores(full.draft)
    for max_nodes in (1, 4, 10, 17):
        grown, _ = grow(depth=4, width=3, max_nodes=max_nodes)
        kept = grown.tree_nodes
        assert len(kept) == max_nodes == grown.draft.num_nodes and kept == sorted(kept)
        parents = full.draft.parent_list
        assert all(parents[n] == -1 or parents[n] in kept for n in kept), "not closed under ancestors"
        ranked = sorted(range(len(scores)), key=lambda n: -scores[n])
        assert scores[ranked[max_nodes - 1]] - scores[ranked[max_nodes]] > 1e-4  # no near-tie: the check below is meaningful
        assert set(kept) == set(ranked[:max_nodes])
        expected = keep_nodes(full.draft, kept)
        assert torch.equal(grown.draft.token_ids, expected.token_ids) and torch.equal(grown.draft.parents, expected.parents)
        assert grown.depth == max(node_depths(expected.parent_list))


def test_best_nodes_ties_keep_ancestors():
    # A child with probability 1 ties its parent; the parent (earlier) ranks first.
    assert best_nodes([-1.0, -1.0, -1.0, -0.5], 2) == [0, 3]
    assert best_nodes([0.0, -math.inf, -math.inf], 2) == [0, 1]


def test_budget_stops_growing_once_the_rerank_is_settled():
    """A chain's budget is reached after N nodes: the rerank cannot change, so no more draft forwards."""
    grown, score = grow(depth=6, width=1, max_nodes=3)
    assert grown.draft.is_chain() and grown.draft.num_nodes == 3 and len(score.calls) == 2
    unbudgeted, _ = grow(depth=3, width=1)
    assert torch.equal(grown.draft.token_ids, unbudgeted.draft.token_ids)


@pytest.mark.parametrize("least", [0.05, 0.2])
def test_a_stop_rule_leaves_the_nodes_worth_less_than_its_least_unexpanded(least):
    """A greedy tree under a ``StopRule`` (here a node's value is the product of its path's own confidences) is the full
    tree minus the descendants of its nodes worth less than ``least``, grown with fewer draft forwards. A sampled tree
    ignores the rule (the trim leaves a sampled tree whole): the same draws as without it."""
    rule = StopRule(lambda depth, confidence: confidence, least)
    full, full_score = grow(depth=5, width=3)
    stopped, stopped_score = grow(depth=5, width=3, stop=rule)
    values: list[float] = []
    rule.values(full.draft.parent_list, full.draft.depth_list, full.draft.scores, values)
    kept = [n for n, parent in enumerate(full.draft.parent_list) if parent < 0 or values[parent] >= least]  # values never rise
    assert 0 < len(kept) < full.draft.num_nodes, "the rule must stop something here, or the check below is empty"
    expected = keep_nodes(full.draft, kept)
    assert torch.equal(stopped.draft.token_ids, expected.token_ids) and torch.equal(stopped.draft.parents, expected.parents)
    assert sum(map(len, stopped_score.calls)) < sum(map(len, full_score.calls))
    sampled = [grow(depth=4, width=2, temperature=1.0, sampled=True, seed=5, **extra)[0].draft for extra in ({}, {"stop": rule})]
    assert torch.equal(sampled[0].token_ids, sampled[1].token_ids) and torch.equal(sampled[0].parents, sampled[1].parents)


@pytest.mark.parametrize("level", [0.1, 0.3])
def test_a_stop_rule_drafts_no_depth_whose_leaves_are_worth_less_than_its_level_together(level):
    """A greedy chain under a ``StopRule`` whose ``level`` is above a node's value stops there: the full chain's prefix to
    that node, one draft forward a depth before it. A tree runs a depth's forward only for leaves worth ``level`` together,
    and stops once they are not. Negative control: ``level`` 0 drafts the whole chain."""
    rule = StopRule(lambda depth, confidence: confidence, 0.0, level)
    full, _ = grow(depth=6, width=1)
    values: list[float] = []
    rule.values(full.draft.parent_list, full.draft.depth_list, full.draft.scores, values)
    stop_at = next((depth for depth, value in enumerate(values, start=1) if value < level), None)
    assert stop_at is not None and 1 < stop_at < 6, (values, "the rule must stop inside the chain, or the check is empty")
    stopped, score = grow(depth=6, width=1, stop=rule)
    assert stopped.draft.token_list == full.draft.token_list[:stop_at] and len(score.calls) == stop_at - 1
    assert grow(depth=6, width=1, stop=StopRule(rule.chance, 0.0, 0.0))[0].draft.token_list == full.draft.token_list
    tree, tree_score = grow(depth=6, width=3, stop=rule)
    values = []
    rule.values(tree.draft.parent_list, tree.draft.depth_list, tree.draft.scores, values)
    assert all(sum(values[n] for n in leaves) >= level for leaves in tree_score.calls)
    assert len(tree_score.calls) < len(grow(depth=6, width=3)[1].calls)


@pytest.mark.parametrize("max_nodes", [None, 30])
@pytest.mark.parametrize("min_path_prob", [0.03, 0.08, 0.2])
def test_min_path_prob_is_the_full_tree_without_its_unlikely_nodes(min_path_prob, max_nodes):
    """A greedy tree under a path-probability floor is the unfloored tree minus the nodes below it, with fewer draft forwards."""
    full, full_score = grow(depth=5, width=3, max_nodes=max_nodes)
    expanded: list[float] = []  # the path score of every leaf the floored builder expanded

    def score(tree, nodes):
        expanded.extend(tree.scores[n] for n in nodes)
        return FakeDraft()(tree, nodes)

    floored = grow_dynamic_tree(fake_logits(()), score, 5, 3, SamplingParams(0.0), False, max_nodes=max_nodes, min_path_prob=min_path_prob)
    floor = math.log(min_path_prob)
    scores = path_scores(full.draft)
    kept = [n for n, s in enumerate(scores) if s >= floor]
    assert 0 < len(kept) < full.draft.num_nodes, "the floor must cut something here, or the check below is empty"
    expected = keep_nodes(full.draft, kept)
    assert torch.equal(floored.draft.token_ids, expected.token_ids) and torch.equal(floored.draft.parents, expected.parents)
    assert all(s >= floor - 1e-6 for s in path_scores(floored.draft))
    assert expanded and all(s >= floor for s in expanded), "a leaf under the floor was expanded"
    if min_path_prob == 0.2:  # a floor this high ends the growth early: fewer draft forwards than the full tree's
        assert len(expanded) < sum(map(len, full_score.calls))


def test_min_path_prob_never_drops_a_sampled_node():
    """A sampled tree keeps every drawn node (dropping one for its own value would bias the verifier); only expansion stops."""

    def expanded_under_floor(draft: Draft) -> list[int]:
        tokens, parents = draft.token_ids.tolist(), draft.parent_list
        children = children_lists(parents)
        path_prob: list[float] = []
        for i, p in enumerate(parents):
            path_prob.append((path_prob[p] if p >= 0 else 1.0) * float(draft.draft_probs[i, tokens[i]]))
        assert any(q < 0.3 for q in path_prob), "no node under the floor was drawn: the check is empty"
        return [i for i, q in enumerate(path_prob) if q < 0.3 and children[i + 1]]

    floored, _ = grow(depth=4, width=2, temperature=1.0, sampled=True, seed=3, min_path_prob=0.3)
    assert expanded_under_floor(floored.draft) == []
    unfloored, _ = grow(depth=4, width=2, temperature=1.0, sampled=True, seed=3)
    assert expanded_under_floor(unfloored.draft), "the negative control: without the floor such nodes grow children"


def test_sampled_tree_keeps_siblings_in_draw_order_with_their_rows():
    """Sibling k was drawn from the processed draft distribution with siblings 0..k-1 removed, renormalised."""
    sampling = SamplingParams(0.7)
    grown, _ = grow(depth=3, width=3, temperature=0.7, sampled=True, seed=1)
    draft = grown.draft
    tokens, paths = draft.token_ids.tolist(), node_paths(draft.parent_list)
    assert draft.draft_probs is not None and draft.num_nodes > 3
    for parent, children in enumerate(children_lists(draft.parent_list)):
        if not children:
            continue
        prefix = () if parent == 0 else tuple(tokens[j] for j in paths[parent - 1])
        remaining = logits_to_probs(fake_logits(prefix), sampling)
        for child in children:
            torch.testing.assert_close(draft.draft_probs[child], remaining / remaining.sum())
            assert draft.draft_probs[child, tokens[child]] > 0
            remaining = remaining.clone()
            remaining[tokens[child]] = 0.0
        assert len({tokens[c] for c in children}) == len(children)  # without replacement


def test_sampled_budget_keeps_the_first_n_draws():
    """The budget cuts a sampled tree in draw order: the same draws as without it, the first N kept."""
    full, _ = grow(depth=3, width=3, temperature=1.0, sampled=True, seed=4)
    for max_nodes in (2, 5, 9):
        grown, _ = grow(depth=3, width=3, temperature=1.0, sampled=True, seed=4, max_nodes=max_nodes)
        assert grown.tree_nodes == list(range(max_nodes))
        assert torch.equal(grown.draft.token_ids, full.draft.token_ids[:max_nodes])
        assert torch.equal(grown.draft.parents, full.draft.parents[:max_nodes])
        assert torch.equal(grown.draft.draft_probs, full.draft.draft_probs[:max_nodes])


def test_deterministic_children_at_a_positive_temperature():
    """Top-k children are a parameter of their own: point masses even when the request samples."""
    greedy, _ = grow(depth=3, width=2)
    sampling, _ = grow(depth=3, width=2, temperature=0.7, sampled=False)
    assert sampling.draft.draft_probs is None
    assert torch.equal(sampling.draft.token_ids, greedy.draft.token_ids)


def test_confidence_threshold_stops_expansion():
    """A leaf under the threshold stays in the tree without children and is never scored."""
    threshold = 0.3
    grown, score = grow(depth=4, width=2, confidence_threshold=threshold)
    draft = grown.draft
    tokens, parents = draft.token_ids.tolist(), draft.parent_list
    paths = node_paths(parents)
    confidence = []
    for node, path in enumerate(paths):
        prefix = tuple(tokens[j] for j in path[:-1])
        confidence.append(float(torch.softmax(fake_logits(prefix), -1)[tokens[node]]))
    scored = {n for call in score.calls for n in call}
    assert any(c < threshold for c in confidence) and scored, "the case is not exercised"
    for node, children in enumerate(children_lists(parents)[1:]):
        if confidence[node] < threshold:
            assert not children and node not in scored
    chain, chain_score = grow(depth=6, width=1, confidence_threshold=0.99)
    assert chain.draft.num_nodes == 1 and chain.depth == 1 and not chain_score.calls


# ---------------------------------------------------------------------------------------
# KV cache


def filled_cache(length: int, layers: int = 2) -> DynamicCache:
    """A cache whose key and value at position i are all i (1 batch, 2 heads, head dim 4)."""
    cache = DynamicCache()
    positions = torch.arange(length, dtype=torch.float32)[None, None, :, None].expand(1, 2, length, 4)
    for layer in range(layers):
        cache.update(positions.clone(), positions.clone() + 100, layer)
    return cache


def cached_positions(cache: DynamicCache) -> list[list[int]]:
    return [layer.keys[0, 0, :, 0].int().tolist() for layer in cache.layers]


def test_crop_and_compact_cache():
    cache = filled_cache(10)
    crop_cache(cache, 7)
    assert cached_positions(cache) == [list(range(7))] * 2
    compact_cache(cache, 3, [5, 6])  # the kept positions are not contiguous with the prefix: a copy
    assert cached_positions(cache) == [[0, 1, 2, 5, 6]] * 2
    assert cache.layers[1].values[0, 1, :, 2].int().tolist() == [100, 101, 102, 105, 106]
    cache = filled_cache(10)
    keys = cache.layers[0].keys
    compact_cache(cache, 4, [4, 5])  # a contiguous path: a crop, views of the same storage
    assert cached_positions(cache) == [list(range(6))] * 2
    assert cache.layers[0].keys.data_ptr() == keys.data_ptr()
    assert cache.get_seq_length() == 6


def test_limit_width_keeps_each_nodes_first_children_in_draft_order_with_their_subtrees():
    #        -1
    #      0  1  2        (2 is the root's third child)
    #    3 4     5
    #    6
    parents = [-1, -1, -1, 0, 0, 2, 3]
    draft = Draft(torch.arange(10, 17), torch.tensor(parents), torch.rand(7, 20), scores=[0.1 * i for i in range(7)])
    chain = limit_width(draft, 1)
    assert chain.token_list == [10, 13, 16] and chain.is_chain()
    assert torch.equal(chain.draft_probs, draft.draft_probs[[0, 3, 6]]) and chain.scores == pytest.approx([0.0, 0.3, 0.6])
    two = limit_width(draft, 2)
    assert two.token_list == [10, 11, 13, 14, 16] and two.parent_list == [-1, -1, 0, 0, 2]
    assert limit_width(draft, 3) is draft and limit_width(draft, None) is draft
    straight = Draft.chain([1, 2, 3])
    assert limit_width(straight, 1) is straight
