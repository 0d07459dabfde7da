"""The compiled ops called directly (torch.ops.<namespace>.*), as the Python API and a compiled
graph call them: what an error looks like through torch's stable ABI (a RuntimeError whose message
is exactly "<Kind>: <op>: <what>", nothing added), which argument a message names, and overlap
decided on the elements views touch. After every error the input is bit-for-bit unchanged."""
import re

import pytest
import torch


def bits(t):
    return t.detach().clone().contiguous().view(torch.uint8)


def raises_tagged(fn, kind, op, what, *watch):
    """fn() raises RuntimeError("<kind>: <op>: <what>") exactly, and leaves `watch` unchanged."""
    before = [bits(t) for t in watch]
    with pytest.raises(RuntimeError) as e:
        fn()
    assert str(e.value) == f"{kind}: {op}: {what}"
    assert e.value.args == (f"{kind}: {op}: {what}",)
    for t, b in zip(watch, before):
        assert torch.equal(bits(t), b)


OPS = ["scatter_add_", "index_add", "gather"]
OP_NAME = {"scatter_add_": "scatter_add", "index_add": "index_add", "gather": "gather"}


def call(sa, op, x, index, src=None, weight=None, ignore_index=None):
    if op == "gather":
        return sa.ops.gather(x, index, weight, ignore_index)
    return getattr(sa.ops, op)(x, index, src, weight, ignore_index)


@pytest.mark.parametrize("op", OPS)
def test_bad_index_value_is_an_index_error_tag(sa, op):
    x, src = torch.randn(6, 4), torch.randn(3, 4)
    raises_tagged(lambda: call(sa, op, x, torch.tensor([0, 6, 2]), src), "IndexError", OP_NAME[op],
                  "index[1] = 6 is out of range for 6 rows (valid: 0..5)", x, src)


@pytest.mark.parametrize("op", OPS)
def test_bad_values_are_value_error_tags(sa, op):
    x, idx = torch.randn(6, 4), torch.tensor([0, 5, 2])
    src = torch.randn(3, 4)
    name = OP_NAME[op]
    raises_tagged(lambda: call(sa, op, x, idx.float(), src), "ValueError", name,
                  "index must be int32 or int64, got Float", x)
    raises_tagged(lambda: call(sa, op, x, idx[None], src), "ValueError", name,
                  "index must be 1-D [K], got shape [1, 3]", x)
    raises_tagged(lambda: call(sa, op, x.int(), idx, src.int()), "ValueError", name,
                  "input must be float32, float64, bfloat16 or float16, got Int", x)
    raises_tagged(lambda: call(sa, op, x, idx, src, weight=torch.ones(3, dtype=torch.long)), "ValueError", name,
                  "weight must be float32, float64, bfloat16 or float16, got Long", x)
    raises_tagged(lambda: call(sa, op, x, idx, src, weight=torch.ones(3).to(torch.float8_e4m3fn)), "ValueError",
                  name, "weight must be float32, float64, bfloat16 or float16, got Float8_e4m3fn", x)
    raises_tagged(lambda: call(sa, op, x, idx, src, weight=torch.ones(2)), "ValueError", name,
                  "weight must be 1-D with 3 entries (one per index), got shape [2]", x)
    if op != "gather":
        raises_tagged(lambda: call(sa, op, x, idx, src.double()), "ValueError", name,
                      "src dtype Double does not match input dtype Float", x)
        raises_tagged(lambda: call(sa, op, x, idx, torch.randn(4, 4)), "ValueError", name,
                      "src has 4 rows but index has 3 entries", x)


def test_expanded_input_is_named_input(sa):
    base = torch.zeros(1, 8)
    raises_tagged(lambda: sa.ops.scatter_add_(base.expand(4, 8), torch.tensor([0]), torch.ones(1, 8), None, None),
                  "ValueError", "scatter_add",
                  "input row stride 0 is smaller than its row length 8 (rows would alias; expanded tensors cannot "
                  "be written in place)", base)
    col = torch.zeros(4, 1)
    raises_tagged(lambda: sa.ops.scatter_add_(col.expand(4, 8), torch.tensor([0]), torch.ones(1, 8), None, None),
                  "ValueError", "scatter_add",
                  "input has elements that share memory (shape [4, 8], strides [1, 0]; expanded tensors cannot "
                  "be written in place)", col)


