"""An experts implementation for Hugging Face transformers' MoE models: Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V3, GPT-OSS and every other model whose experts module is decorated with
`@use_experts_implementation`.

    from scatter_add import moe
    moe.register()                                   # -> "scatter_add"
    model.set_experts_implementation("scatter_add")  # or experts_implementation="scatter_add"

The layer, for the S = tokens * top_k (token, expert) pairs:

    route:    pairs sorted by expert id (stable: token order inside an expert) -> the token of
              each pair and where each expert's rows end
    dispatch: xs = gather(hidden_states, token)        one contiguous block of rows per expert
    experts:  per expert e, on its block: h = xs @ gate_up_proj[e] (+ bias), a = gate(h) (the
              model's own `_apply_gate`, or `act_fn` for experts without a gate),
              y = a @ down_proj[e] (+ bias), then the model's post-expert norm if it has one
    combine:  out = index_add(zeros, token, y, weight=routing weight of each pair)
              (weights fused, float32 accumulation, one rounding per output element)

Expert ids >= num_experts (expert parallelism's sentinels for experts on other ranks) get no
rows of compute: they sort last, past every expert's block, and the dispatch and combine skip
them through ignore_index. Both layouts are handled: [E, out, in] weights and GPT-OSS's
transposed [E, in, out] with biases and interleaved gate/up columns.

Autograd: in eager mode the experts are one autograd function. Its forward takes the products of
the inference loop and keeps the pre-activations; its backward runs the same blocks (gradients of
every weight, bias, input and routing weight; the gate's derivative is taken over all rows at
once, written out for transformers' default silu(gate) * up with autograd's bits, by autograd
over the gate otherwise), by torch's grouped products where they apply, else block by block;
in bf16 where torch has no oneDNN bf16 product (AVX2 CPUs), block by block with this library's
small_matmul / small_matmul_nn (see _own_products). On the CPU each expert weight's gradient is
written into a buffer kept for that weight, reused once nothing else holds it (see _grad_like;
SCATTER_ADD_MOE_KEEP_GRADS=0 keeps none).
Under torch.compile the products are two opaque grouped ops
and the gate is traced, so a block compiles to one graph. Under torch.autocast the weights and
biases of the experts that run are cast to its dtype (as F.linear's are) and the products, gate
and biases run in it, where those experts get enough rows to pay for the casts (see
_autocast_operands); GPT-OSS's eager adds its biases in float32 after each product, so there
ours is about twice as far from float64 (bf16's level either way). transformers is imported
only by `register`.

Threads: the routing, the dispatch, the combine and the order of the expert blocks do not depend
on the thread count. The expert products are torch's matrix products, and those are not always
bitwise the same across thread counts: oneDNN (bf16) and MKL (fp32/fp64) split the reduction of
some shapes over threads (e.g. a down projection of 45-128 rows at hidden 1024, intermediate
3584 differs in the last bit between 1 and 2 threads), for every experts implementation alike.
Where the products are reproducible, so is the layer. On a CPU with T >= 2 threads, a call
whose blocks average 16 rows or more and fall into two gate groups or more (about a million
pre-activations: from about 80 tokens for a Mixtral block of hidden 1024, 256 for Qwen3-MoE's
reduced one) splits them over P teams of threads, T / P intra-op threads each (see
_team_parts): with two threads every product then runs on one thread, and the output and
gradients have the bits of a one-thread run. An expert's bfloat16 products take this library's
own products (`ops.small_matmul` / `ops.small_matmul_nn`, float32 sums, the same bits on every
thread count) instead: with AMX, the forward products of blocks of at most _TILE_ROWS rows
(192; [E, out, in] weights without bias), on the tiles (`ops.small_matmul_tiles`); without it,
blocks of at most four rows (decode) where torch multiplies bf16 by oneDNN, every product of
every block where it does not (AVX2 CPUs): see _small_ok, _small_rows and _own_products. A gate
group whose blocks all take it multiplies them in one `ops.small_matmul_grouped` call per
product (_small_grouped), with the same bits.
"""
import contextlib
import functools
import os
import queue
import sys
import threading
from typing import List, Optional

import torch

from ._api import gather, index_add, scatter_add
from ._ops import add_op_namespace_prefix, ops

__all__ = ["experts_forward", "register", "release_gradient_buffers", "NAME"]

NAME = "scatter_add"
_IGNORE = -1
_SWAP_MAX_ROWS = 128  # see _linear
_GATE_GROUP_ELEMS = 1 << 20  # see _experts_loop: 2 MiB of bf16 pre-activations per gate call


