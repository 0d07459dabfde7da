"""Dynamic shapes: the fake kernels are symbolic, so torch.compile(dynamic=True) and torch.export
with dynamic K and N trace once for every size; the fakes raise what the real kernels raise."""
import re

import pytest
import torch
import torch._dynamo.testing
from torch.export import Dim, export
from torch.fx.experimental.proxy_tensor import make_fx
from torch._subclasses.fake_tensor import FakeTensorMode

from test_errors import ERROR_CASES, bits, call


def counter(backend="inductor"):
    torch._dynamo.reset()
    return torch._dynamo.testing.CompileCounterWithBackend(backend)


def test_compile_k_sweep(sa):
    """19 sizes of K under the default recompile limit (it used to fail after 8), and no more
    graphs than torch's own index_add needs (a second one when the first K equals D: duck
    sizing)."""
    ours, theirs = counter(), counter()
    f = torch.compile(lambda o, i, s: sa.index_add(o, i, s), fullgraph=True, dynamic=True, backend=ours)
    g = torch.compile(lambda o, i, s: o.index_add(0, i, s), fullgraph=True, dynamic=True, backend=theirs)
    gen = torch.Generator().manual_seed(0)
    sizes = list(range(4, 60, 3))
    assert len(sizes) >= 15
    for k in sizes:
        o, i, s = torch.zeros(8, 4), torch.randint(0, 8, (k,), generator=gen), torch.randn(k, 4, generator=gen)
        assert torch.equal(f(o, i, s), sa.index_add(o, i, s))
        g(o, i, s)
    assert ours.frame_count <= max(theirs.frame_count, 2), (ours.frame_count, theirs.frame_count)


def test_compile_one_graph_for_every_n_and_k(sa):
    """gather, scatter_add and index_add in one function, 16 (N, K) pairs: one graph, eager bits
    (sizes 0 and 1 left out: torch specialises on them)."""
    cnt = counter()

    def f(x, index, src, w):
        y = sa.gather(x, index, weight=w, ignore_index=-1)
        z = sa.index_add(x, index, y * src, ignore_index=-1)
        sa.scatter_add(x, index, src, weight=w, ignore_index=-1)
        return z

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend=cnt)
    gen = torch.Generator().manual_seed(1)
    pairs = [(9, 7), (17, 31), (40, 3), (5, 60), (100, 2), (3, 17), (64, 128), (10, 11), (11, 13), (12, 14),
             (13, 15), (20, 21), (30, 33), (31, 35), (33, 40), (50, 8)]
    for n, k in pairs:
        x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
        index = torch.randint(-1, n, (k,), generator=gen)
        src = torch.randn(k, 6, generator=gen, dtype=torch.float64)
        w = torch.rand(k, generator=gen, dtype=torch.float64)
        x_eager, x_comp = x.clone(), x.clone()
        z_eager = f(x_eager, index, src, w)
        z_comp = cf(x_comp, index, src, w)
        assert torch.equal(bits(z_comp), bits(z_eager)), (n, k)
        assert torch.equal(bits(x_comp), bits(x_eager)), (n, k)
    assert cnt.frame_count == 1


def test_compile_backward_with_dynamic_k(sa):
    cnt = counter("aot_eager")

    def f(x, src, w, index):
        return (sa.gather(sa.index_add(x, index, src, weight=w), index) ** 2).sum()

    cf = torch.compile(f, fullgraph=True, dynamic=True, backend=cnt)
    gen = torch.Generator().manual_seed(2)
    for k in [5, 9, 14, 23, 40]:
        x = torch.randn(8, 3, dtype=torch.float64, generator=gen, requires_grad=True)
        src = torch.randn(k, 3, dtype=torch.float64, generator=gen, requires_grad=True)
        w = torch.rand(k, dtype=torch.float64, generator=gen, requires_grad=True)
        index = torch.randint(0, 8, (k,), generator=gen)
        ge = torch.autograd.grad(f(x, src, w, index), (x, src, w))
        gc = torch.autograd.grad(cf(x, src, w, index), (x, src, w))
        for a, b in zip(ge, gc):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert cnt.frame_count == 1


class _Combine(torch.nn.Module):
    def __init__(self, sa):
        super().__init__()
        self.sa = sa

    def forward(self, x, index, src, w):
        out = self.sa.index_add(x, index, src, weight=w)
        return out, self.sa.gather(out, index)


