"""Target features a proposer was shown but has not fed yet: queued per observe, joined once when fed.

Proposers that read the target's hidden states (EAGLE, DFlash) are shown the features of the
scored positions after every verification, but feed them to their own layers only when the
next draft is asked for; a step the speculation controller plans plain then costs one
append, not a copy of everything queued so far.
"""

from __future__ import annotations

import torch

from .types import TargetFeatures


class FeatureQueue:
    """The queued features of ``layers`` (``output_hidden_states`` ids), in position order.

    Args:
        layers: the hidden layers the proposer reads, side by side in that order when fed.
        who: the proposer, for the message when a verification did not hand them over.
    """

    def __init__(self, layers: tuple[int, ...], who: str):
        self.layers, self.who = tuple(layers), who
        self.blocks: list[list[torch.Tensor]] = []  # per observe: each layer's [rows, hidden]

    def start(self, features: TargetFeatures | None) -> None:
        """A new request: forget what is queued, queue the prompt's features."""
        self.blocks = []
        self.push(features)

    def push(self, features: TargetFeatures | None) -> None:
        """Queue the scored positions' features (after each verification)."""
        if features is None or any(layer not in features.hidden_states for layer in self.layers):
            raise ValueError(f"the {self.who} proposer needs the target's hidden layers {list(self.layers)} with every observe")
        self.blocks.append([features.hidden_states[layer] for layer in self.layers])

    def pop(self, device: torch.device) -> torch.Tensor:
        """Every queued position's features ``[rows, n_layers * hidden]`` (the layers side by side), float, on the proposer's
        ``device`` (a target split over devices hands each layer over from its own); the queue empties."""
        blocks, self.blocks = self.blocks, []
        layers = [(torch.cat(parts) if len(parts) > 1 else parts[0]).to(device) for parts in zip(*blocks, strict=True)]
        return (torch.cat(layers, dim=-1) if len(layers) > 1 else layers[0]).float()
