"""The bad-input catalogue of docs/errors.md, row by row: each bad input raises exactly the listed
exception with a message naming the argument, and leaves input bit-for-bit untouched; each edge
input gives the listed result. A test also checks the document lists every case here."""
import re
import threading

import numpy as np
import pytest
import torch

from conftest import ROOT


def bits(t):
    return t.detach().contiguous().view(torch.uint8).clone() if t.numel() else t.detach().clone()


def base(**over):
    d = dict(input=torch.randn(6, 4), index=torch.tensor([0, 5, 2]), src=torch.randn(3, 4), weight=None,
             ignore_index=None, lnc=None)
    d.update(over)
    return d


def shared_storage_case(kind):
    """input and another argument viewing the same memory."""
    buf = torch.zeros(64, dtype=torch.int64)
    inp = buf[:48].view(torch.float64).view(6, 8)
    if kind == "index":
        return base(input=inp, index=buf[40:43], src=torch.randn(3, 8, dtype=torch.float64))
    raw = torch.zeros(6, 8, dtype=torch.float64)
    return base(input=raw, src=torch.randn(3, 8, dtype=torch.float64), weight=raw[5, :3])


# (id, call kwargs, op, exception, message fragment)
SCATTER = "scatter_add"
GATHER = "gather"
ERROR_CASES = [
    ("index-out-of-range", base(index=torch.tensor([0, 6, 2])), SCATTER, IndexError, "index[1] = 6 is out of range for 6 rows"),
    ("index-negative", base(index=torch.tensor([0, -1, 2])), SCATTER, IndexError, "index[1] = -1"),
    ("index-out-of-range-not-ignored", base(index=torch.tensor([0, 7, -1]), ignore_index=-1), SCATTER, IndexError,
     "is not ignore_index = -1"),
    ("index-int32-out-of-range", base(index=torch.tensor([0, 1, 99], dtype=torch.int32)), SCATTER, IndexError, "index[2] = 99"),
    ("index-float-dtype", base(index=torch.tensor([0.0, 1.0, 2.0])), SCATTER, ValueError, "index must be int32 or int64"),
    ("index-int16-dtype", base(index=torch.tensor([0, 1, 2], dtype=torch.int16)), SCATTER, ValueError, "index must be int32 or int64, got Short"),
    ("index-bool-dtype", base(index=torch.tensor([True, False, True])), SCATTER, ValueError, "index must be int32 or int64"),
    ("index-2d", base(index=torch.tensor([[0, 1, 2]])), SCATTER, ValueError, "index must be 1-D"),
    ("src-dtype-mismatch", base(src=torch.randn(3, 4, dtype=torch.float64)), SCATTER, ValueError, "src dtype Double does not match input dtype Float"),
    ("src-rows-mismatch", base(src=torch.randn(4, 4)), SCATTER, ValueError, "src has 4 rows but index has 3 entries"),
    ("src-cols-mismatch", base(src=torch.randn(3, 5)), SCATTER, ValueError, "src has 5 columns but input has 4"),
    ("src-1d", base(src=torch.randn(3)), SCATTER, ValueError, "src must be 2-D"),
    ("input-1d", base(input=torch.randn(6)), SCATTER, ValueError, "input must be 2-D"),
    ("input-3d", base(input=torch.randn(6, 4, 1)), SCATTER, ValueError, "input must be 2-D"),
    ("input-int-dtype", base(input=torch.zeros(6, 4, dtype=torch.int32), src=torch.zeros(3, 4, dtype=torch.int32)),
     SCATTER, ValueError, "input must be float32, float64, bfloat16 or float16"),
    ("input-complex-dtype", base(input=torch.zeros(6, 4, dtype=torch.complex64), src=torch.zeros(3, 4, dtype=torch.complex64)),
     SCATTER, ValueError, "input must be float32"),
    ("weight-wrong-length", base(weight=torch.rand(2)), SCATTER, ValueError, "weight must be 1-D with 3 entries"),
    ("weight-2d", base(weight=torch.rand(3, 1)), SCATTER, ValueError, "weight must be 1-D with 3 entries"),
    ("weight-int-dtype", base(weight=torch.ones(3, dtype=torch.long)), SCATTER, ValueError,
     "weight must be float32, float64, bfloat16 or float16, got Long"),
    ("ignore-index-not-int", base(ignore_index=1.5), SCATTER, TypeError, "ignore_index must be an int"),
    ("device-mismatch", base(index=torch.tensor([0, 5, 2], device="meta")), SCATTER, ValueError, "index is on meta but input is on cpu"),
    ("src-overlaps-input", None, SCATTER, ValueError, "src memory overlaps input"),
    ("index-overlaps-input", shared_storage_case("index"), SCATTER, ValueError, "index memory overlaps input"),
    ("weight-overlaps-input", shared_storage_case("weight"), SCATTER, ValueError, "weight memory overlaps input"),
    ("input-expanded-rows", base(input=torch.zeros(1, 8).expand(4, 8), src=torch.randn(3, 8), index=torch.tensor([0, 3, 2])),
     SCATTER, ValueError, "scatter_add: input row stride 0 is smaller than its row length 8 (rows would alias; "
                          "expanded tensors cannot be written in place)"),
    ("input-expanded-columns", base(input=torch.zeros(4, 1).expand(4, 8), src=torch.randn(3, 8), index=torch.tensor([0, 3, 2])),
     SCATTER, ValueError, "scatter_add: input has elements that share memory (shape [4, 8], strides [1, 0]; "
                          "expanded tensors cannot be written in place)"),
    ("lnc-zero", base(lnc=0), SCATTER, ValueError, "lnc must be a positive int"),
    ("lnc-negative", base(lnc=-2), SCATTER, ValueError, "lnc must be a positive int"),
    ("lnc-float", base(lnc=2.0), SCATTER, TypeError, "lnc must be a positive int"),
    ("lnc-bool", base(lnc=True), SCATTER, TypeError, "lnc must be a positive int"),
    ("ignore-index-out-of-int64", base(ignore_index=2**64), SCATTER, ValueError,
     "scatter_add: ignore_index must be in the int64 range [-2**63, 2**63 - 1], got 18446744073709551616"),
    ("ignore-index-bool", base(ignore_index=True), SCATTER, TypeError, "ignore_index must be an int or None, got True"),
    ("input-none", base(input=None), SCATTER, TypeError, "scatter_add: input must be a torch.Tensor, got NoneType"),
    ("index-list", base(index=[0, 5, 2]), SCATTER, TypeError, "scatter_add: index must be a torch.Tensor, got list"),
    ("src-numpy", base(src=np.ones((3, 4), dtype=np.float32)), SCATTER, TypeError,
     "scatter_add: src must be a torch.Tensor, got numpy.ndarray"),
    ("weight-numpy", base(weight=np.ones(3, dtype=np.float32)), SCATTER, TypeError,
     "scatter_add: weight must be a torch.Tensor or None, got numpy.ndarray"),
    ("weight-float8", base(weight=torch.ones(3).to(torch.float8_e4m3fn)), SCATTER, ValueError,
     "scatter_add: weight must be float32, float64, bfloat16 or float16, got Float8_e4m3fn"),
    ("index-out-of-range-with-grad", base(index=torch.tensor([0, 6, 2]), src=torch.randn(3, 4, requires_grad=True)),
     SCATTER, IndexError, "scatter_add: index[1] = 6 is out of range for 6 rows"),
    ("src-rows-mismatch-with-grad", base(src=torch.randn(4, 4, requires_grad=True)), SCATTER, ValueError,
     "scatter_add: src has 4 rows but index has 3 entries"),
    ("gather-index-out-of-range", base(index=torch.tensor([0, 6, 2])), GATHER, IndexError, "gather: index[1] = 6"),
    ("gather-input-numpy", base(input=np.zeros((6, 4), dtype=np.float32)), GATHER, TypeError,
     "gather: input must be a torch.Tensor, got numpy.ndarray"),
    ("gather-input-1d", base(input=torch.randn(6)), GATHER, ValueError, "input must be 2-D"),
    ("gather-weight-wrong-length", base(weight=torch.rand(5)), GATHER, ValueError, "weight must be 1-D with 3 entries"),
]