def test_column_slices_of_one_matrix_do_not_overlap(sa):
    """Interleaved views that share no element are accepted, as torch accepts them."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(6, 8, generator=g)
    idx = torch.tensor([0, 3, 3, 5])
    expected = b[:, :4].index_add(0, idx, b[:4, 4:])
    sa.ops.scatter_add_(b[:, :4], idx, b[:4, 4:], None, None)
    assert torch.equal(b[:, :4], expected)
    r = torch.randn(12, 8, generator=g)
    expected = r[::2].index_add(0, idx, r[1:9:2])
    sa.ops.scatter_add_(r[::2], idx, r[1:9:2], None, None)  # even and odd rows
    assert torch.equal(r[::2], expected)


def test_real_overlap_is_refused(sa):
    b = torch.randn(6, 8)
    raises_tagged(lambda: sa.ops.scatter_add_(b[:, :4], torch.tensor([0, 1]), b[:2, 2:6], None, None),
                  "ValueError", "scatter_add", "src memory overlaps input (in-place aliasing is not supported)", b)
    buf = torch.zeros(64, dtype=torch.int64)
    inp = buf[:48].view(torch.float64).view(6, 8)
    raises_tagged(lambda: sa.ops.scatter_add_(inp, buf[40:43], torch.randn(3, 8, dtype=torch.float64), None, None),
                  "ValueError", "scatter_add", "index memory overlaps input (in-place aliasing is not supported)", buf)
    raw = torch.zeros(6, 8)
    raises_tagged(lambda: sa.ops.scatter_add_(raw, torch.tensor([0, 1, 2]), torch.randn(3, 8), raw[5, :3], None),
                  "ValueError", "scatter_add", "weight memory overlaps input (in-place aliasing is not supported)", raw)


def test_strided_views_are_used_or_copied(sa):
    """A transposed input is updated through a contiguous copy; strided index and weight and a
    transposed src are read through copies; the results match torch's."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 7, generator=g).t()  # [7, 5], column stride 7
    idx = torch.randint(0, 7, (12,), generator=g)[::2]  # 6 entries, stride 2
    src = torch.randn(5, 6, generator=g).t()  # [6, 5]
    w = torch.rand(12, generator=g, dtype=torch.float64)[::2]
    expected = x.double().index_add(0, idx, src.double() * w[:, None]).float()
    out = sa.ops.index_add(x, idx, src, w, None)
    assert out.is_contiguous() and torch.allclose(out, expected, atol=1e-6)
    sa.ops.scatter_add_(x, idx, src, w, None)
    assert torch.equal(x, out)
    assert torch.equal(sa.ops.gather(x, idx, None, None), x[idx])


def test_index_add_returns_a_new_contiguous_tensor(sa):
    x = torch.randn(4, 3)
    before = bits(x)
    out = sa.ops.index_add(x, torch.tensor([1]), torch.ones(1, 3), None, None)
    assert out.data_ptr() != x.data_ptr() and out.is_contiguous()
    assert torch.equal(bits(x), before)
    assert torch.equal(out, x + torch.tensor([[0.0], [1.0], [0.0], [0.0]]))


def test_thread_count_follows_torch(sa):
    """The kernels use torch.get_num_threads() workers; results do not depend on it."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 256, generator=g)
    idx = torch.randint(0, 300, (4000,), generator=g)
    src = torch.randn(4000, 256, generator=g)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sa.ops.index_add(x, idx, src, None, None)
        torch.set_num_threads(max(2, n))
        many = sa.ops.index_add(x, idx, src, None, None)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, many)
    assert re.fullmatch(r"_scatter_add_(cpu|cu\d+)_[0-9a-f]{7}", sa.ops.__name__.split(".")[-1])
