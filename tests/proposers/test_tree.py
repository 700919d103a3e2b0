"""Tree utilities: masks and positions score a tree like its linear paths; pruning; depths."""

from __future__ import annotations

import torch

from draftsmith.proposers.base import Draft
from draftsmith.verify.target import Target
from draftsmith.proposers.tree import (
    ancestor_matrix,
    children_lists,
    node_depths,
    path_to,
    prune_depth,
    tree_attention_mask,
    tree_position_ids,
)

PARENTS = [-1, -1, 0, 0, 2, 1, -1]


def test_depths_paths_children():
    assert node_depths(PARENTS) == [1, 1, 2, 2, 3, 2, 1]
    assert path_to(PARENTS, 4) == [0, 2, 4]
    assert children_lists(PARENTS) == [[0, 1, 6], [2, 3], [5], [4], [], [], [], []]


def test_mask_and_positions():
    anc = ancestor_matrix(PARENTS)
    assert anc[5].tolist() == [True, True, False, True, False, True, False, False]  # root, node 0, node 2, node 4
    mask = tree_attention_mask(PARENTS, past_len=3)
    assert mask.shape == (1, 1, 8, 11)
    assert (mask[0, 0, :, :3] == 0).all()  # everyone sees the cached prefix
    assert ((mask[0, 0, :, 3:] == 0) == anc).all()
    assert tree_position_ids(PARENTS, past_len=3).tolist() == [[3, 4, 4, 5, 5, 6, 5, 4]]


def test_tree_forward_matches_each_linear_path(model):
    """Every node's logits equal those of a plain forward over its own path."""
    torch.manual_seed(0)
    prompt = torch.randint(0, 128, (1, 9))
    tokens = torch.randint(0, 128, (len(PARENTS),))
    target = Target(model)
    target.prefill(prompt[:, :-1])
    out = target.score(int(prompt[0, -1]), Draft(tokens, torch.tensor(PARENTS)))
    for node in range(len(PARENTS)):
        path = tokens[path_to(PARENTS, node)]
        ref = model(torch.cat([prompt[0], path])[None]).logits[0, -1]
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


def test_chain_detection():
    assert Draft.chain([4, 5, 6]).is_chain()
    assert not Draft(torch.tensor([1, 2]), torch.tensor([-1, -1])).is_chain()
    assert Draft.empty().is_chain()
