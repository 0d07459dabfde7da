"""ops.small_matmul (y = x @ w.T in bf16, the MoE experts' products): accuracy against float64
next to torch.mm's, the same bits on 1 and 2 threads and for any number of rows (on AMX tiles
and on the vector kernels), ops.small_matmul_tiles, the level it declines, errors that name the
argument and leave y untouched, fake tensors, and its use by the MoE experts loop."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT


def small(sa):
    return sa.ops.small_matmul.default


def served(sa):
    one = torch.ones(1, 1, dtype=torch.bfloat16)
    return bool(small(sa)(torch.empty_like(one), one, one))


def tiles_op(sa):
    return sa.ops.small_matmul_tiles.default


@pytest.fixture(params=[True, False], ids=["tiles", "vectors"])
def tiles(sa, request):
    """small_matmul on AMX tiles where this CPU has them, and on the level's vector kernel; the
    first is skipped where there are no tiles."""
    probe = torch.empty(0, dtype=torch.bfloat16)
    was = tiles_op(sa)(probe)
    if request.param and not tiles_op(sa)(probe, 1):
        pytest.skip("no AMX tiles here: small_matmul runs the level's vector kernel")
    if not request.param:
        tiles_op(sa)(probe, 0)
    yield request.param
    tiles_op(sa)(probe, int(was))


def test_tiles_op_asks_turns_and_checks(sa):
    """ops.small_matmul_tiles: on wherever torch's oneDNN multiplies on AMX tiles (the same CPUID
    and OS checks), turned off and on, errors that name the argument, False for meta and fake tensors,
    and off by SCATTER_ADD_CPU_AMX=0 or a level below avx512_bf16."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    op, probe = tiles_op(sa), torch.empty(0, dtype=torch.bfloat16)
    on = op(probe)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if amx:
        assert on is True
    try:
        assert op(probe, 0) is False and op(probe) is False
        assert op(probe, 1) is on and op(probe) is on
    finally:
        op(probe, int(on))
    message = "small_matmul_tiles: set must be -1 (ask), 0 (off) or 1 (on), got 2"
    with pytest.raises(RuntimeError, match=re.escape(message)):
        op(probe, 2)
    assert op(torch.empty(0, device="meta")) is False  # meta and fake tensors: the fake's answer
    with FakeTensorMode():
        assert op(torch.empty(0)) is False
    code = ("import sys, torch\nsys.path.insert(0, 'tests/python')\nfrom conftest import load_sa\nsa = load_sa()\n"
            "print(sa.ops.small_matmul_tiles.default(torch.empty(0)))\n")
    for env in ({"SCATTER_ADD_CPU_AMX": "0"}, {"SCATTER_ADD_CPU_ISA": "avx512"}, {}):
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, **env), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip().splitlines()[-1] == str(on and not env), env


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 30, 47])
@pytest.mark.parametrize("o, h", [(1, 1), (7, 31), (33, 64), (70, 100), (300, 1030)])
def test_matches_float64_as_torch_mm_does(sa, rows, o, h, tiles):
    if not served(sa):
        pytest.skip("small_matmul has no kernel on this CPU (below AVX2): the experts use torch.mm")
    g = torch.Generator().manual_seed(rows * 1000 + o + h)
    x = torch.randn(rows, h, generator=g).bfloat16()
    w = torch.randn(o, h, generator=g).bfloat16()
    out = torch.full((rows, o), 7.0, dtype=torch.bfloat16)
    assert small(sa)(out, x, w)
    ref = x.double() @ w.double().t()
    mag = x.double().abs() @ w.double().abs().t()
    # float32 sums (at most h + 16 roundings of 2^-24 of the magnitudes), then one bf16 rounding
    bound = (h + 16) * 2.0 ** -24 * mag + 2.0 ** -8 * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()
    theirs = (torch.mm(x, w.t()).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() <= theirs + 2.0 ** -8 * ref.abs().max()


def test_same_bits_on_1_and_2_threads_and_in_strided_views(sa, tiles):
    if not served(sa):
        pytest.skip("small_matmul has no kernel on this CPU (below AVX2)")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 600, generator=g).bfloat16()
    w = torch.randn(1000, 700, generator=g).bfloat16()[:, 50:650]  # rows 700 apart
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.zeros(3, 1000, dtype=torch.bfloat16)
            assert small(sa)(out, x, w)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    padded = torch.zeros(3, 1024, dtype=torch.bfloat16)
    assert small(sa)(padded[:, :1000], x, w)
    assert torch.equal(padded[:, :1000], outs[0]) and not padded[:, 1000:].any()