def src_overlap_case():
    buf = torch.randn(10, 4)
    return base(input=buf[:6], src=buf[5:8])


def call(sa, op, kw):
    if op == SCATTER:
        return sa.scatter_add(kw["input"], kw["index"], kw["src"], weight=kw["weight"], ignore_index=kw["ignore_index"],
                              lnc=kw["lnc"])
    return sa.gather(kw["input"], kw["index"], weight=kw["weight"], ignore_index=kw["ignore_index"])


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_case(sa, case):
    name, kw, op, exc, fragment = case
    kw = kw if kw is not None else src_overlap_case()
    tensor_input = isinstance(kw["input"], torch.Tensor)
    before = bits(kw["input"]) if tensor_input else None
    with pytest.raises(exc, match=re.escape(fragment)):
        call(sa, op, kw)
    if tensor_input:
        assert torch.equal(bits(kw["input"]), before), f"{name}: input changed"


# Edge inputs that are not errors: (id, function returning (ours, expected)).
def edge_k0(sa):
    x = torch.randn(5, 3)
    return sa.index_add(x, torch.tensor([], dtype=torch.long), torch.randn(0, 3)), x


def edge_d0(sa):
    x = torch.randn(5, 0)
    return sa.index_add(x, torch.tensor([4, 0]), torch.randn(2, 0)), x