def _amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, on which oneDNN multiplies bfloat16 (Sapphire Rapids and
    later Xeons). The products' forms below were measured in bf16 on a Xeon with AMX and on an
    EPYC without it."""
    f = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    try:
        return bool(f()) if f is not None else False
    except Exception:
        return False


# The forms of the forward products: with AMX the swapped ones where they pay (_linear,
# _grouped_swapped), without it plain ones (_grouped_plain). Tests set it to run either anywhere.
_AMX = _amx_tiles()


# --- small products ------------------------------------------------------------------------------
# Blocks of a few rows (decode) read each expert weight once for a few dot products, which bounds
# them by memory; torch's bf16 product reached 13-15 GB/s of weight there, this library's
# small_matmul 18-35 GB/s. Without AMX (EPYC, AVX-512, bf16, two threads, ms per product of
# `small_matmul` / torch.mm, rows 1 / 2 / 3 / 4): Mixtral's up 7168 x 1024 0.81 / 1.44, 0.91 /
# 1.03, 1.06 / 1.44, 0.99-1.22 / 0.95-1.09; down 1024 x 3584 0.21 / 0.43, 0.26 / 0.35, 0.39 /
# 0.60, 0.34-0.39 / 0.38-0.59; Qwen3-MoE's up 768 x 1024 0.018 / 0.062, 0.022 / 0.062, 0.098 /
# 0.121, 0.041-0.049 / 0.069-0.143; 8x7B's up 28672 x 4096 7.9 / 12.6, 8.0 / 11.3, 10.3 / 14.7,
# 9.6-9.9 / 12.6-14.1. At eight rows it is 0.71x to 1.09x of torch.mm (its float32 FMAs bound
# it): so four rows at most. With AMX, small_matmul runs on the tiles instead (_TILE_ROWS).
_SMALL_ROWS = 4
_small_kernel = None  # whether small_matmul runs on this CPU: probed on first use
# With AMX, small_matmul multiplies on the tiles (ops.small_matmul_tiles), reading each expert
# weight as it lies, where torch's oneDNN product repacks it on every call (or multiplies in the
# swapped form): blocks of at most _TILE_ROWS rows take it (see _small_rows; the figures are in
# _tiles_here).
_TILE_ROWS = 192
_TILE_REREAD_BYTES = 16 << 20  # see _small_rows
# small_matmul multiplies rows of more columns by the level's vector kernel, not the tiles
_TILE_MAX_COLS = 1 << 16
_small_tiles = None  # whether small_matmul runs on AMX tiles here: probed on first use


def _onednn_bf16() -> bool:
    """Whether torch multiplies bfloat16 on this CPU by oneDNN (AVX-512 with BW/VL/DQ, or AMX).
    Elsewhere (AVX2 CPUs) torch's bf16 product is its own reference loop: on an EPYC without
    AVX-512, two threads, 18 GFLOPS at every shape tried (x [128, 1024] @ w.T [1024, 7168]: 104
    ms; float32 there 27 ms), for eager, grouped_mm and batched_mm alike. There every bf16 block
    takes small_matmul, whatever its rows (see _small_rows)."""
    f = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return bool(f()) if f is not None else True
    except Exception:
        return True


_ONEDNN_BF16 = _AMX or _onednn_bf16()


def _small_rows(cols: int, weight) -> int:
    """The most rows of a block of `cols` columns that take small_matmul with one expert of
    `weight` (where _small_ok): with AMX, _TILE_ROWS, and no more than two passes of the tiles'
    kernel over the expert's weight where it holds at most _TILE_REREAD_BYTES, one pass where it
    holds more (a row of x takes 64 bytes per 32 columns there, and the kernel packs at most 1.5
    MiB of rows, at least 32, per pass over the weight, which it reads again for each pass; a
    second pass over Mixtral-8x7B's 224 MiB up projection for 4 rows of 132 cost 20 ms). Measured
    with passes of at most 1 MiB: Mixtral's down projection (3584 columns, 128 rows a pass, 7 MiB)
    on the tiles at 256 rows, 0.730 ms against torch's 0.843, and its block at 512 tokens 1.12x
    -> 1.23x and 1.25x of the best built-in with two passes allowed (two runs); Mixtral-8x7B's
    (14336 columns, 32 rows a pass, 112 MiB) at 64 rows 7.9 ms against 7.3, and that block at 512
    tokens 0.85x of eager before the limit. Without AMX _SMALL_ROWS where torch multiplies bf16
    by oneDNN, every block elsewhere."""
    if _AMX:
        if cols > _TILE_MAX_COLS:
            return 0  # the kernel's vector kernel multiplies such rows (see _TILE_MAX_COLS)
        one_pass = max(32, (3 << 13) // max(1, -(-cols // 32)) // 32 * 32)
        passes = 2 if weight.shape[-2] * weight.shape[-1] * weight.element_size() <= _TILE_REREAD_BYTES else 1
        return min(_TILE_ROWS, passes * one_pass)
    return _SMALL_ROWS if _ONEDNN_BF16 else 1 << 62


def _small_ok(x, weight, bias, transposed) -> bool:
    """Whether the products of x's block take small_matmul (bf16 CPU, [E, out, in] weights; with
    AMX only where small_matmul runs on the tiles)."""
    if (bias is not None or transposed or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16
            or x.device.type != "cpu" or weight.stride(-1) != 1):
        return False
    return _kernel_here() and (not _AMX or _tiles_here())


def _own_products(g, weight) -> bool:
    """Whether every product of a block (forward x @ W_e with either weight layout and any bias,
    backward g @ W_e, g.T @ x) takes this library's small_matmul / small_matmul_nn: bf16 on a CPU
    where torch has no oneDNN bf16 product (see _onednn_bf16). There torch's bf16 products with
    a transposed operand are slower still than its plain ones: g [128, 1024] @ W [1024, 3584]
    989 ms (0.95 GFLOPS), g.T @ a 123 ms, two threads, an EPYC without AVX-512; a Mixtral block's
    backward at 64 tokens took 5.1 s, all but 40 ms of it in those products, for every experts
    implementation alike."""
    return (not _ONEDNN_BF16 and g.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and g.device.type == "cpu" and weight.stride(-1) == 1 and _kernel_here())


def _own_product(x, weight, bias, transposed, out):
    """This library's product for x @ W_e (+ b_e), or None for torch's: where _own_products, every
    block (small_matmul_nn for GPT-OSS's transposed [E, in, out] weights, small_matmul for [E, out,
    in]; a bias is added after it); elsewhere small_matmul for blocks of at most _small_rows(in) rows
    where _small_ok. Rows and `out` must have unit column stride."""
    m = x.shape[0]
    if m == 0 or x.stride(-1) != 1 or (out is not None and out.stride(-1) != 1):
        return None
    if _own_products(x, weight):
        return ops.small_matmul_nn if transposed else ops.small_matmul
    if m <= _small_rows(x.shape[1], weight) and _small_ok(x, weight, bias, transposed):
        return ops.small_matmul
    return None


def _stacked(weight) -> bool:
    """Whether an [E, out, in] weight holds its experts' rows back to back with unit column stride,
    as small_matmul_grouped reads it (a contiguous parameter, or a range of its experts)."""
    e, o, h = weight.shape
    return ((h <= 1 or weight.stride(2) == 1) and (o <= 1 or weight.stride(1) >= h)
            and (e <= 1 or weight.stride(0) == o * (weight.stride(1) if o > 1 else h)))


def _small_grouped(x, weight, e0, ends, longest, out) -> bool:
    """out[block] = x[block] @ W_e.T for the blocks of experts e0, e0 + 1, ... in one
    small_matmul_grouped call (ends: an int tensor, where each of those experts' rows end in x and
    out), where _linear would multiply each of them by small_matmul ([E, out, in] weights without
    bias; every block where _own_products, blocks of at most _small_rows(in) rows where _small_ok):
    the same bits, one call where the loop pays one per block (about 7 us each through the
    dispatcher, plus the slicing) and a parallel region each. Returns whether it ran."""
    if x.stride(-1) != 1 or out.stride(-1) != 1 or not _stacked(weight):
        return False
    if not (_own_products(x, weight)
            or (longest <= _small_rows(x.shape[1], weight) and _small_ok(x, weight, None, False))):
        return False
    return bool(ops.small_matmul_grouped.default(out, x, weight[e0:e0 + ends.shape[0]], ends))


def _kernel_here() -> bool:
    """Whether small_matmul runs on this CPU (probed once)."""
    global _small_kernel
    if _small_kernel is None:
        if torch._C._len_torch_dispatch_stack():
            return False  # a fake or tracing mode: its answer says nothing about this CPU, so not kept
        one = torch.ones(1, 1, dtype=torch.bfloat16, device="cpu")
        _small_kernel = bool(ops.small_matmul.default(torch.empty_like(one), one, one))
    return _small_kernel


def _tiles_here() -> bool:
    """Whether small_matmul multiplies on AMX tiles here (probed once per process, so a later
    ops.small_matmul_tiles(x, 0) leaves the blocks routed to the vector kernel, several times
    slower than torch's products from 8 rows: SCATTER_ADD_CPU_AMX=0 at start turns both off;
    False under a fake or tracing mode, not kept). On the Xeon with AMX, bf16, two threads, eight
    weights of each shape in turn (as a layer's experts come), ms per product, small_matmul on the
    tiles / the fastest of torch's forms (plain x @ W_e.T, swapped (W_e @ x.T).T, or the
    matrix-vector product), at 1 / 8 / 32 / 128 / 256 / 512 rows: Mixtral's up (7168 x 1024) 0.431
    / 0.355 / 0.482 / 0.931 / 1.694 / 3.351 against 0.441 / 0.500 / 0.702 / 1.451 / 2.027 / 3.388;
    its down (1024 x 3584) 0.155 / 0.145 / 0.157 / 0.379 / 0.730 / 1.547 against 0.203 / 0.206 /
    0.226 / 0.591 / 0.843 / 1.652; Qwen3-MoE's up (768 x 1024) 0.039 / 0.035 / 0.038 / 0.099 /
    0.170 / 0.343 against 0.060 / 0.063 / 0.076 / 0.134 / 0.181 / 0.303, its down (1024 x 384)
    0.022 / 0.020 / 0.025 / 0.055 / 0.095 / 0.183 against 0.039 / 0.044 / 0.048 / 0.072 / 0.100 /
    0.152. So the tiles to 192 rows (_TILE_ROWS); from 256 rows the gain is small or a loss."""
    global _small_tiles
    if _small_tiles is None:
        if torch._C._len_torch_dispatch_stack():
            return False
        _small_tiles = bool(ops.small_matmul_tiles.default(torch.empty(0, dtype=torch.bfloat16, device="cpu")))
    return _small_tiles


def _mostly_small(group, x, weight, bias, transposed) -> bool:
    """Whether at least half of a gate group's blocks take small_matmul: the group then stays in
    the loop (_experts_loop), whose _linear multiplies those blocks with it."""
    limit = _small_rows(x.shape[1], weight)
    small = sum(stop - start <= limit for _, start, stop in group)
    return 2 * small >= len(group) and _small_ok(x, weight, bias, transposed)


# --- one expert's products ------------------------------------------------------------------------
# weight is [E, out, in] (x @ weight[e].T), or [E, in, out] when transposed (x @ weight[e]).


def _linear(x, weight, e, bias, transposed, out=None, swap=True):
    """x @ W_e (+ b_e) for one block x [m, in]: written into `out` (rows of a contiguous tensor),
    or returned (a transposed view when swapped).

    swap: a block of at most min(_SWAP_MAX_ROWS, in / 16) rows with [E, out, in] weights (most
    models) is multiplied as (W_e @ x.T).T. The weight is then the left operand, which oneDNN's
    AMX kernels read as it lies, where x @ W_e.T first repacks the whole weight into the right
    operand's layout, on every call; the price is a copy of the transposed result, m * out, which
    outgrows the repacking (out * in) at about m = in / 16. Measured per product (plain time over
    swapped, one thread): Mixtral's up (in 1024) 1.2-1.4x at 2 to 64 rows, down (in 3584)
    1.2-1.8x up to 128; Qwen3-MoE's up (in 1024) 1.3-1.75x at 2 to 16 rows, 1.03x at 64, 0.89x at
    128, down (in 384) 1.2-1.5x at 2 to 8 rows, 0.6-0.7x from 32. The training forward swaps
    alike (its result lands in the kept pre-activations either way); the backward's products
    (_grad_input, _linear_backward) do not swap: they would pay transposing copies. One row: a
    matrix-vector product (about 1.7x faster than a one-row matrix product there).

    All of that was measured on a Xeon with AMX, in bf16 (other dtypes take the same forms).
    Without AMX (an EPYC with AVX-512 BF16, bf16, two threads, ms per product, plain / swapped /
    matrix-vector) the matrix-vector product is 2-2.5x slower than a one-row product and the
    swapped form 1.8-2.9x slower at 2 to 8 rows, about even elsewhere: Mixtral's up 0.82 / 0.72 /
    2.09 at one row, 0.73 / 2.15 at 2 rows, 1.17 / 2.21 at 8, 2.03 / 1.79 at 32, 5.43 / 6.26 at
    128; Qwen3-MoE's up 0.09 / 0.09 / 0.19 at one row, 0.09 / 0.20 at 2, 0.11 / 0.20 at 8. So
    there (and off the CPU) only the plain form runs, except for bf16 blocks of at most
    _small_rows(in) rows, which take this library's small_matmul (see _small_ok)."""
    w = weight[e]
    amx = _AMX and x.device.type == "cpu"
    own = _own_product(x, weight, bias, transposed, out) if swap else None
    if own is not None:
        y = x.new_empty(x.shape[0], _out_features(weight, transposed)) if out is None else out
        if own.default(y, x, w):
            return y if bias is None else y.add_(bias[e])  # in bf16, as the eager loop adds it
    if x.shape[0] == 1 and amx:
        mat = w.t() if transposed else w
        y = (torch.mv(mat, x[0]) if bias is None else torch.addmv(bias[e], mat, x[0]))[None]
    elif transposed or not swap or not amx or x.shape[0] > min(_SWAP_MAX_ROWS, x.shape[1] // 16):
        w = w if transposed else w.t()
        if out is not None:
            return torch.mm(x, w, out=out) if bias is None else torch.addmm(bias[e], x, w, out=out)
        return torch.mm(x, w) if bias is None else torch.addmm(bias[e], x, w)
    else:
        y = (torch.mm(w, x.t()) if bias is None else torch.addmm(bias[e][:, None], w, x.t())).t()
    if out is None:
        return y
    return out.copy_(y)


def _grad_input(g, weight, e, transposed, out=None):
    """dL/dx = g @ W_e.T for y = x @ W_e. For transposed [E, in, out] weights as (W_e @ g.T).T (the
    weight as the left operand, as it lies); for [E, out, in] weights W_e is already the right
    operand in row-major order. Where _own_products: small_matmul (transposed) or small_matmul_nn,
    the weight read as it lies."""
    if _own_products(g, weight) and (out is None or out.stride(-1) == 1):
        g = g.contiguous()
        y = g.new_empty(g.shape[0], weight.shape[1] if transposed else weight.shape[2]) if out is None else out
        if (ops.small_matmul if transposed else ops.small_matmul_nn).default(y, g, weight[e]):
            return y
    if transposed:
        y = torch.mm(weight[e], g.t()).t()
        return y if out is None else out.copy_(y)
    g = g.contiguous()
    return torch.mm(g, weight[e]) if out is None else torch.mm(g, weight[e], out=out)


def _linear_backward(g, x, weight, e, transposed, grad_x, grad_w, grad_b):
    """Gradients of y = x @ W_e (+ b_e) for dy = g, written into the given rows / slices. The
    transposed operand of the weight gradient is made contiguous first: a copy of m rows that
    makes the product about 1.5-2x faster here than reading it strided."""
    if grad_x is not None:
        _grad_input(g, weight, e, transposed, out=grad_x)
    if grad_w is not None and _own_products(g, weight) and grad_w.stride(-1) == 1:
        # x.T @ g (transposed) or g.T @ x, the transposed operand copied: m rows
        left, right = (x, g) if transposed else (g, x)
        if ops.small_matmul_nn.default(grad_w[e], left.t().contiguous(), right.contiguous()):
            grad_w = None
    if grad_w is not None:
        if transposed:
            torch.mm(x.t().contiguous(), g, out=grad_w[e])
        else:
            torch.mm(g.t().contiguous(), x, out=grad_w[e])
    if grad_b is not None:
        grad_b[e] = g.sum(0)


def _out_features(weight: torch.Tensor, transposed: bool) -> int:
    return weight.shape[2] if transposed else weight.shape[1]


def _blocks(offsets):
    """(expert, start, end) of every non-empty block; offsets[e] is where expert e's rows end (a
    tensor, or its list)."""
    start = 0
    ends = offsets.tolist() if isinstance(offsets, torch.Tensor) else offsets  # the one host sync of a loop
    for e, end in enumerate(ends):
        if end > start:
            yield e, start, end
        start = end


def _idle_zero(grad_w, blocks):
    """Zeroes the slices of a per-expert gradient that no block writes (experts without rows).
    The others are written whole by their products: no full-size fill first (at Mixtral's sizes
    a zero fill of the weight gradients costs as much as the products of a few tokens). Each run
    of consecutive idle experts is one fill: 120 idle experts of 128 took 72 ms in 9 fills where
    one fill per expert took 81 (a new [128, 768, 1024] bf16 gradient, two threads)."""
    start = 0
    for e in sorted({e for e, _, _ in blocks}) + [grad_w.shape[0]]:
        if e > start:
            grad_w[start:e].zero_()
        start = e + 1
    return grad_w


# --- the expert weights' gradients in kept memory -------------------------------------------------
# A training step writes a full-size gradient of every expert weight, and new memory for it cost
# more than the products that fill it: glibc maps a block of 32 MiB or more afresh for every call,
# and the kernel faults in and zeroes each of its pages on the first write (Mixtral's block at one
# token, bf16, two threads: a step took 53 ms, 20 ms with the gradients written into memory in
# use). So each expert weight's gradient is written into a buffer kept for that weight
# (_grad_like), and autograd gets a tensor on that buffer's memory (no view of it), which it takes
# over as the weight's .grad or adds into the .grad there. The next backward writes into the
# buffer again only where nothing else holds its memory any more (the .grad set to None, as
# optimizer.zero_grad() does, or added into another .grad); where something does (a .grad kept,
# a gradient the caller holds), it takes a second buffer kept for that weight (gradient
# accumulation: the .grad holds one, each backward's gradient the other), and past those a new
# tensor. The buffers live as long as their weight (release_gradient_buffers() drops them): at most
# twice its size, and no more than the gradients the steps hold anyway. Memory that went to shared
# memory (sent to another process) is never written again. SCATTER_ADD_MOE_KEEP_GRADS=0 keeps
# none.
_KEEP_GRADS = None  # read from _KEEP_GRADS_ENV by the first training forward
_KEEP_GRADS_ENV = "SCATTER_ADD_MOE_KEEP_GRADS"
_KEPT_PER_WEIGHT = 2
_grad_lock = threading.Lock()
_grad_kept = None  # weight -> [(buffer, its memory's use count where nothing else holds it)]


def _keep_grads() -> bool:
    global _KEEP_GRADS
    if _KEEP_GRADS is None:
        raw = os.environ.get(_KEEP_GRADS_ENV, "1").strip()
        if raw not in ("0", "1"):
            raise ValueError(f"scatter_add.moe: {_KEEP_GRADS_ENV} must be 1 (keep the expert weights' gradient "
                             f"buffers) or 0, got {raw!r}")
        # a torch without the storage use count cannot tell a free buffer: nothing kept there
        _KEEP_GRADS = raw == "1" and hasattr(torch._C, "_storage_Use_Count")
    return _KEEP_GRADS


def _use_count(t) -> int:
    """How many hold t's memory: tensors and storages, and the holders of its storage's Python
    object (which the storage keeps, so that a caller's `.untyped_storage()` held across steps
    does not raise the first count), counting this call's own references."""
    s = t.untyped_storage()
    return torch._C._storage_Use_Count(s._cdata) + sys.getrefcount(s)


def _keeps(weight) -> bool:
    """Whether weight's gradient goes into a kept buffer: on the CPU, keeping on, a plain tensor
    or Parameter (no subclass), and no dispatch mode or functorch transform active."""
    return (weight.device.type == "cpu" and _keep_grads() and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and not torch._C._len_torch_dispatch_stack() and not torch._C._are_functorch_transforms_active())


def _grad_like(weight):
    """A tensor laid out as weight (as torch.empty_like, so that autograd takes it over as the
    .grad without a copy) for its gradient, every element to be written: on a buffer kept for
    weight where one is free (see above), else new (where not _keeps(weight))."""
    global _grad_kept
    if not _keeps(weight):
        if _grad_kept is not None and weight.device.type != "cpu":
            with _grad_lock:
                _grad_kept.pop(weight, None)  # a weight moved off the CPU: its buffers go
        return torch.empty_like(weight)
    with _grad_lock:
        if _grad_kept is None:
            from torch.utils.weak import WeakIdKeyDictionary
            _grad_kept = WeakIdKeyDictionary()  # an entry goes with its weight
        kept = _grad_kept.get(weight)
        if (kept is None or kept[0][0].shape != weight.shape or kept[0][0].dtype != weight.dtype
                or kept[0][0].stride() != weight.stride()):
            kept = _grad_kept[weight] = []
        # memory moved to shared memory (sent to another process, Module.share_memory()) is not
        # this process's alone: never written again
        kept[:] = [k for k in kept if not k[0].untyped_storage().is_shared()]
        for buf, free in kept:
            if _use_count(buf) == free:
                break
        else:
            buf = torch.empty_like(weight)
            if len(kept) == _KEPT_PER_WEIGHT:
                return buf
            kept.append((buf, _use_count(buf)))
        return torch.empty(0, dtype=buf.dtype, device=buf.device).set_(buf.untyped_storage(), 0, buf.shape,
                                                                       buf.stride())


def release_gradient_buffers() -> int:
    """Drops the buffers kept for the expert weights' gradients (see the README's Training notes):
    their memory is freed once no .grad or other tensor uses it any more. Returns the bytes they
    held. The next backward keeps new ones, unless SCATTER_ADD_MOE_KEEP_GRADS=0."""
    global _grad_kept
    with _grad_lock:
        kept, _grad_kept = _grad_kept, None
    return sum(buf.numel() * buf.element_size() for entry in (kept.values() if kept else []) for buf, _ in entry)


def _weight_grad(g, x, weight, blocks):
    """grad[e] = g[block].T @ x[block] for each expert's block, idle experts' slices zero, into
    _grad_like(weight): each slice by the product torch's grouped product makes for it (the same
    bits)."""
    grad = _idle_zero(_grad_like(weight), blocks)
    for e, start, end in blocks:
        torch.mm(g[start:end].t(), x[start:end], out=grad[e])
    return grad


def _unwritten_zero(grad_x, blocks):
    """Zeroes the rows past the last block (sentinel rows); every other row is written."""
    grad_x[(blocks[-1][2] if blocks else 0):].zero_()
    return grad_x


# --- eager: the fused per-expert loop as one autograd function -------------------------------------


def _gate_groups(blocks, width):
    """Consecutive blocks in groups of about _GATE_GROUP_ELEMS pre-activations (a block larger
    than that alone): each group is gated in one call."""
    groups, cur, size = [], [], 0
    for b in blocks:
        n = (b[2] - b[1]) * width
        if cur and size + n > _GATE_GROUP_ELEMS:
            groups.append(cur)
            cur, size = [], 0
        cur.append(b)
        size += n
    if cur:
        groups.append(cur)
    return groups


# --- teams: the expert blocks split over threads ------------------------------------------------------
# With T >= 2 intra-op threads, each expert's product is split over all of them by oneDNN / MKL.
# Instead the gate groups are split into P = min(T, groups) contiguous parts of about equal cost,
# each run on a worker thread with T / P intra-op threads (one each with two threads) while the
# caller waits. Measured per call on a 2-vCPU Xeon with AMX (Mixtral's experts, 8 of 1024 x 3584,
# bf16, every expert's two products and the gate, in one process, ms, products one after another
# on two threads / on two threads of one thread each): 10.5 / 9.5 at one row per expert, 13.5 /
# 12.0 at 32, 32-39 / 21.6-22.6 at 128, 95-99 / 54-57 at 512. The two-thread products vary
# between runs on that VM (27-39 ms at 128 rows) where the teams' do not. With 128 experts of
# 1024 x 384 (Qwen3-MoE's reduced size) the products alone are even at 32 rows and 0.9x at 128;
# in the layer, where the teams also split the gate, the dispatch and the Python between the
# products, they gain (docs/benchmarks.md).
#
# The parts are cut at group boundaries and each group's products have the forms they have
# without teams: with one intra-op thread per team every product runs as on one thread, so the
# layer's output and gradients have the bits of a one-thread run (the elementwise gate and its
# derivative, left to torch's threads, gave the same bits on one and two threads at every shape
# tried). Where blocks average fewer than _TEAM_MIN_ROWS rows (decode-sized calls) the teams do
# not run: a training step of a Mixtral block at one token took 64 ms with them, 59 without.

_TEAMS = True  # tests set it False to compare
_TEAM_ROWS_PER_EXPERT = 32  # a block costs its rows plus this many for reading its weights
_TEAM_MIN_ROWS = 16  # rows per block, on average, below which teams do not run (see _team_parts)
_TEAM_MAX_GROUP_BYTES = 16 << 20  # pre-activations of a gate group, above which they do not
_TEAM_MAX_SHARE = 1.25  # the largest part's cost against an equal share, above which they do not


class _TeamPool:
    """P daemon threads, each running torch with `width` intra-op threads; run(fns) runs fns[i] on
    thread i and waits for all, then raises a KeyboardInterrupt that came meanwhile, or the
    first part's error."""

    def __init__(self, parts: int, width: int, threads: int):
        self.parts, self.width, self.threads = parts, width, threads
        self._tasks = [queue.SimpleQueue() for _ in range(parts)]
        ready = threading.Barrier(parts + 1)
        for i in range(parts):
            threading.Thread(target=self._work, args=(self._tasks[i], ready), daemon=True,
                             name=f"scatter_add.moe-team-{i}").start()
        ready.wait()
        # torch.set_num_threads on a thread also sets the count that threads started later take
        # when they first run an op: put the caller's back. (A thread whose first op falls
        # between the workers' setting and this one takes theirs.)
        torch.set_num_threads(threads)

    def _work(self, tasks, ready):
        _team_thread.on = True
        # A thread's first op sets its count from the last one set anywhere (torch's lazy init):
        # let that happen now, before ours, or the caller's restore in __init__ would win.
        torch.get_num_threads()
        torch.set_num_threads(self.width)
        ready.wait()
        while True:
            fn, errors, i, done = tasks.get()
            try:
                fn()
            except BaseException as e:  # noqa: B036 (handed to the caller)
                errors[i] = e
            # Nothing of the task may outlive it here: autograd copies a gradient that something
            # else still holds (AccumulateGrad) where it would take it over.
            fn = errors = None
            done.set()
            done = None

    def run(self, fns) -> None:
        # Each part reports through its own event, which a wait cut short by a KeyboardInterrupt
        # still finds set (a report taken from a queue just before the interrupt was lost, and
        # the next wait never ended). The interrupt is raised once every part it reached has
        # stopped: they write the caller's tensors, and a thread still running one at exit
        # aborted the interpreter.
        errors, done = [None] * len(fns), [threading.Event() for _ in fns]
        sent, interrupt = 0, None
        try:
            for i, (tasks, fn) in enumerate(zip(self._tasks, fns)):
                tasks.put((fn, errors, i, done[i]))
                sent = i + 1
        except BaseException as e:  # noqa: B036 (a KeyboardInterrupt)
            interrupt = e
        for event in done[:sent]:
            while True:
                try:
                    event.wait()
                    break
                except BaseException as e:  # noqa: B036 (a KeyboardInterrupt while waiting)
                    interrupt = interrupt or e
        if interrupt is not None:
            raise interrupt
        for e in errors:
            if e is not None:
                raise e


_team_thread = threading.local()
_pools = {}  # (parts, width, threads) -> _TeamPool
_pool_lock = threading.Lock()


def _forget_pools():
    global _pools, _pool_lock
    _pools, _pool_lock = {}, threading.Lock()  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools)