def test_many_rows_have_the_bits_of_one_row_calls(sa, tiles):
    if not served(sa):
        pytest.skip("small_matmul has no kernel on this CPU (below AVX2)")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 300, generator=g).bfloat16()
    w = torch.randn(90, 300, generator=g).bfloat16()
    out = torch.empty(37, 90, dtype=torch.bfloat16)
    assert small(sa)(out, x, w)
    for i in range(37):
        one = torch.empty(1, 90, dtype=torch.bfloat16)
        assert small(sa)(one, x[i:i + 1], w)
        assert torch.equal(one[0].view(torch.int16), out[i].view(torch.int16)), i


def test_declines_the_scalar_level_leaving_y_untouched(sa):
    code = ("import sys, torch\nsys.path.insert(0, 'tests/python')\nfrom conftest import ROOT, load_sa\nsa = load_sa()\n"
            "x, w = torch.randn(9, 16).bfloat16(), torch.randn(5, 16).bfloat16()\n"
            "out = torch.full((9, 5), 3.0, dtype=torch.bfloat16)\n"
            "assert sa.ops.small_matmul.default(out, x, w) is False\n"
            "assert torch.equal(out, torch.full((9, 5), 3.0, dtype=torch.bfloat16))\n"
            "assert sa.ops.small_matmul_grouped.default(out, x, w.view(1, 5, 16), torch.tensor([9])) is False\n"
            "assert torch.equal(out, torch.full((9, 5), 3.0, dtype=torch.bfloat16))\n"
            "print('ok')\n")
    env = dict(os.environ, SCATTER_ADD_CPU_ISA="scalar")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("rows", [1, 6, 7, 40])
@pytest.mark.parametrize("h, o", [(1, 1), (31, 7), (64, 33), (300, 100)])
def test_nn_matches_float64_and_threads(sa, rows, h, o):
    """small_matmul_nn: y = x @ w for w [h, o], within the float32 sum bound and one bf16 rounding
    of float64, no worse than torch.mm, and the same bits on 1 and 2 threads."""
    if not served(sa):
        pytest.skip("small_matmul_nn has no kernel on this CPU (below AVX2)")
    g = torch.Generator().manual_seed(rows * 100 + h + o)
    x = torch.randn(rows, h, generator=g).bfloat16()
    w = torch.randn(h, o, generator=g).bfloat16()
    nn = sa.ops.small_matmul_nn.default
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.full((rows, o), 7.0, dtype=torch.bfloat16)
            assert nn(out, x, w)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    out = outs[0]
    ref = x.double() @ w.double()
    mag = x.double().abs() @ w.double().abs()
    bound = (h + 1) * 2.0 ** -24 * mag + 2.0 ** -8 * ref.abs()
    assert ((out.double() - ref).abs() <= bound).all()
    theirs = (torch.mm(x, w).double() - ref).abs().max()
    assert (out.double() - ref).abs().max() <= theirs + 2.0 ** -8 * ref.abs().max()


