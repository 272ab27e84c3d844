"""A stand-in for Debian's ``pyverbs``, for node *processes* started by the tests.

The RDMA code (``pegaflow/node/tiers/remote/rdma.py``) imports ``pyverbs`` and uses the classes
of its submodules. Putting ``tests/fakes`` first on ``PYTHONPATH`` gives such a process the
fake verbs layer of ``tests/unit/fake_verbs.py`` instead, with the devices named in
``PEGAFLOW_FAKE_RDMA_DEVICES`` (comma-separated): the node's own code runs unchanged, only
the hardware edge is fake. The fabric lives inside the one process, so a node can open its
devices, register its pool and answer handshakes; a READ between two processes has no
shared fabric and completes with an error, as between two hosts on unconnected NICs.
"""

from __future__ import annotations

import os
import sys
import types

from tests.unit.fake_verbs import Fabric

_DEVICES = [d for d in os.environ.get("PEGAFLOW_FAKE_RDMA_DEVICES", "").split(",") if d]
_v = Fabric(_DEVICES).verbs()


def _module(name: str, **attrs: object) -> types.ModuleType:
    m = types.ModuleType(f"{__name__}.{name}")
    m.__dict__.update(attrs)
    sys.modules[m.__name__] = m
    return m


addr = _module("addr", AHAttr=_v.AHAttr, GlobalRoute=_v.GlobalRoute, GID=_v.GID)
cq = _module("cq", CQ=_v.CQ)
device = _module("device", Context=_v.Context)
mr = _module("mr", MR=_v.MR)
pd = _module("pd", PD=_v.PD)
qp = _module("qp", QP=_v.QP, QPCap=_v.QPCap, QPInitAttr=_v.QPInitAttr, QPAttr=_v.QPAttr)
wr = _module("wr", SGE=_v.SGE, SendWR=_v.SendWR)
enums = _v.e
