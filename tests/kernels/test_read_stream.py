"""ops.read_stream, the bandwidth probe of `kvserve bench roofline` (it reads every byte once), and
ops.zeros_huge, the memory of packed weights."""

import numpy as np
import pytest
import torch

from kvserve.kernels import ops


@pytest.fixture(scope="module")
def kernels():
    if not ops.available():
        pytest.skip("native kernels not loaded")

@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 1000, (3 << 20) + 77])
def test_read_stream_checksum_is_the_xor_of_every_byte(kernels, nbytes):
    g = torch.Generator().manual_seed(nbytes)
    t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    a = t.numpy()
    words = np.frombuffer(a[: nbytes // 8 * 8].tobytes(), dtype=np.uint64)
    want = int(np.bitwise_xor.reduce(words)) if len(words) else 0
    for b in a[nbytes // 8 * 8:]:  # the tail, byte by byte
        want ^= int(b)
    assert ops.read_stream(t) & (2**64 - 1) == want


@pytest.mark.parametrize("nbytes", [0, 100, (5 << 20) + 3])
def test_zeros_huge_is_zeroed_writable_memory_of_that_size(kernels, nbytes):
    t = ops.zeros_huge(nbytes)
    assert t.dtype == torch.uint8 and t.shape == (nbytes,) and not t.any()
    t.fill_(7)  # its own memory, every byte of it
    assert int(t.sum()) == 7 * nbytes
