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
    conv_silu = True  # SiLU on the convolution's output (Griffin's RG-LRU takes it without)

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
        for g in step_groups(meta, conv_in.device, self.states is not None):
            conv_prev = conv_in.new_zeros(g.size, self.taps - 1, self.channels)
            if g.carried:
                assert self.states is not None
                conv_prev[g.carried] = self.states.conv[g.carried_slots].to(conv_in.dtype)
            u, conv_next = self.convolve(conv_in[g.rows], conv_prev)
            rows = [e[g.rows] for e in extras]
            if g.decode:  # every sequence a decode row with its slot
                assert self.states is not None
                out = self.step(u, *rows, states=self.states.recurrent, slots=g.slots, fresh=g.fresh)
            else:
                state = torch.zeros(g.size, *self.state_shape, device=conv_in.device)
                if g.carried:
                    assert self.states is not None
                    state[g.carried] = self.states.recurrent[g.carried_slots]
                out, state = self.recurrence(u, *rows, state)
                if g.kept.numel():
                    assert self.states is not None
                    self.states.recurrent[g.slots] = state[g.kept]
            if g.kept.numel():
                assert self.states is not None
                self.states.conv[g.slots] = conv_next[g.kept].to(self.states.conv.dtype)
            y[g.flat] = out.flatten(0, 1).to(y.dtype)
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
        """u [S, L, channels] after ``prev`` [S, taps - 1, channels]: the convolution's output (with SiLU where
        ``conv_silu``), and the last taps - 1 inputs (the next state)."""
        window = torch.cat([prev.to(u.dtype), u], dim=1)  # [S, taps - 1 + L, channels]
        out = (window.unfold(1, self.taps, 1) * self.kernel.to(u.dtype)).sum(-1)  # unfold: [S, L, channels, taps]
        if self.conv_bias is not None:
            out = out + self.conv_bias.to(out.dtype)
        return F.silu(out) if self.conv_silu else out, window[:, window.shape[1] - (self.taps - 1):]


@dataclass
class Group:
    """Sequences of one step with the same row count, as every recurrent layer of the step takes them."""

    rows: torch.Tensor  # [S, L] their rows in the step
    flat: torch.Tensor  # the same, flattened
    size: int
    kept: torch.Tensor  # which of them hold a slot (indices into the group)
    slots: torch.Tensor  # those slots
    fresh: torch.Tensor  # bool [S]: starting at position 0 (their states from zeros)
    carried: list[int]  # which continue a state (they hold a slot and do not start)
    carried_slots: torch.Tensor
    decode: bool  # one row each, every one with a slot: the group takes ``step``


def step_groups(meta: AttentionMetadata, device: torch.device, has_states: bool) -> list[Group]:
    """The step's sequences grouped by row count (decodes together); worked out once a step, for every layer."""
    memo = getattr(meta, "recurrent_groups", None)
    if memo is not None:
        return memo
    by_length: dict[int, tuple[list[list[int]], list[SeqRows]]] = {}
    first = 0
    for seq in meta.seqs:
        n = len(seq.tokens)
        rows, members = by_length.setdefault(n, ([], []))
        rows.append(list(range(first, first + n)))
        members.append(seq)
        first += n
    groups = []
    for length, (rows, seqs) in by_length.items():
        if any(s.start > 0 and (s.state_slot < 0 or not has_states) for s in seqs):
            raise RuntimeError("a recurrent layer continues a sequence without a state slot")
        kept = [i for i, s in enumerate(seqs) if s.state_slot >= 0] if has_states else []
        carried = [i for i in kept if seqs[i].start > 0]
        idx = torch.tensor(rows, device=device)
        groups.append(Group(
            rows=idx, flat=idx.flatten(), size=len(seqs), kept=torch.tensor(kept, device=device, dtype=torch.long),
            slots=torch.tensor([seqs[i].state_slot for i in kept], device=device, dtype=torch.long),
            fresh=torch.tensor([s.start == 0 for s in seqs], device=device), carried=carried,
            carried_slots=torch.tensor([seqs[i].state_slot for i in carried], device=device, dtype=torch.long),
            decode=length == 1 and len(kept) == len(seqs)))
    meta.recurrent_groups = groups  # type: ignore[attr-defined]
    return groups
