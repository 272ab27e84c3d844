"""Types of ``pegaflow.core._sketch``, built by the install from pegaflow/native/sketch.c.

What each piece does is written in the C file and in ``pegaflow/policy/tinylfu.py``.
"""

from collections.abc import Sequence

import numpy as np
from typing_extensions import Buffer

class Sketch:
    """Views of a TinyLFU's count-min table and doorkeeper with its per-key paths in C."""

    def __init__(
        self,
        table: Buffer,
        door: Buffer,
        depth: int,
        width: int,
        door_bits: int,
        door_step0: int,
        seed_mix: int,
        sample_size: int,
        use_door: bool,
    ) -> None: ...
    def record(self, key: int, samples: int) -> tuple[int, int]: ...  # (samples, agings)
    # keys: ints, or a contiguous ndarray of 8-byte integers
    def record_many(self, keys: Sequence[int] | np.ndarray, samples: int) -> tuple[int, int]: ...
    def estimate(self, key: int) -> int: ...  # 0..16
    def admit(self, candidate: int, victim: int) -> bool: ...

def block_keys(salt: int, hashes: Sequence[bytes]) -> list[int]: ...
