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


def test_interleaved_columns_are_accepted(sa):
    """Views that interleave without sharing an element: decided on their elements, as torch
    decides them, whatever their strides."""
    b = torch.arange(16.0).view(4, 4)
    expected = b.clone()
    expected[:, ::2].index_add_(0, torch.arange(4), expected[:, 1::2].clone())
    sa.ops.scatter_add_(b[:, ::2], torch.arange(4), b[:, 1::2], None, None)
    assert torch.equal(b, expected)
    g = torch.Generator().manual_seed(4)
    r = torch.randn(8, 9, generator=g, dtype=torch.float64)
    idx = torch.tensor([0, 2, 2])
    expected = r.clone()
    expected[:, 0::3].index_add_(0, idx, expected[4:7, 2::3].clone())
    sa.ops.scatter_add_(r[:, 0::3], idx, r[4:7, 2::3], None, None)  # column stride 3, other rows
    assert torch.equal(r, expected)
    t = torch.randn(6, 8, generator=g).t()  # [8, 6] transposed: columns 0, 2, 4 against 1, 3, 5
    expected = t.clone()
    expected[:, ::2].index_add_(0, idx, expected[:3, 1::2].clone())
    sa.ops.scatter_add_(t[:, ::2], idx, t[:3, 1::2], None, None)
    assert torch.equal(t, expected)
    w = torch.zeros(8, 4)  # weight in the gaps between input's columns
    expected = w[:, ::2].index_add(0, idx, torch.ones(3, 2) * 0.5)
    w.view(-1)[1::2][:3] = 0.5
    sa.ops.scatter_add_(w[:, ::2], idx, torch.ones(3, 2), w.view(-1)[1:7:2], None)
    assert torch.equal(w[:, ::2], expected)


def test_interleaved_views_sharing_an_element_are_refused(sa):
    b = torch.arange(32.0).view(4, 8)
    inp = b[:, :6:2]  # columns 0, 2, 4
    for src in (b[:, 2::2],  # columns 2, 4, 6: the same strides
                b[1:3, ::2][:, :3],  # rows 1 and 2 of input itself
                b.as_strided((2, 3), (3, 1), 8)):  # elements 8..13, other strides: 8 and 10 are input's
        raises_tagged(lambda: sa.ops.scatter_add_(inp, torch.arange(src.shape[0]), src, None, None),
                      "ValueError", "scatter_add", "src memory overlaps input (in-place aliasing is not supported)", b)


def _elements(t):
    """The storage offsets of t's elements."""
    offs = torch.zeros((), dtype=torch.long)
    for n, s in zip(t.shape, t.stride()):
        offs = offs.unsqueeze(-1) + torch.arange(n) * s
    return set((offs + t.storage_offset()).flatten().tolist())


def test_overlap_against_the_elements_touched(sa):
    """Random strided views of one buffer: a pair that shares an element is always refused; a pair
    with the same strides is refused exactly when it shares one; any pair of disjoint byte ranges
    is accepted. The refusal leaves the buffer untouched."""
    g = torch.Generator().manual_seed(5)
    buf = torch.zeros(400, dtype=torch.float64)

    def rand_view(cols, strides=None):
        rows = int(torch.randint(1, 5, (1,), generator=g))
        rs, cs = strides or (int(torch.randint(1, 13, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g)))
        start = int(torch.randint(0, 40, (1,), generator=g))
        return buf.as_strided((rows, cols), (rs, cs), start)

    seen = {"refused-shared": 0, "accepted-same-strides": 0, "refused-same-strides": 0}
    for case in range(600):
        cols = int(torch.randint(1, 4, (1,), generator=g))
        inp = rand_view(cols)
        same = case % 2 == 0
        src = rand_view(cols, (inp.stride(0), inp.stride(1)) if same else None)
        if len(_elements(inp)) < inp.numel():
            continue  # input aliases itself: refused on that ground first
        idx = torch.randint(0, inp.shape[0], (src.shape[0],), generator=g)
        shared = bool(_elements(inp) & _elements(src))
        before = buf.clone()
        try:
            sa.ops.scatter_add_(inp, idx, src, None, None)
            refused = False
        except RuntimeError as e:
            assert str(e) == "ValueError: scatter_add: src memory overlaps input (in-place aliasing is not supported)"
            assert torch.equal(buf, before)
            refused = True
        if shared:
            assert refused, (inp.shape, inp.stride(), inp.storage_offset(), src.shape, src.stride(), src.storage_offset())
            seen["refused-shared"] += 1
        elif same:
            assert not refused, (inp.stride(), inp.storage_offset(), src.shape, src.storage_offset())
            seen["accepted-same-strides"] += 1
        lo = lambda t: t.storage_offset()  # noqa: E731
        hi = lambda t: t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # noqa: E731
        if hi(inp) < lo(src) or hi(src) < lo(inp):
            assert not refused
        if same and refused:
            seen["refused-same-strides"] += 1
    assert min(seen.values()) >= 20, seen  # each kind of pair was met


