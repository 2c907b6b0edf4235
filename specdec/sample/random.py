"""Counter-based randomness: every uniform is a pure function of (seed, output position, purpose).

A stream (``torch.Generator``) would hand out its next number to whoever asks first, so the
number a token is sampled with would depend on how many drafts were verified before it. Keyed
draws do not: the token at output position t is sampled with ``uniform(seed, t, TARGET)`` with or
without speculation, alone or batched, whatever k the controller chose.

The hash is SplitMix64's finaliser (Steele et al., "Fast splittable pseudorandom number
generators", OOPSLA 2014), chained over the three keys; 53 bits of it make a double in [0, 1).
"""

from __future__ import annotations

import enum

_MASK = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


class Purpose(enum.IntEnum):
    """What a draw is for: draws for different purposes at one position are independent."""

    TARGET = 1  # the target's token (plain decoding, bonus tokens, sample-and-match)
    DRAFT = 2  # a drafter's token sampled from q (draft_sample_method "probabilistic")
    ACCEPT = 3  # the acceptance test u < p(x) / q(x)
    RESIDUAL = 4  # the recovered token from norm(max(0, p - q))


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform draw in [0, 1) keyed by (seed, output position, purpose)."""
    h = _mix((seed + _GAMMA) & _MASK)
    h = _mix((h + position * _GAMMA + 1) & _MASK)
    h = _mix((h + int(purpose) * _GAMMA + 2) & _MASK)
    return (h >> 11) * (1.0 / (1 << 53))


def normalize_seed(seed: int) -> int:
    """A seed in [-2**63, 2**64) as the unsigned 64-bit key the draws use."""
    return seed & _MASK
