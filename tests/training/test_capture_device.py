"""Training's captures on the model's device: what a head's loss reads is on the batch's device, online and offline.

Without a GPU, ``benchmarks.device_mode.StandInDevice`` puts the frozen target on a stand-in
device; the batch is there (accelerate's prepared loader puts it on its device), offline
features come from the host as shards store them. Nothing may mix host and device tensors,
and the captured tensors must be on the batch's device. A capturer that leaves stored features
on the host (the negative control) must be caught.
"""

from __future__ import annotations

import torch

from benchmarks.device_mode import StandInDevice
from draftsmith.training.capture import Capturer, final_layer

LAYERS = (1, -1)


def batches(target):
    """An online batch and an offline one (the stored features on the host, as a shard gives them), both on the device."""
    ids = torch.tensor([[5, 9, 17, 23, 41, 5, 9]], device=target.device)
    with torch.no_grad():
        states = target(input_ids=ids, output_hidden_states=True).hidden_states
    stored = {f"hidden.{layer % (final_layer(target) + 1)}": states[layer].detach().cpu() for layer in (*LAYERS, final_layer(target))}
    return {"input_ids": ids}, {"input_ids": ids, **stored}


def test_captured_features_are_on_the_batch_device_online_and_offline(make_llama):
    target = make_llama(layers=2).requires_grad_(False)
    with StandInDevice(target) as mode:
        online, offline = batches(target)
        for batch, offline_mode in ((online, False), (offline, True)):
            captured = Capturer(target, LAYERS, logits=True, offline=offline_mode)(batch)
            assert all(mode.on_device(h) for h in captured.hidden.values()) and mode.on_device(captured.logits)
            (captured.logits.float().softmax(-1) * captured.hidden[-1].sum()).sum()  # a loss mixes them with the batch's tensors
    assert mode.violations == []


def test_negative_control_stored_features_left_on_the_host_are_caught(make_llama):
    target = make_llama(layers=2).requires_grad_(False)
    with StandInDevice(target) as mode:
        _, offline = batches(target)
        head = target.get_output_embeddings()
        head(offline[f"hidden.{final_layer(target)}"])  # the old offline path: the LM head on the stored (host) state
    assert any("mixes device tensors with host tensors" in v for v in mode.violations), mode.violations