def test_nn_bad_shapes_name_the_argument(sa):
    nn = sa.ops.small_matmul_nn.default
    x, w = torch.randn(2, 16).bfloat16(), torch.randn(15, 5).bfloat16()
    out = torch.full((2, 5), 3.0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=re.escape("ValueError: small_matmul_nn: x has 16 columns but w has 15 rows")):
        nn(out, x, w)
    with pytest.raises(RuntimeError, match=re.escape("ValueError: small_matmul_nn: y has shape [2, 5] but x @ w has shape [2, 4]")):
        nn(out, x, torch.randn(16, 4).bfloat16())
    assert torch.equal(out, torch.full((2, 5), 3.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("bad, message", [
    ("x_float", "x must be BFloat16, got Float"),
    ("y_float", "y must be BFloat16, got Float"),
    ("w_1d", "w must be 2-D, got shape [16]"),
    ("x_columns", "x must have contiguous rows, got strides (1, 2)"),
    ("shape", "x has 16 columns but w has 15"),
    ("out_shape", "y has shape [2, 4] but x @ w.T has shape [2, 5]"),
    ("overlap", "w memory overlaps y"),
])
def test_bad_input_names_the_argument_and_leaves_y_untouched(sa, bad, message):
    x = torch.randn(2, 16).bfloat16()
    w = torch.randn(5, 16).bfloat16()
    out = torch.full((2, 5), 3.0, dtype=torch.bfloat16)
    if bad == "x_float":
        x = x.float()
    if bad == "y_float":
        out = out.float()
    if bad == "w_1d":
        w = w[0]
    if bad == "x_columns":
        x = torch.randn(16, 2).bfloat16().t()
    if bad == "shape":
        w = w[:, :15]
    if bad == "out_shape":
        out = out[:, :4]
    if bad == "overlap":
        store = torch.zeros(100, dtype=torch.bfloat16)
        w, out = store[:80].view(5, 16), store[10:20].view(2, 5)
    before = out.clone()
    with pytest.raises(RuntimeError, match=re.escape("ValueError: small_matmul: " + message)):
        small(sa)(out, x, w)
    assert torch.equal(out, before)


def grouped(sa):
    return sa.ops.small_matmul_grouped.default


@pytest.mark.parametrize("ends_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rows", [[1], [0, 3, 0, 1, 2], [2, 2, 0, 9, 1, 5], [17, 0, 0, 4]])
def test_grouped_has_the_bits_of_one_call_per_block(sa, rows, ends_dtype):
    """small_matmul_grouped over a range of an [E, o, h] weight's experts: each block the bits of
    small_matmul on it alone, on 1 and 2 threads; rows past the last block untouched."""
    if not served(sa):
        pytest.skip("small_matmul has no kernel on this CPU (below AVX2)")
    g = torch.Generator().manual_seed(len(rows) * 10 + sum(rows))
    e0, o, h = 2, 70, 150
    w_all = torch.randn(e0 + len(rows) + 1, o, h, generator=g).bfloat16()
    w = w_all[e0:e0 + len(rows)]
    ends = torch.tensor(rows).cumsum(0).to(ends_dtype)
    extra = 3
    x = torch.randn(int(ends[-1]) + extra, h, generator=g).bfloat16()
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = torch.full((x.shape[0], o), 5.0, dtype=torch.bfloat16)
            assert grouped(sa)(out, x, w, ends) is True
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    start = 0
    for e, end in enumerate(ends.tolist()):
        want = torch.empty(end - start, o, dtype=torch.bfloat16)
        assert small(sa)(want, x[start:end], w[e])
        assert torch.equal(outs[0][start:end].view(torch.int16), want.view(torch.int16)), e
        start = end
    assert torch.equal(outs[0][start:], torch.full((extra, o), 5.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("bad, message", [
    ("ends_decrease", "ends[2] = 3 is smaller than ends[1] = 4"),
    ("ends_negative", "ends[0] = -1 is negative"),
    ("ends_past", "ends[2] = 9 is past x's 8 rows"),
    ("ends_length", "ends must be 1-D with 3 entries (one per expert of w), got shape [2]"),
    ("ends_float", "ends must be int32 or int64, got Float"),
    ("w_2d", "w must be 3-D [experts, out, in], got shape [15, 16]"),
    ("w_empty", "w must hold at least one expert, got shape [0, 5, 16]"),
    ("w_gap", "w must hold its experts' rows back to back (strides (o * s, s, 1), s >= in), got strides (128, 16, 1)"),
    ("w_columns", "w must hold its experts' rows back to back (strides (o * s, s, 1), s >= in), got strides (80, 1, 5)"),
    ("x_columns", "x has 12 columns but w has 16"),
    ("y_shape", "y has shape [8, 4] but x @ w.T has shape [8, 5]"),
    ("y_rows", "y has shape [7, 5] but x @ w.T has shape [8, 5]"),
    ("overlap", "w memory overlaps y"),
    ("y_float", "y must be BFloat16, got Float"),
])
def test_grouped_bad_input_names_the_argument_and_leaves_y_untouched(sa, bad, message):
    x = torch.randn(8, 16).bfloat16()
    w = torch.randn(3, 5, 16).bfloat16()
    ends = torch.tensor([2, 4, 8])
    out = torch.full((8, 5), 3.0, dtype=torch.bfloat16)
    if bad == "ends_decrease":
        ends = torch.tensor([2, 4, 3])
    if bad == "ends_negative":
        ends = torch.tensor([-1, 4, 8])
    if bad == "ends_past":
        ends = torch.tensor([2, 4, 9])
    if bad == "ends_length":
        ends = ends[:2]
    if bad == "ends_float":
        ends = ends.float()
    if bad == "w_2d":
        w = torch.randn(15, 16).bfloat16()
    if bad == "w_empty":
        w = w[:0]
    if bad == "w_gap":
        w = torch.randn(3, 8, 16).bfloat16()[:, :5]
    if bad == "w_columns":
        w = torch.randn(3, 16, 5).bfloat16().transpose(1, 2)
    if bad == "x_columns":
        x = x[:, :12]
    if bad == "y_shape":
        out = out[:, :4]
    if bad == "y_rows":
        out = out[:7]
    if bad == "overlap":
        store = torch.zeros(400, dtype=torch.bfloat16)
        w, out = store[:240].view(3, 5, 16), store[200:240].view(8, 5)
    if bad == "y_float":
        out = out.float()
    before = out.clone()
    with pytest.raises(RuntimeError, match=re.escape("ValueError: small_matmul_grouped: " + message)):
        grouped(sa)(out, x, w, ends)
    assert torch.equal(out, before)


def test_fake_tensors_decline(sa):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(1, 8, dtype=torch.bfloat16)
        w = torch.empty(4, 8, dtype=torch.bfloat16)
        assert small(sa)(torch.empty(1, 4, dtype=torch.bfloat16), x, w) is False
        ends = torch.tensor([1, 1])
        assert grouped(sa)(torch.empty(1, 4, dtype=torch.bfloat16), x, w.view(2, 2, 8), ends) is False


def test_moe_probe_under_a_fake_mode_is_not_kept(sa, monkeypatch):
    """The MoE path asks once whether small_matmul runs here; asked first under fake tensors it
    answers no for that call only."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    moe = sa.moe
    monkeypatch.setattr(moe, "_small_kernel", None)
    monkeypatch.setattr(moe, "_AMX", False)
    x, w = torch.randn(1, 8).bfloat16(), torch.randn(2, 3, 8).bfloat16()
    here = served(sa)
    with FakeTensorMode():
        assert moe._small_ok(x, w, None, False) is False
    assert moe._small_kernel is None
    with torch.device("meta"):  # the probe's own tensors are the CPU's
        assert moe._small_ok(x, w, None, False) == here
    assert moe._small_kernel == here
    monkeypatch.setattr(moe, "_small_tiles", None)
    with FakeTensorMode():
        assert moe._tiles_here() is False
    assert moe._small_tiles is None
    on = tiles_op(sa)(torch.empty(0, dtype=torch.bfloat16))
    with torch.device("meta"):  # the probe's own tensor is the CPU's
        assert moe._tiles_here() == on
    assert moe._small_tiles == on


def count_ops(moe, monkeypatch):
    """moe.ops replaced by a stand-in that counts its small_matmul and small_matmul_grouped
    calls: (the counts, the real ops)."""
    calls = {"small_matmul": 0, "small_matmul_grouped": 0}
    real = moe.ops

    def counted(name):
        class Op:
            @staticmethod
            def default(*args):
                calls[name] += 1
                return getattr(real, name).default(*args)
        return Op

    class Counting:
        small_matmul = counted("small_matmul")
        small_matmul_grouped = counted("small_matmul_grouped")

    monkeypatch.setattr(moe, "ops", Counting)
    return calls, real


def counted_loop(moe, monkeypatch, rows, w_in, w_out, g):
    """moe._experts_loop (no grad) over blocks of `rows` rows of random bf16 x, with a relu gate
    and the ops counted (count_ops): xs, ends, the gate, the output, the counts, the real ops."""
    inter = w_out.shape[2]
    ends = torch.tensor(rows).cumsum(0)
    xs = torch.randn(int(ends[-1]), w_in.shape[2], generator=g).bfloat16()

    def gate(h):
        return torch.relu(h[:, :inter]) * h[:, inter:]

    calls, real = count_ops(moe, monkeypatch)
    with torch.no_grad():
        ys = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate)
    return xs, ends, gate, ys, calls, real


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn_bf16", "reference_bf16"])
@pytest.mark.parametrize("rows", [[1, 0, 2, 1], [3, 4, 1, 2], [9, 1, 12, 20], [1, 2, 9, 1]])
def test_experts_loop_takes_it_for_small_bf16_blocks(sa, monkeypatch, rows, onednn):
    """The MoE experts loop (no grad, bf16, without AMX) multiplies blocks of at most four rows
    with small_matmul where torch multiplies bf16 by oneDNN, every block where it does not; the
    rest as before. A group whose blocks all take it makes one small_matmul_grouped call per
    product, a group with larger blocks a small_matmul call per small block. Every block equals
    its own product."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_AMX", False)
    monkeypatch.setattr(moe, "_ONEDNN_BF16", onednn)
    monkeypatch.setattr(moe, "_small_kernel", served(sa))  # probed here, not counted below
    g = torch.Generator().manual_seed(5)
    e_count, hidden, inter = 4, 64, 40
    w_in = (0.2 * torch.randn(e_count, 2 * inter, hidden, generator=g)).bfloat16()
    w_out = (0.2 * torch.randn(e_count, hidden, inter, generator=g)).bfloat16()
    xs, ends, gate, ys, calls, real = counted_loop(moe, monkeypatch, rows, w_in, w_out, g)
    limit = moe._small_rows(hidden, w_in)
    assert limit == (moe._SMALL_ROWS if onednn else 1 << 62)
    small_blocks = sum(1 for r in rows if 0 < r <= limit)
    looped = served(sa) and 2 * small_blocks >= sum(1 for r in rows if r > 0)
    all_small = max(rows) <= limit
    assert calls["small_matmul_grouped"] == (2 if looped and all_small else 0)
    assert calls["small_matmul"] == (2 * small_blocks if looped and not all_small else 0)
    start = 0
    for e, end in enumerate(ends.tolist()):
        x = xs[start:end]
        if end == start:
            continue
        if looped and end - start <= limit:
            h = torch.empty(end - start, 2 * inter, dtype=torch.bfloat16)
            assert real.small_matmul.default(h, x, w_in[e])
            want = torch.empty(end - start, hidden, dtype=torch.bfloat16)
            assert real.small_matmul.default(want, gate(h), w_out[e])
            assert torch.equal(ys[start:end], want)
        else:
            want = torch.mm(gate(torch.mm(x, w_in[e].t())), w_out[e].t())
            torch.testing.assert_close(ys[start:end], want, rtol=0, atol=0)
        start = end


def test_experts_loop_gate_output_in_any_layout_keeps_each_blocks_product(sa, monkeypatch):
    """A gate whose output rows are not contiguous (column-major here) leaves the down products
    to torch.mm block by block, as the per-block loop does: the grouped call takes rows with unit
    column stride only, and the result has the per-block loop's bits."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_AMX", False)
    monkeypatch.setattr(moe, "_ONEDNN_BF16", False)
    monkeypatch.setattr(moe, "_small_kernel", served(sa))
    g = torch.Generator().manual_seed(8)
    e_count, hidden, inter = 4, 256, 128
    w_in = (0.1 * torch.randn(e_count, 2 * inter, hidden, generator=g)).bfloat16()
    w_out = (0.1 * torch.randn(e_count, hidden, inter, generator=g)).bfloat16()
    ends = torch.tensor([3, 5, 8, 10])
    xs = torch.randn(10, hidden, generator=g).bfloat16()

    def gate(h):
        return (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).t().contiguous().t()

    with torch.no_grad():
        ys = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate)
        monkeypatch.setattr(moe, "_small_grouped", lambda *args: False)
        want = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate)
    assert torch.equal(ys.view(torch.int16), want.view(torch.int16))


def test_experts_loop_with_tiles_multiplies_wide_down_rows_by_block(sa, monkeypatch):
    """With AMX's tiles, a gate group whose up products take one small_matmul_grouped call but
    whose down products' rows are wider than the tiles take in the passes allowed (_small_rows)
    multiplies those block by block, once each, without multiplying the up products again;
    every block has the bits of its own products."""
    if not served(sa):
        pytest.skip("small_matmul has no kernel on this CPU (below AVX2)")
    moe = sa.moe
    monkeypatch.setattr(moe, "_AMX", True)
    monkeypatch.setattr(moe, "_small_tiles", True)  # the vector kernel stands in where there are no tiles
    monkeypatch.setattr(moe, "_small_kernel", True)
    g = torch.Generator().manual_seed(9)
    e_count, hidden, inter = 3, 64, 80 * 32  # down rows of 80 steps of 32 columns: 288 rows a pass
    w_in = (0.2 * torch.randn(e_count, 2 * inter, hidden, generator=g)).bfloat16()
    w_out = (0.05 * torch.randn(e_count, hidden, inter, generator=g)).bfloat16()
    monkeypatch.setattr(moe, "_TILE_ROWS", 1000)
    assert moe._small_rows(inter, w_out) == 576  # two passes over a weight of at most 16 MiB
    monkeypatch.setattr(moe, "_TILE_REREAD_BYTES", 0)  # one pass
    assert moe._small_rows(hidden, w_in) == 1000 and moe._small_rows(inter, w_out) == 288
    assert moe._small_rows(moe._TILE_MAX_COLS, w_out) == 32 and moe._small_rows(moe._TILE_MAX_COLS + 1, w_out) == 0
    monkeypatch.setattr(moe, "_GATE_GROUP_ELEMS", 1 << 30)  # one gate group
    monkeypatch.setattr(moe, "_TEAMS", False)
    rows = [300, 2, 5]
    xs, ends, gate, ys, calls, real = counted_loop(moe, monkeypatch, rows, w_in, w_out, g)
    assert calls == {"small_matmul_grouped": 1, "small_matmul": 2}  # the up products in one call; 2 small downs
    start = 0
    for e, end in enumerate(ends.tolist()):
        h = torch.empty(end - start, 2 * inter, dtype=torch.bfloat16)
        assert real.small_matmul.default(h, xs[start:end], w_in[e])
        if end - start <= 288:
            want = torch.empty(end - start, hidden, dtype=torch.bfloat16)
            assert real.small_matmul.default(want, gate(h), w_out[e])
        else:
            want = moe._linear(gate(h), w_out, e, None, False)
        assert torch.equal(ys[start:end].view(torch.int16), want.view(torch.int16)), e
        start = end
