"""Where tensors live: the request's seeded generators, one per device, and what a read by the host costs there.

On a CPU the host reads a tensor's value for free: its memory is the host's. On a GPU each
read (``.item()``, ``.tolist()``, ``int(t)``, ``bool(t)``) waits for every kernel queued
before it, so code that reads a value per node on the CPU (stopping early, which is fastest
there) reads the whole outcome once on other devices. ``reads_are_free`` tells the two
apart; ``benchmarks/bench_syncs.py`` and ``tests/verify/test_device.py`` empty
``FREE_READS`` to run the device forms on the CPU.
"""

from __future__ import annotations

import hashlib

import torch

from .errors import InputError

#: device types whose tensors the host reads without waiting (their values are in its memory)
FREE_READS = {"cpu"}


def reads_are_free(device: torch.device) -> bool:
    """Whether the host reads tensors on ``device`` for free (a CPU), so that reading per node costs nothing."""
    return device.type in FREE_READS


def host_lists(*tensors: torch.Tensor) -> list[list]:
    """Each tensor's ``tolist()``, read by the host at once: one sync for all of them on a GPU.

    Integer tensors come back as ints, floating ones as floats (through float64, exact for
    ids below 2**53). On a device whose reads are free each is read as it is.
    """
    if not tensors or reads_are_free(tensors[0].device):
        return [t.tolist() for t in tensors]
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, start = [], 0
    for t in tensors:
        values = flat[start : start + t.numel()]
        start += t.numel()
        if not t.is_floating_point():
            values = [int(v) for v in values]
        out.append(_shape(values, tuple(t.shape)))
    return out


def _shape(values: list, shape: tuple[int, ...]):
    if len(shape) == 0:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_shape(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


def check_shared_device(who: str, device: torch.device, shared: dict[str, torch.Tensor | None]) -> None:
    """Raise InputError unless the target's tensors a head shares (its ``shared`` embedding / LM head) sit on the head's ``device``.

    A head that reads the target's embedding or LM head runs where they are: they are the
    target's, so moving the head (``.to``) does not move them.
    """
    for name, tensor in shared.items():
        if tensor is not None and tensor.device != device:
            raise InputError(
                f"the {who} is on {device} but the target's {name} it shares is on {tensor.device}: put the head on "
                f"{tensor.device} (a proposer loaded with target= puts it on target.device)"
            )


class SeededGenerators:
    """One request's seeded generators, one per device it draws on: the same seed gives the same draws run to run.

    ``torch.multinomial(rows, 1, generator=g)`` needs ``g`` on the rows' device. The device
    the request is verified on (the target's logits') gets the seed itself; any other
    device (a draft model or head placed elsewhere) a seed derived from the seed and the
    device's name, so no two devices draw the same stream: a draft seeded like its verifier
    on a second GPU of the same kind would draw the very numbers its tokens are tested with.

    Args:
        seed: the request's seed.
        device: the device that gets the seed itself.
    """

    def __init__(self, seed: int, device: torch.device | str):
        self.seed, self.device = seed, torch.device(device)
        self._generators: dict[torch.device, torch.Generator] = {}

    def on(self, device: torch.device | str) -> torch.Generator:
        """The generator for draws on ``device`` (made at its first use)."""
        device = torch.device(device)
        generator = self._generators.get(device)
        if generator is None:
            seed = self.seed if device == self.device else _derived_seed(self.seed, device)
            generator = self._generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generator


def _derived_seed(seed: int, device: torch.device) -> int:
    """A seed for ``device`` from the request's, the same in every process (Python's ``hash`` of a string is not)."""
    digest = hashlib.sha256(f"{seed}:{device}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