def test_export_with_dynamic_k_and_n(sa):
    gen = torch.Generator().manual_seed(3)

    def args(n, k):
        return (torch.randn(n, 4, generator=gen), torch.randint(0, n, (k,), generator=gen),
                torch.randn(k, 4, generator=gen), torch.rand(k, generator=gen))

    K, N = Dim("K"), Dim("N")
    ep = export(_Combine(sa), args(8, 10), dynamic_shapes=({0: N}, {0: K}, {0: K}, {0: K}))
    shapes = [node.meta["val"].shape for node in ep.graph.nodes if node.op == "placeholder"]
    assert all(isinstance(s[0], torch.SymInt) for s in shapes), shapes
    m = ep.module()
    for n, k in [(5, 3), (50, 300), (9, 17), (2, 1), (100, 40)]:
        a = args(n, k)
        out, g = m(*a)
        ref = _Combine(sa)(*a)
        assert torch.equal(out, ref[0]) and torch.equal(g, ref[1])


def test_fakes_are_symbolic(sa):
    def f(x, index, src):
        return sa.gather(sa.index_add(x, index, src), index)

    gm = make_fx(f, tracing_mode="symbolic")(torch.randn(8, 4), torch.randint(0, 8, (10,)), torch.randn(10, 4))
    x, index, src = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
    out = (out[0] if isinstance(out, (list, tuple)) else out).meta["val"]
    assert all(isinstance(s, torch.SymInt) for s in out.shape)  # no size was read as a number
    assert str(out.shape[0]) == str(index.shape[0]) and str(out.shape[1]) == str(x.shape[1])


def test_fake_output_metadata_matches_real(sa):
    x = torch.randn(8, 6)[:, 1:5]  # row-strided input: the real kernel returns a contiguous tensor
    index = torch.randint(0, 8, (10,))
    src = torch.randn(10, 4)
    real = (sa.index_add(x, index, src), sa.gather(x, index))
    meta = (sa.index_add(x.to("meta"), index.to("meta"), src.to("meta")), sa.gather(x.to("meta"), index.to("meta")))
    for r, m in zip(real, meta):
        assert (m.shape, m.stride(), m.dtype, m.device.type) == (r.shape, r.stride(), r.dtype, "meta")


# Error rows decided by shapes, dtypes and argument types: the meta (fake) kernels must raise
# exactly what the real ones raise. Rows that depend on data or memory (index values, overlap, an
# input whose elements alias) or on two devices are left out.
SHAPE_CASES = [c for c in ERROR_CASES if c[1] is not None and c[3] is not IndexError
               and "overlaps" not in c[0] and "expanded" not in c[0] and c[0] != "device-mismatch"]


def _to(kw, device):
    return {k: v.detach().to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


@pytest.mark.parametrize("case", SHAPE_CASES, ids=[c[0] for c in SHAPE_CASES])
def test_fake_raises_what_the_kernel_raises(sa, case):
    name, kw, op, exc, fragment = case
    with pytest.raises(exc, match=re.escape(fragment)) as real:
        call(sa, op, _to(kw, "cpu"))
    with pytest.raises(exc) as meta:
        call(sa, op, _to(kw, "meta"))
    assert str(meta.value) == str(real.value)
    real_kw = _to(kw, "cpu")
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in real_kw.items()}
        with pytest.raises(exc) as faked:
            call(sa, op, fake)
    assert str(faked.value) == str(real.value)


def test_direct_op_on_meta_raises_tagged_runtime_error(sa):
    """torch.ops calls skip the Python translation: RuntimeError '<Kind>: <op>: <what>'."""
    with pytest.raises(RuntimeError, match=r"^ValueError: index_add: src has 3 rows but index has 2 entries$"):
        sa.ops.index_add(torch.zeros(8, 4, device="meta"), torch.zeros(2, dtype=torch.long, device="meta"),
                         torch.zeros(3, 4, device="meta"))
    with pytest.raises(RuntimeError, match=r"^ValueError: gather: index must be int32 or int64, got Float$"):
        sa.ops.gather(torch.zeros(8, 4, device="meta"), torch.zeros(2, device="meta"))


def test_compiled_graph_errors(sa):
    """At trace time a shape error surfaces as torch's TorchRuntimeError (a RuntimeError) carrying
    the tagged message; at run time a bad index value is raised by the kernel itself."""
    torch._dynamo.reset()
    f = torch.compile(lambda o, i, s: sa.index_add(o, i, s), fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match=re.escape("ValueError: index_add: src has 3 rows but index has 2 entries")):
        f(torch.zeros(8, 4), torch.tensor([0, 1]), torch.randn(3, 4))
    torch._dynamo.reset()
    f(torch.zeros(8, 4), torch.tensor([0, 1]), torch.randn(2, 4))
    x = torch.zeros(8, 4)
    with pytest.raises((IndexError, RuntimeError), match=re.escape("index[1] = 9 is out of range for 8 rows")) as e:
        f(x, torch.tensor([0, 9]), torch.randn(2, 4))
    if type(e.value) is not IndexError:
        assert re.search(r"(^|, )IndexError: \w+: index\[1\] = 9", str(e.value)), str(e.value)
    assert torch.equal(x, torch.zeros(8, 4))
