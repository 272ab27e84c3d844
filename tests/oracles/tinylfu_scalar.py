"""The pure-Python per-key TinyLFU: the reference ``pegaflow/native/sketch.c`` is tested against.

PegaFlow runs the C paths only (docs/architecture.md, "One source of truth"); this is the
same algorithm written out in Python on the same two buffers, so a test can hold them equal
bit for bit (tables, doorkeeper, agings, estimates, decisions).
"""

from __future__ import annotations

from pegaflow.policy.tinylfu import _C1, _C2, _M32, _M64, TinyLFU


class ScalarTinyLFU(TinyLFU):
    """``TinyLFU`` whose ``record``/``estimate``/``admit`` run the Python reference."""

    # The scalar calls are written out long-hand (no helper calls, locals for attributes)
    # because every bytecode shows at a few hundred thousand calls per second.

    def record(self, key: int) -> None:
        """Count one access of ``key``; ages the sketch when the sample period is full."""
        x = (((key & _M64) ^ self._seed_mix) * _C1) & _M64
        x ^= x >> 29
        x = (x * _C2) & _M64
        x ^= x >> 32
        h1 = x >> 32
        h2 = (x & _M32) | 1
        if self._use_doorkeeper:
            dbuf = self._dbuf
            p = (h1 + self._door_step0 * h2) & self._dmask
            q = (p + h2) & self._dmask
            if not ((dbuf[p >> 3] >> (p & 7)) & (dbuf[q >> 3] >> (q & 7)) & 1):
                dbuf[p >> 3] |= 1 << (p & 7)
                dbuf[q >> 3] |= 1 << (q & 7)
                self._samples += 1
                if self._samples >= self.sample_size:
                    self.age()
                return
        buf = self._buf
        wmask = self._wmask
        for base in self._row_base_bytes:
            j = h1 & wmask
            b = base + (j >> 1)
            s = (j & 1) << 2
            if (buf[b] >> s) & 15 != 15:
                buf[b] += 1 << s
            h1 += h2
        self._samples += 1
        if self._samples >= self.sample_size:
            self.age()

    def estimate(self, key: int) -> int:
        """Estimated accesses of ``key`` in the current sample period (0..16, never low)."""
        x = (((key & _M64) ^ self._seed_mix) * _C1) & _M64
        x ^= x >> 29
        x = (x * _C2) & _M64
        x ^= x >> 32
        h1 = x >> 32
        h2 = (x & _M32) | 1
        est = 0
        if self._use_doorkeeper:
            dbuf = self._dbuf
            p = (h1 + self._door_step0 * h2) & self._dmask
            q = (p + h2) & self._dmask
            est = (dbuf[p >> 3] >> (p & 7)) & (dbuf[q >> 3] >> (q & 7)) & 1
        buf = self._buf
        wmask = self._wmask
        m = 15
        for base in self._row_base_bytes:
            j = h1 & wmask
            v = (buf[base + (j >> 1)] >> ((j & 1) << 2)) & 15
            if v < m:
                if not v:
                    return est
                m = v
            h1 += h2
        return est + m

    def admit(self, candidate: int, victim: int) -> bool:
        """True iff ``candidate``'s estimated frequency is strictly greater than ``victim``'s.

        Ties reject: replacing an equally popular resident only costs a write. The caller
        records the candidate's access (``record``) before asking, as TinyLFU prescribes.
        """
        if self.estimate(candidate) > self.estimate(victim):
            self.admitted += 1
            return True
        self.rejected += 1
        return False