def _team_parts(groups, device, row_bytes):
    """The gate groups in P contiguous parts of about equal cost (_TEAM_ROWS_PER_EXPERT), or None
    where teams do not run: one intra-op thread, fewer than two groups, fewer than
    _TEAM_MIN_ROWS rows per block, a group of more than _TEAM_MAX_GROUP_BYTES of pre-activations
    (row_bytes a row: a team thread's own allocations for such a group, its gate's output,
    came from fresh pages on every call, Mixtral's block at 8192 tokens 1.03x slower), a part of
    more than _TEAM_MAX_SHARE equal shares, off the CPU, or under a torch function or dispatch
    mode, a functorch transform, torch.jit.trace or a profiler (which see the calling thread
    only)."""
    threads = torch.get_num_threads()
    if (not _TEAMS or threads < 2 or len(groups) < 2 or device.type != "cpu"
            or groups[-1][-1][2] - groups[0][0][1] < _TEAM_MIN_ROWS * sum(len(g) for g in groups)
            or max(g[-1][2] - g[0][1] for g in groups) * row_bytes > _TEAM_MAX_GROUP_BYTES
            or torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack()
            or torch._C._are_functorch_transforms_active() or torch._C._get_tracing_state() is not None
            or torch.autograd.profiler._is_profiler_enabled):
        return None
    cost = [sum(stop - start + _TEAM_ROWS_PER_EXPERT for _, start, stop in g) for g in groups]
    parts_n = min(threads, len(groups))
    total, acc, parts, cur, costs = sum(cost), 0, [], [], [0]
    for g, c in zip(groups, cost):
        # cut before g where the part so far is closer to its share than it would be with g
        share = total * (len(parts) + 1) / parts_n
        if cur and len(parts) < parts_n - 1 and acc + c - share > share - acc:
            parts.append(cur)
            cur = []
            costs.append(0)
        cur.append(g)
        acc += c
        costs[-1] += c
    parts.append(cur)
    if len(parts) < 2:
        return None
    # the slowest team sets the pace: with parts far from equal (few groups) torch's threads
    # split each product more evenly (Qwen3-MoE's 512 tokens: 3 groups, 46.6 ms in teams of 2:1
    # against 42.4 without)
    largest = max(costs)
    return parts if largest <= _TEAM_MAX_SHARE * total / len(parts) else None


