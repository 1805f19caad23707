"""The sizes ``psr-hf bench-generate`` runs at where its command line leaves them out, by the device it runs on. On
CUDA they are the sizes its goals are stated at. A CPU runs the small models, for a first look that should take
seconds (and the CUDA prompt and tokens together run past the shipped tiny-moe's 512 positions): a short prompt, a
few tokens and the fewest rounds an interval allows. Imports no torch, so that ``--help`` can state them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GenerateSizes:
    """A prompt of ``prompt_tokens`` tokens, ``new_tokens`` timed decode tokens, ``rounds`` interleaved rounds."""

    prompt_tokens: int
    new_tokens: int
    rounds: int


#: the setups it times, in their fixed order
SETUPS = ("transformers", "engine_resident", "engine_offloaded", "transformers_offloaded")

CUDA_SIZES = GenerateSizes(prompt_tokens=512, new_tokens=64, rounds=3)
CPU_SIZES = GenerateSizes(prompt_tokens=64, new_tokens=16, rounds=2)


def sizes_for(device: str, *, prompt_tokens: int | None = None, new_tokens: int | None = None,
              rounds: int | None = None) -> GenerateSizes:
    """The sizes on ``device`` (a torch device name: ``cuda`` or ``cuda:N`` take :data:`CUDA_SIZES`, any other
    :data:`CPU_SIZES`), with each size that is given (not None) kept as given."""
    base = CUDA_SIZES if str(device).startswith("cuda") else CPU_SIZES
    return GenerateSizes(prompt_tokens=base.prompt_tokens if prompt_tokens is None else prompt_tokens,
                         new_tokens=base.new_tokens if new_tokens is None else new_tokens,
                         rounds=base.rounds if rounds is None else rounds)


def sizes_help(size: str) -> str:
    """``--help``'s default of ``size`` (a :class:`GenerateSizes` field): its value on CUDA and elsewhere."""
    return f"default: {getattr(CUDA_SIZES, size)} on CUDA, {getattr(CPU_SIZES, size)} on a CPU"
