"""What the tests of trained heads (Medusa, EAGLE) share: small targets of other architectures, and heads fitted in seconds.

Heads that guess nothing would make greedy-identity and law tests vacuous, so the tests fit
them briefly by their family's own objective on the target's greedy continuations: drafts
are then accepted often, and rejected often.
"""

from __future__ import annotations

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, Qwen2Config, Qwen2ForCausalLM

from draftsmith.training.capture import capture


def greedy_sequences(target, count: int = 16, new: int = 44, seed: int = 0) -> torch.Tensor:
    """``[count, 4 + new]``: random 4-token prompts continued greedily by ``target``."""
    vocab = target.get_output_embeddings().weight.shape[0]
    prompts = torch.randint(3, vocab, (count, 4), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return target.generate(prompts, max_new_tokens=new, do_sample=False, pad_token_id=0)


def fit(objective, target, sequences: torch.Tensor, lr: float, steps: int, build_seed: int | None = None):
    """The objective's draft or heads, fitted by its own loss to ``sequences`` (every position counts); in eval mode."""
    if build_seed is not None:
        torch.manual_seed(build_seed)
    model = objective.build(target, None, [{"input_ids": row} for row in sequences.tolist()])
    captured = capture(target, sequences, objective.hidden_layers, True)
    batch = {"input_ids": sequences, "loss_mask": torch.ones_like(sequences, dtype=torch.bool)}
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss, _ = objective.loss(model, batch, captured)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def sharpened(model):
    """``model`` with 8x larger logits (greedy argmaxes far from ties), in eval mode."""
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.eval()


def tiny_qwen2(layers: int):
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512,
    )  # fmt: skip
    return sharpened(Qwen2ForCausalLM(config))


def tiny_neox(layers: int):
    torch.manual_seed(2)
    config = GPTNeoXConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=512
    )
    return sharpened(GPTNeoXForCausalLM(config))
