"""Expert-parallel MoE dispatch and combine over torch.distributed (gloo on CPU, nccl on GPUs).

Experts are split evenly over the ranks of `group`: rank r owns experts
[r * E / W, (r + 1) * E / W). Tokens stay on the rank that holds them; their rows travel to the
experts' ranks and back with `all_to_all_single`:

    dispatch: rows for each rank's experts are gathered with our `gather` (one contiguous block per
              destination rank) and sent with all_to_all_single and split sizes
    experts:  the caller runs its local experts on the received rows
    combine:  results go back by the reverse all_to_all, then our index_add adds them into the
              token rows with the routing weights (fp32 accumulation, deterministic order)

Two layouts:
- static capacity: the caller's slot table [E * C] (token id or -1 per slot, as in a
  static-capacity MoE); every rank sends C rows per expert, padding included (fixed split sizes).
  Every rank must have the same C: a small all_reduce checks it, and the tables' shapes, and
  raises the same ValueError on every rank otherwise.
- dropless: every (token, expert) choice is sent; split sizes come from an all_to_all of per-expert
  counts first.

Every rank must call each function collectively, in the same order. Times of the local steps and of
the communication are accumulated in `ExpertParallel.timings` (seconds) when `profile=True`.
"""
import contextlib
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from ._api import gather, index_add

__all__ = ["ExpertParallel", "DroplessState", "settled"]

def _by_gloo(group: Optional[dist.ProcessGroup], device_type: str) -> bool:
    """Whether the group moves tensors of this device type with gloo: its backend config is
    "gloo", or per device, "cpu:gloo,cuda:nccl" (init_process_group() with no backend names no
    single one)."""
    config = str(dist.get_backend_config(group))
    per_device = dict(p.split(":", 1) for p in config.split(",") if ":" in p)
    return per_device.get(device_type, config) == "gloo" and hasattr(torch.Tensor, "_use_count")


