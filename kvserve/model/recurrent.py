"""What the token mixers with a recurrent state share (Mamba-2: ``kvserve.model.mamba``; the gated delta rule:
``kvserve.model.gated_delta``): a depthwise causal convolution over part of their input projection, then a recurrence
whose state sums up the whole sequence.

Each sequence keeps both states from one step to the next in its slot (``SeqRows.state_slot``, which the KV manager
gives it while it runs): the convolution's last kernel - 1 inputs, and the recurrence's state in float32. A sequence
whose step starts at position 0 starts from zeros (a new or a preempted one), so chunked prefill and preemption carry
the state; a prefix-cache hit could not (the state is the whole sequence's), and such models run without the prefix
cache. The step's sequences run in groups of equal row counts: the decodes all at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.attention.backend import SeqRows


@dataclass
class SlotStates:
    """Every state slot's: the convolution's previous inputs [slots, taps - 1, channels] and the recurrent state
    [slots, *state_shape] (not parameters: the model's weight count leaves them out)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class RecurrentMixer(nn.Module):
    plain = False  # the decoder's bf16 hand-offs are attention's
    sinks = None
    native = False  # decode steps through the native kernels (set by the model: CausalLM.use_native_ops)

    def __init__(self, channels: int, taps: int, state_shape: tuple[int, ...], conv_bias: bool):
        super().__init__()
        self.channels, self.taps, self.state_shape = channels, taps, state_shape
        self.kernel = nn.Parameter(torch.zeros(channels, taps))  # [channels, taps], oldest first
        self.conv_bias = nn.Parameter(torch.zeros(channels)) if conv_bias else None
        self.states: SlotStates | None = None  # allocate_states

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one sequence's states take (the convolution's inputs in ``dtype``, the recurrent one in float32)."""
        return ((self.taps - 1) * self.channels * torch.empty(0, dtype=dtype).element_size()
                + torch.Size(self.state_shape).numel() * 4)

    def allocate_states(self, slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """Room for ``slots`` sequences' states (0: none; a step may then only start sequences, unkept)."""
        self.states = None if not slots else SlotStates(
            torch.zeros(slots, self.taps - 1, self.channels, dtype=dtype, device=device),
            torch.zeros(slots, *self.state_shape, device=device))

    def runs_bf16(self, *args) -> bool:
        return False

    def run_sequences(self, meta: AttentionMetadata, conv_in: torch.Tensor, extras: Sequence[torch.Tensor],
                      width: int) -> torch.Tensor:
        """The step's rows [T, width]: each sequence's ``conv_in`` rows [T, channels] through the convolution and
        ``recurrence`` (with its rows of each of ``extras``), from its slot's states, which it leaves updated. Groups of
        one row a sequence (decodes) take ``step`` instead, which updates the slots' states in place."""
        y = conv_in.new_empty(conv_in.shape[0], width)
        device = conv_in.device
        for idx, seqs in groups_by_length(meta.seqs, device):
            slots = [s.state_slot for s in seqs]
            if any(s.start > 0 and (slot < 0 or self.states is None) for s, slot in zip(seqs, slots)):
                raise RuntimeError("a recurrent layer continues a sequence without a state slot")
            fresh = [s.start == 0 for s in seqs]
            keep = [i for i, slot in enumerate(slots) if slot >= 0] if self.states is not None else []
            at, which = torch.tensor([slots[i] for i in keep], device=device), torch.tensor(keep, device=device)
            conv_prev = conv_in.new_zeros(len(seqs), self.taps - 1, self.channels)
            carried = [i for i in keep if not fresh[i]]
            if carried and self.states is not None:
                conv_prev[carried] = self.states.conv[[slots[i] for i in carried]].to(conv_in.dtype)
            u, conv_next = self.convolve(conv_in[idx], conv_prev)
            rows = [e[idx] for e in extras]
            if idx.shape[1] == 1 and len(keep) == len(seqs):  # every sequence a decode row with its slot
                assert self.states is not None
                out = self.step(u, *rows, states=self.states.recurrent, slots=at,
                                fresh=torch.tensor(fresh, device=device))
            else:
                state = torch.zeros(len(seqs), *self.state_shape, device=device)
                if carried and self.states is not None:
                    state[carried] = self.states.recurrent[[slots[i] for i in carried]]
                out, state = self.recurrence(u, *rows, state)
                if keep:
                    assert self.states is not None
                    self.states.recurrent[at] = state[which]
            if keep:
                assert self.states is not None
                self.states.conv[at] = conv_next[which].to(self.states.conv.dtype)
            y[idx.flatten()] = out.flatten(0, 1).to(y.dtype)
        return y

    def recurrence(self, u: torch.Tensor, *rows_and_state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's recurrence over a group: (the convolution's output u [S, L, channels], the extras' rows [S, L,
        ...], the states [S, *state_shape]) -> (the output [S, L, width], the states after the last row)."""
        raise NotImplementedError

    def step(self, u: torch.Tensor, *rows: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
             fresh: torch.Tensor) -> torch.Tensor:
        """One row a sequence: ``recurrence``'s output, the states ``states[slots]`` (zeros first where ``fresh``)
        updated in place. A subclass runs it natively."""
        state = states[slots].masked_fill(fresh.view(-1, *[1] * len(self.state_shape)), 0)
        out, state = self.recurrence(u, *rows, state)
        states[slots] = state
        return out

    def convolve(self, u: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u [S, L, channels] after ``prev`` [S, taps - 1, channels]: the convolution's output with SiLU, and the
        last taps - 1 inputs (the next state)."""
        window = torch.cat([prev.to(u.dtype), u], dim=1)  # [S, taps - 1 + L, channels]
        out = (window.unfold(1, self.taps, 1) * self.kernel.to(u.dtype)).sum(-1)  # unfold: [S, L, channels, taps]
        if self.conv_bias is not None:
            out = out + self.conv_bias.to(out.dtype)
        return F.silu(out), window[:, window.shape[1] - (self.taps - 1):]


def groups_by_length(seqs: Sequence[SeqRows], device: torch.device) -> list[tuple[torch.Tensor, list[SeqRows]]]:
    """The step's sequences grouped by their row count (decodes together), each group's row indices [S, L]."""
    groups: dict[int, tuple[list[list[int]], list[SeqRows]]] = {}
    first = 0
    for seq in seqs:
        n = len(seq.tokens)
        rows, members = groups.setdefault(n, ([], []))
        rows.append(list(range(first, first + n)))
        members.append(seq)
        first += n
    return [(torch.tensor(rows, device=device), members) for rows, members in groups.values()]