def edge_n0_k0(sa):
    x = torch.randn(0, 3)
    return sa.index_add(x, torch.tensor([], dtype=torch.int32), torch.randn(0, 3)), x


def edge_nan_inf(sa):
    x = torch.zeros(3, 4)
    src = torch.tensor([[float("nan"), 1, float("inf"), -float("inf")], [1, 1, float("inf"), 1]])
    idx = torch.tensor([1, 1])
    return sa.index_add(x, idx, src), x.index_add(0, idx, src)


def edge_ignore_valid_row(sa):
    x = torch.zeros(3, 2)
    return sa.index_add(x, torch.tensor([0, 1, 2]), torch.ones(3, 2), ignore_index=1), torch.tensor([[1., 1], [0, 0], [1, 1]])


def edge_gather_ignored_rows_zero(sa):
    x = torch.randn(3, 2)
    return sa.gather(x, torch.tensor([2, -1]), ignore_index=-1), torch.stack([x[2], torch.zeros(2)])


def edge_numpy_integers(sa):
    x = torch.zeros(3, 2)
    index = torch.tensor([0, 2, 2, 1])
    ours = sa.scatter_add(x.clone(), index, torch.ones(4, 2), ignore_index=np.int64(1), lnc=np.int32(2))
    return ours, sa.index_add(x, index, torch.ones(4, 2), ignore_index=1)