@contextlib.contextmanager
def settled(*tensors: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> Iterator[None]:
    """Around a blocking gloo collective over these tensors: leaves only once gloo's worker thread
    has let go of them.

    That thread drops a finished collective's tensors a moment after the call returns, and needs
    the GIL to do it (each tensor's Python object is released with it). A process that exits
    within that moment aborts ("terminate called without an active exception"), so a script whose
    last act is a collective should run it inside this. It waits with the GIL released, 1 s at
    most; with another backend, or under torch.compile, it does nothing."""
    if not tensors or torch.compiler.is_compiling() or not _by_gloo(group, tensors[0].device.type):
        yield
        return
    held = [t._use_count() for t in tensors]
    yield
    deadline = time.monotonic() + 1.0
    while any(t._use_count() > h for t, h in zip(tensors, held)) and time.monotonic() < deadline:
        time.sleep(0)


@dataclass
class DroplessState:
    order_token: torch.Tensor  # [S] token id of each sent row, expert-sorted
    order_weight: torch.Tensor  # [S] routing weight of each sent row
    send_splits: List[int]  # rows sent to each rank
    recv_splits: List[int]  # rows received from each rank
    recv_sort: torch.Tensor  # permutation that groups received rows by local expert
    local_counts: List[int]  # received rows per local expert


class ExpertParallel:
    def __init__(self, num_experts: int, group: Optional[dist.ProcessGroup] = None, profile: bool = False):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if num_experts % self.world != 0:
            raise ValueError(f"num_experts must be divisible by the world size {self.world}, got {num_experts}")
        self.num_experts = num_experts
        self.local_experts = num_experts // self.world
        self.first_expert = self.rank * self.local_experts
        self.profile = profile
        self.timings: Dict[str, float] = {"dispatch": 0.0, "communication": 0.0, "combine": 0.0}

    def _timed(self, key, fn):
        if not self.profile:
            return fn()
        t0 = time.perf_counter()
        out = fn()
        self.timings[key] += time.perf_counter() - t0
        return out

    def _all_to_all(self, rows: torch.Tensor, send: Optional[List[int]], recv: Optional[List[int]]) -> torch.Tensor:
        n = sum(recv) if recv is not None else rows.shape[0]
        out = rows.new_empty((n,) + tuple(rows.shape[1:]))
        src = rows.contiguous()
        self._timed("communication", lambda: self._transfer(out, src, send, recv))
        return out

    def _transfer(self, out: torch.Tensor, src: torch.Tensor, send, recv) -> None:
        with settled(out, src, group=self.group):
            dist.all_to_all_single(out, src, recv, send, group=self.group)

    # --- static capacity ------------------------------------------------------------------------

    def dispatch_static(self, x: torch.Tensor, slot_token: torch.Tensor) -> torch.Tensor:
        """x [T, H], slot_token [E * C] (-1 = empty). Returns this rank's expert inputs,
        [local_experts, W * C, H]: for each local expert, C slots from every rank in rank order."""
        e, w = self.num_experts, self.world
        c = slot_token.numel() // e
        shape_error = None
        if slot_token.dim() != 1 or slot_token.numel() != c * e:
            shape_error = (f"slot_token must be 1-D with num_experts ({e}) x C slots, got shape "
                           f"{tuple(slot_token.shape)} on rank {self.rank}")
        if not torch.compiler.is_compiling():
            # Every rank must hold a valid table with the same C (the transfers' sizes follow from
            # it): one small collective, then the same error on every rank, where a rank that
            # raised alone would leave the others waiting, gloo would abort on a size mismatch and
            # nccl could read past a buffer.
            cs = torch.tensor([c, -c, shape_error is not None], dtype=torch.int64, device=x.device)
            with settled(cs, group=self.group):
                self._timed("communication", lambda: dist.all_reduce(cs, op=dist.ReduceOp.MAX, group=self.group))
            hi, lo, bad = int(cs[0]), -int(cs[1]), int(cs[2])
            if shape_error is not None:
                raise ValueError(shape_error)
            if bad:
                raise ValueError("slot_token has the wrong shape on another rank (its error names it)")
            if hi != c or lo != c:
                raise ValueError(f"static capacity needs the same slots per expert on every rank: C = {c} "
                                 f"on rank {self.rank}, from {lo} to {hi} over the ranks")
        elif shape_error is not None:
            raise ValueError(shape_error)
        send = self._timed("dispatch", lambda: gather(x, slot_token, ignore_index=-1))  # [E*C, H], rank-major
        recv = self._all_to_all(send, None, None)  # [W * E_local * C, H]
        h = x.shape[1]
        return recv.view(w, self.local_experts, c, h).transpose(0, 1).reshape(self.local_experts, w * c, h)

    def combine_static(self, y: torch.Tensor, slot_token: torch.Tensor, slot_weight: torch.Tensor,
                       num_tokens: int) -> torch.Tensor:
        """y [local_experts, W * C, H] expert outputs; returns [T, H] = sum of weight * row per token."""
        w, h = self.world, y.shape[-1]
        c = y.shape[1] // w
        back = y.view(self.local_experts, w, c, h).transpose(0, 1).reshape(w * self.local_experts * c, h)
        rows = self._all_to_all(back, None, None)  # [E*C, H] in this rank's slot order
        return self._timed("combine", lambda: index_add(rows.new_zeros(num_tokens, h), slot_token, rows,
                                                        weight=slot_weight, ignore_index=-1))

    # --- dropless -------------------------------------------------------------------------------

    def dispatch_dropless(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """x [T, H], experts [T, k] expert ids, weights [T, k]. Returns (rows [R, H] grouped by
        local expert, DroplessState); state.local_counts gives each local expert's row count."""
        t, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # expert-major; token order within an expert
        token = torch.div(order, k, rounding_mode="floor")
        per_expert = torch.bincount(flat, minlength=self.num_experts)
        send_splits = per_expert.view(self.world, self.local_experts).sum(1)
        # exchange per-expert counts, then rows
        recv_counts = self._all_to_all(per_expert.view(self.world, self.local_experts), None, None)  # [W, E_local]
        recv_splits = recv_counts.sum(1).tolist()
        send = self._timed("dispatch", lambda: gather(x, token))
        recv = self._all_to_all(send, send_splits.tolist(), recv_splits)
        # received rows: rank-major, expert-minor -> group by local expert (stable keeps rank order)
        local_expert = torch.repeat_interleave(torch.arange(self.local_experts, device=recv_counts.device).repeat(self.world),
                                               recv_counts.reshape(-1))
        recv_sort = torch.sort(local_expert, stable=True).indices
        state = DroplessState(order_token=token, order_weight=weights.reshape(-1)[order],
                              send_splits=send_splits.tolist(), recv_splits=recv_splits, recv_sort=recv_sort,
                              local_counts=recv_counts.sum(0).tolist())
        rows = self._timed("dispatch", lambda: gather(recv, recv_sort))
        return rows, state

    def combine_dropless(self, y: torch.Tensor, state: DroplessState, num_tokens: int) -> torch.Tensor:
        """y [R, H] expert outputs in dispatch_dropless's row order; returns [T, H]."""
        h = y.shape[-1]
        # undo the grouping by local expert, then send back
        unsorted = self._timed("combine", lambda: index_add(y.new_zeros(y.shape), state.recv_sort, y))
        rows = self._all_to_all(unsorted, state.recv_splits, state.send_splits)
        return self._timed("combine", lambda: index_add(rows.new_zeros(num_tokens, h), state.order_token, rows,
                                                        weight=state.order_weight))