def _teams(groups, run, parts) -> None:
    """run(part) for each part of _team_parts' split, on the team threads;
    run(groups) here where teams do not run, or on a team thread (a call from within a part).
    Calls from several threads take the teams in turn: one that ran its parts here, with this
    thread's intra-op threads, would give other bits."""
    parts = None if getattr(_team_thread, "on", False) else parts
    if parts is None:
        run(groups)
        return
    lock = _pool_lock
    lock.acquire()
    try:
        threads = torch.get_num_threads()
        width = max(1, threads // len(parts))
        key = (len(parts), width, threads)
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = _TeamPool(*key)
        # the caller's thread-local modes that change what the ops compute (a backward may run
        # under autocast)
        inference = torch.is_inference_mode_enabled()
        autocast = torch.is_autocast_enabled("cpu")
        low = torch.get_autocast_dtype("cpu")

        def task(part):
            def fn():
                with torch.inference_mode(inference), torch.no_grad(), torch.autocast("cpu", low, autocast):
                    run(part)
            return fn
        pool.run([task(p) for p in parts])
    finally:
        lock.release()


def _experts_loop(xs, offsets, w_in, b_in, w_out, b_out, transposed, gate, token=None, hs=None, cast=None,
                  silu=False):
    """ys [S, out] without autograd. Rows past the last block (sentinels) are zero. xs holds the
    S pairs' rows; or, with token (the token of each pair, -1 for sentinels), xs is the hidden
    states, and each group's rows are gathered as the group comes (see below). With hs ([S, in_out],
    the training forward's), the pre-activations of every row are kept there for the backward; the
    products and the gate are the same (so the output has the bits of the call without it), except
    that with AMX a group's swapped grouped product, whose pre-activations come out transposed,
    is replaced by the loop's products. The gate runs
    once per group of consecutive blocks (_gate_groups), into one reused buffer: with 128 experts
    of a few rows each, a gate call per expert cost more than the products (Qwen3-MoE block, 64
    tokens, two threads: 0.82x of grouped_mm, which gates once); one call over every row instead
    wrote pre-activations far larger than the caches into fresh memory (Mixtral block, 8192
    tokens: 235 MB, 0.76x of eager). A group of small blocks takes torch's grouped product
    (_grouped_swapped, or _grouped_plain without AMX) where it can; without AMX a bf16 group
    whose blocks are mostly of at most _small_rows(in) rows (every block on AVX2 CPUs) stays in
    the loop, where those blocks take small_matmul (_linear): one small_matmul_grouped call per
    product for the group where every block does (_small_grouped). Block forwards, bf16, two
    threads, an EPYC without AVX-512, medians of 10-15 alternated rounds in two runs, ms, a call
    per block / per group (grouped_mm): Qwen3-MoE 1 token 2.25-2.58 / 1.87-2.08 (2.53-2.95), 8
    tokens 11.1-12.5 / 9.1-9.2 (14.0-15.1), 64 tokens 42-46 / 35-39 (80-97); Mixtral 1 and 8
    tokens within 6% either way (2 blocks); the same bits.

    Gathering group by group keeps the dispatched rows to a group's (a few MiB, which the
    allocator hands back on the next group) where one gather of every pair wrote top_k rows per
    token into fresh pages: 128 MiB at Qwen3-MoE's 8192 tokens, whose page faults cost more than
    the copy (a gather of those rows took 51 ms into new memory, 11.5 ms into memory in use; two
    threads). Block forwards, two threads, medians of 11 alternated (wall clock; process CPU
    time alike): Qwen3-MoE 8192 tokens 390 -> 331 ms (1.05-1.18x in four such runs), 2048 tokens
    105 -> 100 ms, Mixtral 8192 tokens 1.1-1.37x; the same bits.

    cast (autocast, see _autocast_operands): the dtype the products run in, each group's weights
    cast to it as the group comes, as eager casts each expert's.

    silu: the gate is transformers' default, act_fn(gate) * up with a plain SiLU (_silu_gate):
    the loop then runs its two ops itself (_gate_into) into a buffer of each part, where the
    gate's own ops took two new tensors per group (the same ops, so the same bits), and the
    parts' buffers come from the calling thread's kept scratch (_scratch_take), where they were
    new memory, faulted in on every call. Mixtral block (blocks of 2048 rows at 8192 tokens: 44
    MiB of buffers, one part), bf16, two threads, medians of alternated rounds, ms: forward at
    8192 tokens 243.4 -> 223.2 (9 rounds); the other forward rows of bench_moe's blocks within 3%
    either way. The training backward keeps its own buffers of the default gate in the same
    block (_Experts): Mixtral forward+backward at 2048 tokens (112 MiB of them), 11 rounds,
    nothing kept / the forward's buffers kept / the backward's too: 350.8 / 345.6 / 315.2 ms.

    With two threads or more the groups are split over teams of threads (_team_parts): the
    groups and each group's products are the same whatever the split."""
    ends = offsets.tolist()  # the one host sync of a loop
    width = _out_features(w_in, transposed)
    groups = _gate_groups(list(_blocks(ends)), width)
    dtype = w_in.dtype if cast is None else cast
    grouped = cast is None and _grouped_ok(xs if token is None else xs[:0].to(dtype), w_in, b_in, w_out, b_out,
                                           transposed)
    rows = xs.shape[0] if token is None else token.shape[0]
    ys = xs.new_empty(rows, _out_features(w_out, transposed), dtype=dtype)
    weights = (w_in, b_in, w_out, b_out)

    silu = silu and not transposed and width % 2 == 0
    # a loop called from within a team's part (its gate running another layer) runs here (_teams)
    parts = None if getattr(_team_thread, "on", False) else _team_parts(groups, xs.device, width * dtype.itemsize)
    # Each part's buffers are carved here from one block: a team thread's allocations come from
    # its own glibc arena, which mapped and faulted in such blocks anew on every call. With the
    # default gate the block is this thread's kept scratch (_scratch_take): neither buffer is seen
    # by anything but the loop's own ops then.
    shapes = []
    for part in parts or [groups]:
        rows_p = max((g[-1][2] - g[0][1] for g in part), default=0)
        shapes += [(rows_p, width) if hs is None else None, (rows_p, width // 2) if silu else None]
    block = (_scratch_take if silu else _scratch_new)(_carved_bytes(shapes, dtype), xs.device)
    views = _carve(block, shapes, dtype)
    bufs = {id(part): views[2 * i:2 * i + 2] for i, part in enumerate(parts or [groups])}

    def run(part):
        buf, a_buf = bufs[id(part)]
        for g in part:
            _experts_group(g, xs, ends, weights, transposed, gate, token, hs, cast, grouped, width, ys, buf, a_buf)

    try:
        _teams(groups, run, parts)
    finally:
        if silu:
            _scratch_give(block)
    ys[(groups[-1][-1][2] if groups else 0):].zero_()
    return ys


# The expert loop's buffers with the default gate (pre-activations and the gate's output) are
# kept between calls by the thread that made them (until it ends), up to this size: Mixtral's
# block at 8192 tokens needs 44 MiB of them, and the backward at 2048 tokens 112 MiB (the gate's
# output, its gradient and the pre-activations' gradient), which new memory faulted in on every
# call. SCATTER_ADD_MOE_SCRATCH_MIB sets it (read at the first call; 0 keeps nothing).
_SCRATCH_KEEP_BYTES = None
_SCRATCH_ENV = "SCATTER_ADD_MOE_SCRATCH_MIB"
_scratch = threading.local()


def _scratch_limit() -> int:
    global _SCRATCH_KEEP_BYTES
    if _SCRATCH_KEEP_BYTES is None:
        raw = os.environ.get(_SCRATCH_ENV, "128")
        mib = int(raw) if raw.strip().isdigit() else -1
        if mib < 0:
            raise ValueError(f"scatter_add.moe: {_SCRATCH_ENV} must be a whole number of MiB (0 keeps nothing), "
                             f"got {raw!r}")
        _SCRATCH_KEEP_BYTES = mib << 20
    return _SCRATCH_KEEP_BYTES


def _scratch_new(nbytes, device):
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _lines(nbytes) -> int:
    return -(-nbytes // 64) * 64


def _carved_bytes(shapes, dtype) -> int:
    """The bytes _carve needs for tensors of these shapes (None: no tensor), each on 64-byte lines."""
    return sum(_lines(s[0] * s[1] * dtype.itemsize) for s in shapes if s is not None)


def _carve(block, shapes, dtype):
    """Contiguous tensors of the shapes (None for a None), one after the other in block."""
    views, at = [], 0
    for s in shapes:
        if s is None:
            views.append(None)
            continue
        n = s[0] * s[1] * dtype.itemsize
        views.append(block[at:at + n].view(dtype).view(s))
        at += _lines(n)
    return views


def _scratch_take(nbytes, device):
    """At least nbytes: this thread's kept block where it is large enough (taken out while in use,
    so that a nested call never shares it), else a new one."""
    _scratch_limit()  # a bad setting raises here, before the call writes anything
    kept = getattr(_scratch, "block", None)
    if device.type == "cpu" and kept is not None and kept.numel() >= nbytes:
        _scratch.block = None
        return kept
    return _scratch_new(nbytes, device)


def _scratch_give(block):
    """Keeps block for this thread's next _scratch_take where it is on the CPU, at most
    _scratch_limit() and larger than the block kept."""
    kept = getattr(_scratch, "block", None)
    if block.device.type == "cpu" and block.numel() <= _scratch_limit() and (
            kept is None or kept.numel() < block.numel()):
        _scratch.block = block


def _gate_into(gate, h, a_buf):
    """gate(h); or, with a_buf (the default SiLU gate, see _experts_loop), silu(h's first half) *
    its second half, by the gate's own two ops, written into a_buf's first rows."""
    if a_buf is None:
        return gate(h)
    inter = h.shape[-1] // 2
    a = a_buf[:h.shape[0]]
    torch.ops.aten.silu.out(h[..., :inter], out=a)
    return a.mul_(h[..., inter:])


def _experts_group(g, xs, ends, weights, transposed, gate, token, hs, cast, grouped, width, ys, buf, a_buf=None):
    """One gate group of _experts_loop: its rows of ys (and of hs, where kept)."""
    w_in, b_in, w_out, b_out = weights
    first, end = g[0][1], g[-1][2]
    dtype = w_in.dtype if cast is None else cast
    x = xs[first:end] if token is None else gather(xs, token[first:end], ignore_index=_IGNORE).to(dtype)
    if cast is not None:  # the group's experts, numbered from 0, their weights cast
        e0, e1 = g[0][0], g[-1][0] + 1
        w_in, b_in, w_out, b_out = (None if t is None else t[e0:e1].to(cast) for t in weights)
        g, ends = [(e - e0, start, stop) for e, start, stop in g], ends[e0:e1]
        grouped = _grouped_ok(x, w_in, b_in, w_out, b_out, transposed)
    # The swapped grouped form (AMX) leaves its pre-activations transposed: not where hs is kept.
    if grouped and (_swap_pays(g, width) and hs is None if _AMX else len(g) > 1) and not _mostly_small(
            g, x, w_in, b_in, transposed):
        h_out = None if hs is None else hs[first:end]
        ys[first:end] = (_grouped_swapped if _AMX else _grouped_plain)(x, ends, g, w_in, w_out, gate, h_out)
        return
    buf = hs[first:] if hs is not None else buf
    if not transposed and b_in is None and b_out is None:
        offs, longest = _group_offsets(x, ends, g), max(stop - start for _, start, stop in g)
        if _small_grouped(x, w_in, g[0][0], offs, longest, buf[:end - first]):
            a = _gate_into(gate, buf[:end - first], a_buf)
            if not _small_grouped(a, w_out, g[0][0], offs, longest, ys[first:end]):
                # the down products' wider rows past the tiles' limit (_small_rows)
                for e, start, stop in g:
                    _linear(a[start - first:stop - first], w_out, e, b_out, transposed, out=ys[start:stop])
            return
    for e, start, stop in g:
        _linear(x[start - first:stop - first], w_in, e, b_in, transposed, out=buf[start - first:stop - first])
    a = _gate_into(gate, buf[:end - first], a_buf)
    for e, start, stop in g:
        _linear(a[start - first:stop - first], w_out, e, b_out, transposed, out=ys[start:stop])


# --- torch's grouped product (no grad) ---------------------------------------------------------------
# torch._grouped_mm(A, B, offs) multiplies every expert's block in one call, where a Python loop
# pays per expert. With the 3-D weight as A and the blocks' rows as the columns of B (the swapped
# form of _linear, W_e @ x_e.T, each block's result a range of columns of one [out, rows] tensor)
# oneDNN reads the weight as it lies and the loop's transposing copy per block is gone; the gate
# then runs on the transposed layout and the result is transposed once, into ys. Measured in the
# blocks (bench_moe's blocks, bf16, two threads, against the loop of _linear): Qwen3-MoE (128
# experts, 768 x 1024 and 1024 x 384) 1.1-1.37x from 8 to 1024 tokens (0.5 to 64 rows per
# expert), 1.0-1.2x at 2048 and 4096 (128, 256 rows); Mixtral (8 experts, 7168 x 1024 and 1024 x 3584)
# 1.1-1.2x at 8 to 256 tokens (2 to 64 rows), 0.86x at 512 (128 rows, a 1.8 MB first product per
# block): hence the limits below. Blocks of one row stay matrix-vector products in the loop (1.05-
# 1.1x faster there, 1 token).
# Without AMX the swapped form is slower (see _linear): every group of more than one block takes
# two grouped products of the plain form instead (_grouped_plain). Blocks, bf16, two threads,
# medians of 5 alternated rounds on an EPYC, ms of the swapped forms / the plain loop / plain
# grouped products, against grouped_mm: Mixtral 1 token 7.22 / 5.45 / 5.36 (grouped_mm 5.34), 8
# tokens 21.7 / 16.4 / 15.2 (16.5), 64 tokens 29.3 / 23.7 / 23.4 (24.9), 512 tokens 79.1 / 80.3 /
# 78.0 (85.8); Qwen3-MoE 64 tokens 48.6 / 41.1 / 37.7 (33.4), 512 tokens 78.6 / 64.0 / 63.4 (80.6).
# The products have the bits of the loop's per-expert products of the same form.

_SWAP_MAX_ROWS_GROUPED = 256  # mean rows per block, and
_SWAP_MAX_RESULT = 1 << 19  # elements of a block's first product (rows x width), up to which it pays
_GROUPED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _swap_pays(group, width) -> bool:
    rows = (group[-1][2] - group[0][1]) / len(group)
    longest = max(stop - start for _, start, stop in group)
    return longest > 1 and rows <= _SWAP_MAX_ROWS_GROUPED and rows * width <= _SWAP_MAX_RESULT


def _aligned(t: torch.Tensor) -> bool:
    """Whether torch._grouped_mm reads t (2-D or 3-D) in place, by its own rule: the last two
    dimensions row-major (unit column stride, a row stride of at least the row) or column-major, the
    other stride of the two, the batch stride and the start 16-byte aligned. A stride of 0 or a
    stepped view fails it (such operands are copied, or the loop runs)."""
    es = t.element_size()
    *batch, s_row, s_col = t.stride()
    rows, cols = t.shape[-2:]
    if s_col == 1 and s_row >= max(cols, 1):
        lead = s_row
    elif s_row == 1 and s_col >= max(rows, 1):
        lead = s_col
    else:
        return False
    return t.data_ptr() % 16 == 0 and all(st * es % 16 == 0 for st in (lead, *batch))


def _operand(t: torch.Tensor) -> torch.Tensor:
    """t (2-D) itself when aligned, else a copy whose rows are padded to 16 bytes."""
    if _aligned(t):
        return t
    pad = 16 // t.element_size()
    cols = -(-t.shape[1] // pad) * pad
    return t.new_empty(t.shape[0], cols)[:, :t.shape[1]].copy_(t)


def _grouped_ok(xs, w_in, b_in, w_out, b_out, transposed) -> bool:
    """Whether the grouped product applies: CPU, [E, out, in] weights without bias, a dtype the CPU
    grouped product has, weights it reads in place (they are never copied)."""
    return (hasattr(torch, "_grouped_mm") and xs.device.type == "cpu" and not transposed
            and b_in is None and b_out is None and xs.dtype in _GROUPED_DTYPES
            and w_in.dtype == xs.dtype and w_out.dtype == xs.dtype and _aligned(w_in) and _aligned(w_out))


def _grouped_swapped(x, ends, group, w_in, w_out, gate, h_out=None):
    """A group's [rows, out] result (a transposed view) by two swapped grouped products (h_out is
    not used: see _experts_loop)."""
    e0, e1 = group[0][0], group[-1][0]
    offs = _group_offsets(x, ends, group)
    h = torch._grouped_mm(w_in[e0:e1 + 1], _operand(x).t(), offs=offs).t()
    return torch._grouped_mm(w_out[e0:e1 + 1], _operand(gate(h).t()), offs=offs).t()


def _group_offsets(x, ends, group):
    e0, e1, first = group[0][0], group[-1][0], group[0][1]
    return torch.tensor([min(max(end - first, 0), x.shape[0]) for end in ends[e0:e1 + 1]], dtype=torch.int32)


def _grouped_plain(x, ends, group, w_in, w_out, gate, h_out=None):
    """A group's [rows, out] result by two grouped products of the plain form, x_e @ W_e.T (CPUs
    without AMX, where the swapped form is slower: see _linear). The pre-activations are copied
    into h_out when given."""
    e0, e1 = group[0][0], group[-1][0]
    offs = _group_offsets(x, ends, group)
    h = torch._grouped_mm(_operand(x), w_in[e0:e1 + 1].transpose(-2, -1), offs=offs)
    if h_out is not None:
        h_out.copy_(h)
    return torch._grouped_mm(_operand(gate(h)), w_out[e0:e1 + 1].transpose(-2, -1), offs=offs)


# --- the default gate's derivative ------------------------------------------------------------------


def _silu_gate(self) -> bool:
    """Whether the experts' gate is transformers' default, act_fn(gate) * up over the concatenated
    [gate | up] pre-activations, with act_fn a plain SiLU: Mixtral, Qwen2/3-MoE, OLMoE,
    DeepSeek-V3. Its derivative is then written out (_silu_gate_backward). Anything that could make
    the gate compute something else, or autograd run something more, keeps autograd over the gate:
    a gate set on the instance, a forward replaced on the activation or its class (as kernelize
    does), an in-place SiLU, forward or backward hooks (the activation's or global ones), a
    replaced torch.nn.functional.silu, and torch function or dispatch modes."""
    if not self.has_gate or not getattr(self, "is_concatenated", True):
        return False
    integration = sys.modules.get("transformers.integrations.moe")
    default = getattr(integration, "_default_apply_gate", None)
    if default is None or getattr(getattr(self, "_apply_gate", None), "__func__", None) is not default:
        return False
    act = getattr(self, "act_fn", None)
    forward = getattr(type(act), "forward", None)
    if type(act) is torch.nn.SiLU:
        silu = _defined_in(forward, "SiLU.forward", "torch/nn/modules/activation.py") and not act.inplace
    else:
        silu = (type(act).__name__ == "SiLUActivation" and type(act).__module__ == "transformers.activations"
                and _defined_in(forward, "SiLUActivation.forward", "transformers/activations.py"))
    # both forwards call torch.nn.functional.silu, looked up at each call: it must be torch's
    if not silu or "forward" in vars(act) or not _defined_in(torch.nn.functional.silu, "silu", "torch/nn/functional.py"):
        return False
    if torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
        return False  # a mode may change what silu computes
    hooks = torch.nn.modules.module
    return not (act._forward_hooks or act._forward_pre_hooks or act._backward_hooks or act._backward_pre_hooks
                or hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or hooks._global_backward_hooks or hooks._global_backward_pre_hooks)


def _defined_in(fn, qualname: str, path: str) -> bool:
    """Whether fn is the function `qualname` whose code lies in a file ending with `path` (a
    library's own, not a replacement, even one that copied its name with functools.wraps)."""
    code = getattr(fn, "__code__", None)
    return (getattr(fn, "__qualname__", None) == qualname and code is not None
            and code.co_filename.replace(os.sep, "/").endswith(path))


def _silu_gate_backward(h, grad_a, out=None):
    """dL/dh for a = silu(gate) * up, h = [gate | up], given dL/da: the bits of autograd's (its mul
    backward's two products, silu_backward, then the halves joined; a NaN may come out with
    another payload), in four passes written into one new tensor, where autograd over the gate
    (recomputed, with its graph) took seven and six new ones. Mixtral block, 2048 tokens, bf16,
    two threads: those passes took 60 ms of a 300 ms forward+backward (profiler), much of it first
    touches of fresh [4096, 3584] and [4096, 7168] tensors; timed alone, with the gate
    recomputed, 42.5 ms that way and 31.9 ms this way. Written into `out` where given (contiguous,
    h's shape)."""
    gate, up = h.chunk(2, dim=-1)
    grad_h = torch.empty_like(h) if out is None else out
    d_gate, d_up = grad_h.chunk(2, dim=-1)
    torch.mul(grad_a, up, out=d_gate)
    torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
    torch.ops.aten.silu.out(gate, out=d_up)
    d_up.mul_(grad_a)
    return grad_h


def _first_order(backward):
    """torch's once_differentiable, save when a double backward raises: whenever one is recorded
    (create_graph), where once_differentiable waits for an incoming gradient that requires grad.
    The experts' gradients depend on their saved inputs (the weights, and through the gate's
    second derivative the pre-activations), so with a constant incoming gradient (a loss linear in
    the experts' output) once_differentiable handed back plain tensors, and a gradient penalty
    silently lacked the experts' part of its second derivative."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outs
        err = torch._C._functions.DelayedError(
            b"scatter_add.moe: the experts' backward cannot be differentiated again (no double backward)", len(outs))
        return err(*[None if t is None else t.detach().requires_grad_(True) for t in outs])
    return wrapper


class _Experts(torch.autograd.Function):
    """The expert loop for training. Forward: _experts_loop, the products and gate groups of
    inference, with the blocks' pre-activations kept in one [S, in_out] tensor for the backward
    (Qwen3-MoE block, 64 tokens, bf16, two threads: a forward with grad took 35-55 ms with a gate
    call and plain products per expert, 36-40 ms this way, about grouped_mm's). Backward: the
    activations' gradients, the gate differentiated once over all rows (one call, not one per
    expert: with 128 experts of a few rows each that overhead outweighed the products; by
    _silu_gate_backward where silu_gate, else by autograd), then the products' gradients; by
    _grouped_backward where it applies, else block by block."""

    @staticmethod
    def forward(ctx, xs, offsets, w_in, b_in, w_out, b_out, transposed, gate, silu_gate):
        _keep_grads()  # a bad SCATTER_ADD_MOE_KEEP_GRADS raises here, before anything runs
        hs = xs.new_empty(xs.shape[0], _out_features(w_in, transposed))
        ys = _experts_loop(xs, offsets, w_in, b_in, w_out, b_out, transposed, gate, hs=hs, silu=silu_gate)
        ctx.save_for_backward(xs, offsets, w_in, w_out, hs)
        ctx.transposed, ctx.gate, ctx.silu_gate = transposed, gate, silu_gate
        ctx.grouped = (_GROUPED_BACKWARD and (not _AMX or xs.shape[0] >= w_in.shape[0])
                       and _grouped_ok(xs, w_in, b_in, w_out, b_out, transposed)
                       and not (_own_products(xs, w_in) and _own_products(xs, w_out)))
        return ys

    @staticmethod
    @_first_order  # no double backward: it raises, never half a graph
    def backward(ctx, grad_ys):
        xs, offsets, w_in, w_out, hs = ctx.saved_tensors
        need_x, _, need_w_in, _, need_w_out = ctx.needs_input_grad[:5]
        grad_ys = grad_ys.to(xs.dtype)
        blocks = list(_blocks(offsets))
        rows = blocks[-1][2] if blocks else 0
        # teams: every block its own part of the split (the products are those without teams)
        every = [[b] for b in blocks]
        parts = _team_parts(every, xs.device, hs.shape[1] * hs.element_size()) if rows else None
        block = grad_a_buf = None
        try:
            if ctx.silu_gate:
                h = hs[:rows]
                inter = h.shape[1] // 2
                # the gate's output (recomputed), its gradient and the pre-activations' gradient
                # never leave the backward: they lie in this thread's kept scratch (_experts_loop)
                shapes = [(rows, inter), (rows, inter), (rows, 2 * inter)]
                block = _scratch_take(_carved_bytes(shapes, h.dtype), xs.device)
                a_buf, grad_a_buf, grad_h_buf = _carve(block, shapes, h.dtype)
                a = _gate_into(None, h, a_buf)  # no graph: backward runs without grad

                def gate_backward(grad_a):
                    return _silu_gate_backward(h, grad_a, out=grad_h_buf)
            else:
                with torch.enable_grad():
                    h = hs[:rows].detach().requires_grad_(True)
                    a_graph = ctx.gate(h)
                a = a_graph.detach()

                def gate_backward(grad_a):
                    return torch.autograd.grad(a_graph, h, grad_a)[0]
            if ctx.grouped and rows:
                if parts is None:
                    return _grouped_backward(grad_ys, xs, offsets, rows, w_in, w_out, a, gate_backward,
                                             need_x, need_w_in, need_w_out)
                return _grouped_backward_teams(grad_ys, xs, every, parts, rows, w_in, w_out, a, gate_backward,
                                               need_x, need_w_in, need_w_out, grad_a_buf)
            return _loop_backward(ctx, grad_ys, xs, w_in, w_out, a, h, gate_backward, every, parts, blocks, rows,
                                  grad_a_buf)
        finally:
            if block is not None:
                _scratch_give(block)


def _loop_backward(ctx, grad_ys, xs, w_in, w_out, a, h, gate_backward, every, parts, blocks, rows, grad_a=None):
    """_Experts' gradients block by block (where _grouped_backward does not apply)."""
    need_x, _, need_w_in, need_b_in, need_w_out, need_b_out = ctx.needs_input_grad[:6]
    tr = ctx.transposed
    grad_x = _unwritten_zero(torch.empty_like(xs), blocks) if need_x else None
    grad_w_in = _idle_zero(_grad_like(w_in), blocks) if need_w_in else None
    grad_w_out = _idle_zero(_grad_like(w_out), blocks) if need_w_out else None
    grad_b_in = w_in.new_zeros(w_in.shape[0], _out_features(w_in, tr)) if need_b_in else None
    grad_b_out = w_out.new_zeros(w_out.shape[0], _out_features(w_out, tr)) if need_b_out else None
    # y = a @ W_out[e] (+ b): the gradient of a, block by block, then the gate's, all rows at once
    grad_a = a.new_empty(a.shape) if grad_a is None else grad_a

    def input_grads(part):
        for [(e, start, end)] in part:
            _grad_input(grad_ys[start:end], w_out, e, tr, out=grad_a[start:end])

    def weight_grads(part):
        for [(e, start, end)] in part:
            g = grad_ys[start:end]
            _linear_backward(g, a[start:end], w_out, e, tr, None, grad_w_out, grad_b_out)
            _linear_backward(grad_h[start:end], xs[start:end], w_in, e, tr,
                             grad_x[start:end] if need_x else None, grad_w_in, grad_b_in)
    _teams(every, input_grads, parts)
    grad_h = gate_backward(grad_a) if rows else h
    _teams(every, weight_grads, parts)
    return grad_x, None, grad_w_in, grad_b_in, grad_w_out, grad_b_out, None, None, None


# With AMX too, from as many (token, expert) pairs as experts: Mixtral's and Qwen3-MoE's blocks
# (bench_moe's, bf16, two threads, a Xeon with AMX), forward+backward, ms, block by block /
# grouped, alternated in one process, 9 to 25 rounds: Mixtral 56.6 / 55.6, 91.5 / 88.6, 158.1 /
# 162.2, 321.5 / 325.1 at 1, 64, 512, 2048 tokens; Qwen3-MoE 179.5-180.4 / 176.1-177.6, 239.5 /
# 220.0, 454.8 / 416.8 at 64, 512, 2048 tokens, but 82.3-85.4 / 89.1-89.4 at one token (8 pairs,
# 128 experts), where the grouped products also write the idle experts' zero gradients.
# Tests set it False to run the loop.
_GROUPED_BACKWARD = True


def _grouped_backward(grad_ys, xs, offsets, rows, w_in, w_out, a, gate_backward, need_x, need_w_in, need_w_out):
    """_Experts' gradients by torch's grouped products ([E, out, in] weights without biases, as
    _grouped_ok): one call per product for every expert, where the loop makes four per
    expert and a Python round trip each. The weight gradients come out whole, contiguous
    [E, out, in], with idle experts' slices zero; the blocks' products are those of
    the loop (x_e.T @ g_e and g_e @ W_e), in torch's grouped form, or where the weight has kept
    buffers (_keeps) one product per expert into them, the same bits. Qwen3-MoE block (128 experts
    of about 4 rows, 64 tokens, bf16, two threads, an EPYC), ms of the backward, ours / grouped_mm:
    block by block 174-190 / 150-157 (10 ms of it the loop's own Python), this way 131-146 /
    136-150, before the kept buffers: most of it was writing the full-size weight gradients into
    fresh memory (see docs/benchmarks.md)."""
    offs = offsets.to(torch.int32)
    g = _operand(grad_ys[:rows])
    grad_a = torch._grouped_mm(g, w_out, offs=offs)
    grad_h = _operand(gate_backward(grad_a))
    blocks = list(_blocks(offsets)) if _keeps(w_in) or _keeps(w_out) else None
    grad_w_out = grad_w_in = None
    if need_w_out:  # into the weight's kept buffers, where it has them
        grad_w_out = (_weight_grad(g, _operand(a), w_out, blocks) if _keeps(w_out)
                      else torch._grouped_mm(g.t(), _operand(a), offs=offs))
    if need_w_in:
        x = _operand(xs[:rows])
        grad_w_in = (_weight_grad(grad_h, x, w_in, blocks) if _keeps(w_in)
                     else torch._grouped_mm(grad_h.t(), x, offs=offs))
    grad_x = None
    if need_x:
        grad_x = torch._grouped_mm(grad_h, w_in, offs=offs)
        if rows < xs.shape[0]:  # sentinel rows: no gradient
            grad_x = torch.cat([grad_x, grad_x.new_zeros(xs.shape[0] - rows, grad_x.shape[1])])
    return grad_x, None, grad_w_in, None, grad_w_out, None, None, None, None


def _grouped_backward_teams(grad_ys, xs, every, parts, rows, w_in, w_out, a, gate_backward, need_x, need_w_in,
                            need_w_out, grad_a=None):
    """_grouped_backward split over teams: each expert's products as torch's grouped product
    makes them (a matrix product of the same slices of the same operands into a contiguous
    result, so the same bits), written into gradients allocated whole."""
    g = _operand(grad_ys[:rows])
    grad_a = g.new_empty(rows, w_out.shape[2]) if grad_a is None else grad_a

    def input_grads(part):
        for [(e, start, end)] in part:
            torch.mm(g[start:end], w_out[e], out=grad_a[start:end])
    _teams(every, input_grads, parts)
    grad_h = _operand(gate_backward(grad_a))
    a, x = _operand(a), _operand(xs[:rows])
    blocks = [b for [b] in every]
    grad_w_out = _idle_zero(_grad_like(w_out), blocks) if need_w_out else None
    grad_w_in = _idle_zero(_grad_like(w_in), blocks) if need_w_in else None
    grad_x = _unwritten_zero(xs.new_empty(xs.shape[0], w_in.shape[2]), blocks) if need_x else None

    def weight_grads(part):
        for [(e, start, end)] in part:
            if need_w_out:
                torch.mm(g[start:end].t(), a[start:end], out=grad_w_out[e])
            if need_w_in:
                torch.mm(grad_h[start:end].t(), x[start:end], out=grad_w_in[e])
            if need_x:
                torch.mm(grad_h[start:end], w_in[e], out=grad_x[start:end])
    _teams(every, weight_grads, parts)
    return grad_x, None, grad_w_in, None, grad_w_out, None, None, None, None


# --- torch.compile: two grouped products as opaque ops, the gate traced -----------------------------


def _grouped_linear_impl(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor,
                         bias: Optional[torch.Tensor], transposed: bool) -> torch.Tensor:
    out = x.new_empty(x.shape[0], _out_features(weight, transposed))
    blocks = list(_blocks(offsets))
    end = blocks[-1][2] if blocks else 0
    longest = max((stop - start for _, start, stop in blocks), default=0)
    if not (blocks and bias is None and not transposed and _small_grouped(x, weight, 0, offsets, longest, out)):
        for e, start, stop in blocks:
            _linear(x[start:stop], weight, e, bias, transposed, out=out[start:stop])
    out[end:].zero_()
    return out


def _grouped_linear_fake(x, weight, offsets, bias, transposed):
    return x.new_empty(x.shape[0], _out_features(weight, transposed))


def _grouped_linear_backward_impl(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                  offsets: torch.Tensor, has_bias: bool, transposed: bool,
                                  need_x: bool, need_weight: bool) -> List[torch.Tensor]:
    grad = grad.to(x.dtype)
    blocks = list(_blocks(offsets))
    grad_x = _unwritten_zero(torch.empty_like(x), blocks) if need_x else x.new_empty(0)
    grad_w = _idle_zero(torch.empty_like(weight), blocks) if need_weight else weight.new_empty(0)
    grad_b = (weight.new_zeros(weight.shape[0], _out_features(weight, transposed)) if need_weight and has_bias
              else weight.new_empty(0))
    for e, start, end in blocks:
        _linear_backward(grad[start:end], x[start:end], weight, e, transposed,
                         grad_x[start:end] if need_x else None, grad_w if need_weight else None,
                         grad_b if need_weight and has_bias else None)
    return [grad_x, grad_w, grad_b]


def _grouped_linear_backward_fake(grad, x, weight, offsets, has_bias, transposed, need_x, need_weight):
    return [torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(weight) if need_weight else weight.new_empty(0),
            weight.new_empty(weight.shape[0], _out_features(weight, transposed)) if need_weight and has_bias
            else weight.new_empty(0)]


def _op(name):
    ns, short = add_op_namespace_prefix(name).split("::")
    try:
        return getattr(getattr(torch.ops, ns), short)
    except (AttributeError, RuntimeError):
        return None


def _define_ops():
    """Defines the two ops in this build's namespace, once per process (the package may be imported
    under more than one module name)."""
    if _op("moe_grouped_linear") is not None:
        return
    qual = add_op_namespace_prefix("moe_grouped_linear")
    torch.library.custom_op(qual, _grouped_linear_impl, mutates_args=(),
                            schema="(Tensor x, Tensor weight, Tensor offsets, Tensor? bias, bool transposed) -> Tensor")
    torch.library.register_fake(qual, _grouped_linear_fake)
    qual_bwd = add_op_namespace_prefix("moe_grouped_linear_backward")
    torch.library.custom_op(qual_bwd, _grouped_linear_backward_impl, mutates_args=(),
                            schema="(Tensor grad, Tensor x, Tensor weight, Tensor offsets, bool has_bias, "
                                   "bool transposed, bool need_x, bool need_weight) -> Tensor[]")
    torch.library.register_fake(qual_bwd, _grouped_linear_backward_fake)

    def setup(ctx, inputs, output):
        x, weight, offsets, bias, transposed = inputs
        ctx.save_for_backward(x, weight, offsets)
        ctx.has_bias, ctx.transposed = bias is not None, transposed

    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        need_x, need_w, _, need_b = ctx.needs_input_grad[:4]
        grad_x, grad_w, grad_b = _op("moe_grouped_linear_backward")(
            grad, x, weight, offsets, ctx.has_bias, ctx.transposed, need_x, need_w or need_b)
        return (grad_x if need_x else None, grad_w if need_w else None, None, grad_b if need_b else None, None)

    torch.library.register_autograd(qual, backward, setup_context=setup)


_define_ops()


def _experts_graph(xs, offsets, w_in, b_in, w_out, b_out, transposed, gate):
    grouped = _op("moe_grouped_linear")
    h = grouped(xs, w_in, offsets, b_in, transposed)
    return grouped(gate(h), w_out, offsets, b_out, transposed)


# --- the experts function ---------------------------------------------------------------------------


def _check_inputs(hidden_states, top_k_index, top_k_weights) -> None:
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D (tokens, hidden), got shape {tuple(hidden_states.shape)}")
    if top_k_index.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"top_k_index must be int64 or int32, got {top_k_index.dtype}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"top_k_index must have shape (tokens, top_k) with tokens = {hidden_states.shape[0]}, "
                         f"got shape {tuple(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"top_k_weights must have the shape of top_k_index {tuple(top_k_index.shape)}, "
                         f"got shape {tuple(top_k_weights.shape)}")
    if not top_k_weights.is_floating_point():
        raise TypeError(f"top_k_weights must be a float tensor, got {top_k_weights.dtype}")


def _route(top_k_index: torch.Tensor, num_experts: int):
    """(token of each pair in expert order, -1 for sentinels; the sort order; end of each
    expert's rows)."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    expert_sorted, order = torch.sort(flat, stable=True)
    if flat.numel():
        if torch.compiler.is_compiling():  # checked when the graph runs (RuntimeError), no break
            torch._assert_async(expert_sorted[0] >= 0, "top_k_index must hold expert ids >= 0")
        else:
            low = int(expert_sorted[0])
            if low < 0:
                raise ValueError(f"top_k_index must hold expert ids >= 0, got {low}")
    token = torch.div(order, k, rounding_mode="floor")
    token = torch.where(expert_sorted < num_experts, token, torch.full_like(token, _IGNORE))
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=flat.dtype)
    offsets = torch.searchsorted(expert_sorted, bounds)
    return token, order, offsets


def _gate_has_parameters(self, known) -> bool:
    """Whether the experts module has trainable parameters besides the expert weights, biases and
    post-expert norm: ones the gate or activation may use, which the per-block backward (it
    differentiates the gate with respect to its input only) would miss."""
    norm = getattr(self, "post_expert_norm", None) if self.has_post_expert_norm else None
    skip = {id(t) for t in known if t is not None}
    if isinstance(norm, torch.nn.Module):
        skip |= {id(p) for p in norm.parameters()}
    return any(p.requires_grad and id(p) not in skip for p in self.parameters())


_AUTOCAST_MIN_ROWS = 32  # see _autocast_operands


def _autocast_operands(offsets, weights, gate, device, compiling, loop):
    """Under torch.autocast, as eager's per-expert F.linear there: the products in autocast's
    dtype, with the weights and biases cast as autocast casts them (floating, not float64, not
    already in it; differentiably), and the loop then run with autocast off, since its products
    write into given memory, which autocast does not reach. Only the experts with rows are cast,
    as eager casts only the experts it runs (all of them, Qwen3-MoE's 128 in float32, cost 80 ms
    a call against eager's 4 at one token): their weights are gathered into [hit, ...] tensors
    and offsets kept for those (under torch.compile, which cannot size them, all are cast). The
    gate's output goes back to the products' dtype, as F.linear would cast it (an activation
    with float32 parameters promotes it). Without grad (`loop`: the inference loop runs) the
    weights are cast group by group inside the loop instead (its `cast`): each cast is then a few
    MiB that the allocator hands back to the next, where one cast of every expert that runs is new
    memory, faulted in on every call. Returns (offsets, w_in, b_in, w_out, b_out, gate, cast).

    Where the experts that run get fewer than _AUTOCAST_MIN_ROWS rows each on average, casting
    their weights costs more than the products save, and nothing is cast: the products run in the
    weights' dtype, more exactly than eager's. No grad, float32 weights under a bf16 autocast, ms
    a call, eager / ours casting / ours not: Qwen3-MoE-like (128 experts of 512 x 512, top-8) 1
    token 3.96 / 12.61 / 1.28, 8 tokens 26.97 / 70.69 / 10.6, 64 tokens 73.23 / 205.44 / 40.88,
    1024 tokens 126.18 / 124.1 / 117.0; Mixtral's block (8 experts, 1024 x 3584, top-2) 1 token
    10.52 / 41.36 / 2.82, 64 tokens 42.57 / 81.22 / 29.91, 256 tokens 54.6 / 96.32 / 77.48, 1024
    tokens 76.33 / 117.98 / 190.17, when every expert that ran was cast up front, new memory
    faulted in on each call. Cast group by group in the loop (`loop`), eager / ours, from 32 rows
    per expert: Qwen3-MoE-like 256 tokens 81.16 / 54.01, 1024 tokens 117.04 / 76.76; Mixtral 256
    tokens 49.11 / 49.61, 1024 tokens 65.14 / 70.21. A training call still casts up front."""
    low = torch.get_autocast_dtype(device)

    def eligible(t):
        return t is not None and t.is_floating_point() and t.dtype not in (torch.float64, low)
    if not any(eligible(t) for t in weights):
        return (offsets, *weights, gate, None)
    if not compiling:
        ends = offsets.tolist()
        hit = [e for e, end in enumerate(ends) if end > (ends[e - 1] if e else 0)]
        if not hit or ends[-1] < _AUTOCAST_MIN_ROWS * len(hit):
            return (offsets, *weights, gate, None)
        if loop and all(t is None or eligible(t) for t in weights):
            return (offsets, *weights, lambda h: gate(h).to(h.dtype), low)
        if len(hit) < len(ends):
            picked = torch.tensor(hit, dtype=torch.long, device=offsets.device)
            offsets = offsets.index_select(0, picked)
            weights = tuple(None if t is None else t.index_select(0, picked) for t in weights)
    cast = tuple(t.to(low) if eligible(t) else t for t in weights)
    return (offsets, *cast, lambda h: gate(h).to(h.dtype), None)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The `ExpertsInterface` function: hidden_states (T, H), top_k_index (T, K) expert ids,
    top_k_weights (T, K) routing weights -> (T, H) in hidden_states.dtype."""
    _check_inputs(hidden_states, top_k_index, top_k_weights)
    w_in = self.gate_up_proj if self.has_gate else self.up_proj
    b_in = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias) if self.has_bias else None
    w_out = self.down_proj
    b_out = self.down_proj_bias if self.has_bias else None
    gate = self._apply_gate if self.has_gate else self.act_fn
    transposed = bool(self.is_transposed)

    with torch.no_grad():
        token, order, offsets = _route(top_k_index, w_in.shape[0])
    pair_weight = top_k_weights.reshape(-1)[order]

    compiling = torch.compiler.is_compiling()
    grad = torch.is_grad_enabled()
    weights = (w_in, b_in, w_out, b_out)
    if torch.autograd.forward_ad._current_level >= 0 and any(
            torch.autograd.forward_ad.unpack_dual(t).tangent is not None
            for t in (hidden_states, top_k_weights, *self.parameters(), *(t for t in weights if t is not None))):
        # the products write into given memory (out=, this library's own products), where a
        # tangent would be dropped without a word
        raise NotImplementedError("scatter_add.moe: forward-mode AD (dual tensors) is not supported by this experts "
                                  "implementation; use 'eager' for it")
    recording = grad and any(t is not None and t.requires_grad for t in (hidden_states, *weights))
    graph = compiling or (grad and _gate_has_parameters(self, weights))
    device = hidden_states.device.type
    autocast = torch.is_autocast_enabled(device)
    loop = not graph and not recording  # nothing to differentiate: each group gathers its own rows
    cast = None
    if autocast:
        offsets, w_in, b_in, w_out, b_out, gate, cast = _autocast_operands(offsets, weights, gate, device, compiling,
                                                                           loop)
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        if loop:
            ys = _experts_loop(hidden_states, offsets, w_in, b_in, w_out, b_out, transposed, gate, token=token,
                               cast=cast, silu=not autocast and _silu_gate(self))
        else:
            xs = gather(hidden_states, token, ignore_index=_IGNORE).to(w_in.dtype)
            args = (xs, offsets, w_in, b_in, w_out, b_out, transposed, gate)
            ys = _experts_graph(*args) if graph else _Experts.apply(*args, _silu_gate(self))
    if self.has_post_expert_norm:
        ys = self.post_expert_norm(ys)
    ys = ys.to(hidden_states.dtype)
    out = hidden_states.new_zeros(hidden_states.shape)
    if compiling or (grad and (ys.requires_grad or pair_weight.requires_grad)):
        return index_add(out, token, ys, weight=pair_weight, ignore_index=_IGNORE)
    return scatter_add(out, token, ys, weight=pair_weight, ignore_index=_IGNORE)  # in place: no copy of out


def register(name: str = NAME) -> str:
    """Adds `experts_forward` to transformers' ExpertsInterface under `name`; returns `name`."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, experts_forward)
    return name