def edge_weight_dtypes(sa):
    x = torch.zeros(3, 2)
    index = torch.tensor([0, 2, 2])
    w = torch.tensor([0.5, 2.0, 0.25])
    outs = [sa.index_add(x, index, torch.ones(3, 2), weight=w.to(dt))
            for dt in (torch.float32, torch.float64, torch.bfloat16, torch.float16)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    return outs[0], torch.tensor([[0.5, 0.5], [0.0, 0.0], [2.25, 2.25]])


def edge_interleaved_columns(sa):
    b = torch.arange(16.0).view(4, 4)
    expected = b.clone()
    expected[:, ::2].index_add_(0, torch.arange(4), expected[:, 1::2].clone())
    sa.scatter_add(b[:, ::2], torch.arange(4), b[:, 1::2])
    return b, expected


EDGE_CASES = [("empty-k", edge_k0), ("empty-d", edge_d0), ("empty-n-and-k", edge_n0_k0),
              ("nan-inf-propagate", edge_nan_inf), ("ignore-index-equal-to-a-valid-row", edge_ignore_valid_row),
              ("gather-ignored-rows-are-zero", edge_gather_ignored_rows_zero),
              ("numpy-integers-for-ignore-index-and-lnc", edge_numpy_integers), ("weight-dtypes", edge_weight_dtypes),
              ("interleaved-columns", edge_interleaved_columns)]


@pytest.mark.parametrize("case", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_case(sa, case):
    ours, expected = case[1](sa)
    assert ours.shape == expected.shape
    assert torch.equal(ours.isnan(), expected.isnan())
    keep = ~expected.isnan()
    assert torch.equal(ours[keep], expected[keep])


# The rows decided by memory (overlap, an input that aliases itself), each also with autograd
# recording the update: the outcome may not depend on it.
MEMORY_CASES = [c for c in ERROR_CASES if "overlaps" in c[0] or "expanded" in c[0]]


def _with_tracked_input(kw):
    """The same case over new memory laid out as before, with input a view of a non-leaf that
    requires grad (the other arguments that shared input's memory share the new one)."""
    inp = kw["input"]
    storage = inp.untyped_storage().data_ptr()
    flat = torch.zeros(inp.untyped_storage().nbytes() // inp.element_size(), dtype=inp.dtype, requires_grad=True) * 1

    def remake(t, tracked):
        f = flat if tracked else flat.detach().view(t.dtype)
        return f.as_strided(t.shape, t.stride(), t.storage_offset())

    out = dict(kw)
    for k in ("index", "src", "weight"):
        t = kw[k]
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage:
            out[k] = remake(t, False)
    out["input"] = remake(inp, True)
    return out


@pytest.mark.parametrize("grad", ["src", "weight", "input"])
@pytest.mark.parametrize("case", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_memory_errors_do_not_depend_on_requires_grad(sa, case, grad):
    name, kw, op, exc, fragment = case
    kw = kw if kw is not None else src_overlap_case()
    with pytest.raises(exc, match=re.escape(fragment)) as plain:
        call(sa, op, kw)
    kw = dict(kw)
    if grad == "src":
        kw["src"] = kw["src"].detach().requires_grad_()
    elif grad == "weight":
        w = kw["weight"] if kw["weight"] is not None else torch.ones(kw["index"].shape[0], dtype=kw["input"].dtype)
        kw["weight"] = w.detach().requires_grad_()
    else:
        kw = _with_tracked_input(kw)
        assert kw["input"].requires_grad and not kw["input"].is_leaf
    before = bits(kw["input"])
    with pytest.raises(exc) as tracked:
        call(sa, op, kw)
    assert str(tracked.value) == str(plain.value)
    assert torch.equal(bits(kw["input"]), before), f"{name}: input changed"


def test_catalogue_lists_every_case():
    doc = (ROOT / "docs" / "errors.md").read_text()
    for name in [c[0] for c in ERROR_CASES] + [c[0] for c in EDGE_CASES]:
        assert f"`{name}`" in doc, f"docs/errors.md has no row for {name}"


def test_concurrent_python_threads_match_serial(sa):
    g = torch.Generator().manual_seed(1)
    jobs = []
    for i in range(16):
        dt = [torch.float32, torch.bfloat16, torch.float16, torch.float64][i % 4]
        jobs.append((torch.randn(200, 96, generator=g).to(dt), torch.randint(0, 200, (700,), generator=g),
                     torch.randn(700, 96, generator=g).to(dt), torch.rand(700, generator=g)))
    serial = [(bits(sa.index_add(x, i, s, weight=w)), bits(sa.gather(x, i, weight=w))) for x, i, s, w in jobs]
    results = [None] * len(jobs)

    def work(j):
        x, i, s, w = jobs[j]
        for _ in range(5):
            results[j] = (bits(sa.index_add(x, i, s, weight=w)), bits(sa.gather(x, i, weight=w)))

    threads = [threading.Thread(target=work, args=(j,)) for j in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for j, (a, b) in enumerate(results):
        assert torch.equal(a, serial[j][0]) and torch.equal(b, serial[j][1]), j


def test_huge_tensor_offsets_past_2_31(sa):
    """N*D > 2^31 bf16 elements (4.3 GB): rows near the end are written and gathered exactly."""
    d = 32768
    n = (1 << 31) // d + 64
    x = torch.empty(n, d, dtype=torch.bfloat16)
    rows = torch.tensor([n - 1, n - 2, n - 1, 60000])
    x[rows] = 0
    src = (torch.arange(4 * d) % 7 + 1).view(4, d).to(torch.bfloat16)
    sa.scatter_add(x, rows, src, weight=torch.tensor([1.0, 2.0, 3.0, 1.0]))
    s = src.float()
    assert torch.equal(x[n - 1].float(), s[0] + 3 * s[2])
    assert torch.equal(x[n - 2].float(), 2 * s[1])
    assert torch.equal(sa.gather(x, torch.tensor([60000, n - 2])), torch.stack([src[3], (2 * s[1]).to(torch.bfloat16)]))
    del x


@pytest.mark.parametrize("lnc, exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("2", TypeError),
                                      (True, TypeError)])
def test_scatter_add_module_rejects_bad_lnc(sa, lnc, exc):
    with pytest.raises(exc, match="lnc must be a positive int"):
        sa.ScatterAdd(lnc=lnc)


class _KernelRaises(torch.utils._python_dispatch.TorchDispatchMode):
    """Makes our kernels raise `error` (as kernels built on torch's stable ABI report errors: a
    RuntimeError tagged with the exception's name)."""

    def __init__(self, sa, error):
        super().__init__()
        self.ours = {sa.ops.scatter_add_.default, sa.ops.index_add.default, sa.ops.gather.default,
                     sa.ops.scatter_add_plain_.default, sa.ops.index_add_plain.default, sa.ops.gather_plain.default}
        self.error = error

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ours:
            raise self.error
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", [SCATTER, "index_add", GATHER])
@pytest.mark.parametrize("raised, exc, message", [
    (RuntimeError("IndexError: scatter_add: index[1] = 6 is out of range for 6 rows"), IndexError,
     "{op}: index[1] = 6 is out of range for 6 rows"),
    (RuntimeError("scatter_add_cpu, torch_binding.cpp:120, ValueError: index_add: src memory overlaps input"),
     ValueError, "{op}: src memory overlaps input"),
    (RuntimeError("TypeError: gather: weight must be a tensor"), TypeError, "{op}: weight must be a tensor"),
    (IndexError("index_add: index[0] = 9 is out of range"), IndexError, "{op}: index[0] = 9 is out of range"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), RuntimeError,
     "CUDA error: an illegal memory access was encountered"),
])
def test_kernel_errors_become_typed(sa, op, raised, exc, message):
    """A tagged kernel error becomes the exception its tag names, named after the function called;
    an untagged one passes through unchanged."""
    kw = base()
    before = bits(kw["input"])
    with _KernelRaises(sa, raised), pytest.raises(exc) as e:
        if op == "index_add":
            sa.index_add(kw["input"], kw["index"], kw["src"])
        else:
            call(sa, op, kw)
    assert str(e.value) == message.format(op=op)
    assert type(e.value) is exc
    if exc is RuntimeError:
        assert e.value is raised
    assert torch.equal(bits(kw["input"]), before)
