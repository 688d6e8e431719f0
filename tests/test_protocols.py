"""Every backend of an op has the op's entry points (gemm/protocols.py, decoding/call.py,
attention/common.py), with the protocol's parameters, so the op's code calls them without
asking which backend it has."""

import inspect

import pytest

import jattn  # noqa: F401  (registers the ops)
from jattn._src import backends
from jattn._src.attention.common import AttentionBackend
from jattn._src.decoding.call import DecodeBackend
from jattn._src.gemm import protocols

PROTOCOLS = {"matmul": protocols.MatmulBackend, "bmm": protocols.MatmulBackend,
             "mm_plus_mm": protocols.MmPlusMmBackend, "scaled_matmul": protocols.ScaledBackend,
             "b2b_matmul": protocols.B2BBackend, "mixed_matmul": protocols.MixedBackend,
             "flex_decode": DecodeBackend, "flex_attention": AttentionBackend}


@pytest.mark.parametrize("op", sorted(PROTOCOLS))
def test_every_backend_has_the_ops_entry_points(op):
    protocol = PROTOCOLS[op]
    entry_points = [name for name, value in vars(protocol).items()
                    if inspect.isfunction(value) and not name.startswith("_")]
    assert entry_points
    for implementation in backends.implementations(op).values():
        for name in entry_points:
            expected = list(inspect.signature(getattr(protocol, name)).parameters)[1:]  # self
            found = getattr(implementation.module, name, None)
            assert found is not None, f"{implementation} has no {name}"
            assert list(inspect.signature(found).parameters) == expected, (implementation, name)
