"""The recurrent layers' native decode steps (delta_rule_step_, ssd_step_) update the slots' states in place as their
torch code does: a fresh slot from zeros, the others from what they hold, the slots not in the step untouched."""

import shutil

import pytest
import torch

from kvserve.kernels import ops

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    from kvserve.kernels import load_kernels

    assert load_kernels()


SLOTS = torch.tensor([4, 0, 2])
FRESH = torch.tensor([False, True, False])


def both(op, states, *args):
    """(native output, native states), (torch output, torch states) from the same states."""
    native_states, torch_states = states.clone(), states.clone()
    got = op(native_states, SLOTS, FRESH, *args, native=True)
    want = op(torch_states, SLOTS, FRESH, *args, native=False)
    return (got, native_states), (want, torch_states)


def test_delta_rule_step_equals_its_torch_code():
    torch.manual_seed(0)
    heads, dk, dv = 3, 16, 8
    states = torch.randn(6, heads, dk, dv)
    q, k = torch.randn(3, heads, dk), torch.nn.functional.normalize(torch.randn(3, heads, dk), dim=-1)
    v, beta, decay = torch.randn(3, heads, dv), torch.rand(3, heads), torch.rand(3, heads)
    (got, got_states), (want, want_states) = both(ops.delta_rule_step_, states, q, k, v, beta, decay)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_states[[1, 3, 5]], states[[1, 3, 5]])
    assert not torch.equal(got_states[0], states[0])  # the fresh slot: written from zeros


def test_ssd_step_equals_its_torch_code():
    torch.manual_seed(1)
    heads, groups, p, n = 4, 2, 8, 16
    states = torch.randn(6, heads, p, n)
    x, dt = torch.randn(3, heads, p), torch.rand(3, heads)
    A, D = -torch.rand(heads), torch.randn(heads)
    B, C = torch.randn(3, groups, n), torch.randn(3, groups, n)
    (got, got_states), (want, want_states) = both(ops.ssd_step_, states, x, dt, A, B, C, D)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_states[[1, 3, 5]], states[[1, 3, 5]])


def test_a_slot_out_of_range_is_refused():
    states = torch.zeros(2, 1, 4, 4)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.kvserve.delta_rule_step_(states, torch.tensor([2]), torch.tensor([False]), torch.zeros(1, 1, 4),
                                           torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), torch.zeros(1, 1),
                                           torch.zeros(1, 1))