@pytest.mark.parametrize("op,arg", [(op, arg) for op in OPS for arg in ("input", "index", "src")
                                    if not (op == "gather" and arg == "src")])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_none_for_a_tensor_argument_is_a_type_error_tag(sa, op, arg, device):
    """None where the schema has a Tensor: the kernels (and the fake kernels, on meta tensors)
    name the argument, before anything reads it."""
    args = {"input": torch.zeros(6, 4, device=device), "index": torch.tensor([0, 5], device=device),
            "src": torch.ones(2, 4, device=device)}
    watch = [args["input"]] if device == "cpu" and arg != "input" else []
    args[arg] = None
    raises_tagged(lambda: call(sa, op, args["input"], args["index"], args["src"]), "TypeError", OP_NAME[op],
                  f"{arg} must be a tensor, got None", *watch)


def _bad_inputs(op):
    """(what, input, index, src, weight) for every shape, dtype and argument check."""
    x, idx, src = torch.zeros(6, 4), torch.tensor([0, 5, 2]), torch.ones(3, 4)
    cases = [("input 1-D", torch.zeros(6), idx, src, None), ("input 3-D", torch.zeros(6, 4, 1), idx, src, None),
             ("index 2-D", x, idx[None], src, None), ("index 0-D", x, idx[0], src, None),
             ("weight 2-D", x, idx, src, torch.ones(3, 1)), ("weight short", x, idx, src, torch.ones(2)),
             ("input None", None, idx, src, None), ("index None", x, None, src, None)]
    if op != "gather":
        cases += [("src 1-D", x, idx, torch.ones(3), None), ("src rows", x, idx, torch.ones(4, 4), None),
                  ("src cols", x, idx, torch.ones(3, 5), None), ("src None", x, idx, None, None)]
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
               torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
               torch.float8_e4m3fn, torch.float8_e5m2):
        cases.append((f"index {dt}", x, idx.to(dt), src, None))
        cases.append((f"weight {dt}", x, idx, src, torch.ones(3).to(dt)))
        if op != "gather":
            cases.append((f"input and src {dt}", x.to(dt), idx, src.to(dt), None))
            cases.append((f"src {dt}", x, idx, src.to(dt), None))
        else:
            cases.append((f"input {dt}", x.to(dt), idx, None, None))
    return cases


@pytest.mark.parametrize("op", OPS)
def test_kernel_and_fake_messages_agree_word_for_word(sa, op):
    """Every argument, shape and dtype error reads the same from the compiled kernel (cpu) and
    from the fake kernel (meta), with the op's own name, index_add's included."""
    def run(device, inp, index, src, weight):
        to = lambda t: None if t is None else t.to(device)  # noqa: E731
        try:
            call(sa, op, to(inp), to(index), to(src), to(weight))
        except RuntimeError as e:
            return str(e)
        return None

    for what, inp, index, src, weight in _bad_inputs(op):
        if op == "gather":
            src = None
        real = run("cpu", inp, index, src, weight)
        fake = run("meta", inp, index, src, weight)
        if real is None:
            assert fake is None, (what, fake)
            continue
        assert re.fullmatch(rf"(ValueError|TypeError): {OP_NAME[op]}: .+", real), (what, real)
        assert real == fake, (what, real, fake)


def test_index_add_errors_name_index_add(sa):
    x = torch.randn(6, 4)
    for src in (torch.randn(3, 4), torch.randn(3, 4, requires_grad=True)):  # the kernel and the recorded path
        raises_tagged(lambda: sa.ops.index_add(x, torch.tensor([0, 6, 2]), src, None, None), "IndexError",
                      "index_add", "index[1] = 6 is out of range for 6 rows (valid: 0..5)", x)
        with pytest.raises(IndexError, match=r"^index_add: index\[1\] = 6 is out of range"):
            sa.index_add(x, torch.tensor([0, 6, 2]), src)
        with pytest.raises(ValueError, match=r"^index_add: src has 3 rows but index has 2 entries$"):
            sa.index_add(x, torch.tensor([0, 1]), src)
