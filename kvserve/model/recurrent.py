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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.attention.backend import SeqRows

# the recurrence over one group: (the convolution's output [S, L, channels], the other per-row inputs [S, L, ...], the
# states [S, *state_shape]) -> (output [S, L, width], the states after the last row)
Recurrence = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class SlotStates:
    """Every state slot's: the convolution's previous inputs [slots, taps - 1, channels] and the recurrent state
    [slots, *state_shape] (not parameters: the model's weight count leaves them out)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class RecurrentMixer(nn.Module):
    plain = False  # the decoder's bf16 hand-offs are attention's
    sinks = None

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
                      width: int, recurrence: Recurrence) -> torch.Tensor:
        """The step's rows [T, width]: each sequence's ``conv_in`` rows [T, channels] through the convolution and
        ``recurrence`` (with its rows of each of ``extras``), from its slot's states, which it leaves updated."""
        y = conv_in.new_empty(conv_in.shape[0], width)
        device = conv_in.device
        for idx, seqs in groups_by_length(meta.seqs, device):
            slots = [s.state_slot for s in seqs]
            if any(s.start > 0 and (slot < 0 or self.states is None) for s, slot in zip(seqs, slots)):
                raise RuntimeError("a recurrent layer continues a sequence without a state slot")
            conv_prev, state = self._states_of(slots, [s.start == 0 for s in seqs], conv_in.dtype, device)
            u, conv_next = self.convolve(conv_in[idx], conv_prev)
            out, state = recurrence(u, *(e[idx] for e in extras), state)
            y[idx.flatten()] = out.flatten(0, 1).to(y.dtype)
            keep = [i for i, slot in enumerate(slots) if slot >= 0]
            if keep and self.states is not None:
                at, which = torch.tensor([slots[i] for i in keep], device=device), torch.tensor(keep, device=device)
                self.states.conv[at] = conv_next[which].to(self.states.conv.dtype)
                self.states.recurrent[at] = state[which]
        return y

    def _states_of(self, slots: list[int], fresh: list[bool], dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The states the sequences continue from: their slots', zeros where a sequence starts (or has no slot)."""
        n = len(slots)
        conv = torch.zeros(n, self.taps - 1, self.channels, dtype=dtype, device=device)
        state = torch.zeros(n, *self.state_shape, device=device)
        go_on = [i for i in range(n) if not fresh[i] and slots[i] >= 0]
        if go_on and self.states is not None:
            at, which = torch.tensor([slots[i] for i in go_on], device=device), torch.tensor(go_on, device=device)
            conv[which] = self.states.conv[at].to(dtype)
            state[which] = self.states.recurrent[at]
        return conv, state

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
