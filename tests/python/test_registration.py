"""Op registration: opcheck on every op, torch.compile(fullgraph=True) against eager, gradcheck in
float64, and the Neuron hub kernel's README calls."""
import pytest
import torch


def args_for(sa, op, weighted, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    inp = torch.randn(12, 10, dtype=torch.float64, generator=g, requires_grad=requires_grad)
    src = torch.randn(20, 10, dtype=torch.float64, generator=g, requires_grad=requires_grad)
    index = torch.randint(0, 12, (20,), generator=g)
    index[3] = -1
    w = torch.rand(20, dtype=torch.float64, generator=g, requires_grad=requires_grad) if weighted else None
    if op == "gather":
        return (inp, index, w, -1)
    if op == "scatter_add_":
        return (inp.detach().clone(), index, src.detach(), None if w is None else w.detach(), -1)
    return (inp, index, src, w, -1)


@pytest.mark.parametrize("op", ["scatter_add_", "index_add", "gather"])
@pytest.mark.parametrize("weighted", [False, True])
def test_opcheck(sa, op, weighted):
    fn = getattr(sa.ops, op)
    torch.library.opcheck(fn, args_for(sa, op, weighted, requires_grad=op != "scatter_add_"))


def test_gradcheck(sa):
    inp, index, src, w, ign = args_for(sa, "index_add", True, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: sa.index_add(a, index, b, weight=c, ignore_index=ign), (inp, src, w))
    assert torch.autograd.gradcheck(lambda a, c: sa.gather(a, index, weight=c, ignore_index=ign), (inp, w))
    assert torch.autograd.gradcheck(lambda a: sa.gather(a, index.clamp(min=0)), (inp,))
    # the in-place form is differentiable through copy_
    def inplace(a, b):
        x = a * 1
        return sa.scatter_add(x, index, b, ignore_index=ign)
    assert torch.autograd.gradcheck(inplace, (inp, src))


def test_torch_compile_fullgraph_matches_eager(sa):
    torch._dynamo.reset()

    def f(x, index, src, w):
        y = sa.index_add(x, index, src, weight=w)
        g = sa.gather(y, index, ignore_index=-1)
        z = torch.zeros_like(x)
        sa.scatter_add(z, index, g * 2, ignore_index=-1)
        return y.sum(1) + z.sum(1)

    # float64 and seeded: inductor may sum the final reductions in another order than eager.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 32, generator=g, dtype=torch.float64)
    index = torch.randint(0, 16, (40,), generator=g)
    src = torch.randn(40, 32, generator=g, dtype=torch.float64)
    w = torch.rand(40, generator=g, dtype=torch.float64)
    eager = f(x, index, src, w)
    compiled = torch.compile(f, fullgraph=True)(x, index, src, w)
    torch.testing.assert_close(compiled, eager)


def test_compile_backward_through_ops(sa):
    torch._dynamo.reset()

    def f(x, src, w, index):
        return (sa.gather(sa.index_add(x, index, src, weight=w), index) ** 2).sum()

    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 16, generator=g, dtype=torch.float64, requires_grad=True)
    src = torch.randn(20, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(20, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 8, (20,), generator=g, dtype=torch.int32)
    ge = torch.autograd.grad(f(x, src, w, index), (x, src, w))
    gc = torch.autograd.grad(torch.compile(f, fullgraph=True)(x, src, w, index), (x, src, w))
    for a, b in zip(ge, gc):
        torch.testing.assert_close(a, b)


def test_hub_kernel_readme_calls(sa):
    """The Neuron hub kernel's own calls, unchanged, at its MoE shape (D=2048, bf16)."""
    torch._dynamo.reset()
    n, k, d = 64, 128, 2048
    input = torch.zeros(n, d, dtype=torch.bfloat16)
    index = torch.randint(0, n, (k,), dtype=torch.int32)
    src = torch.randn(k, d, dtype=torch.bfloat16)
    expected = input.double().index_add(0, index.long(), src.double())

    out = sa.scatter_add(input.clone(), index, src, lnc=2)
    assert (out.double() - expected).abs().max() <= (expected.abs() * 2 ** -8).max()

    layer = sa.ScatterAdd(lnc=2)
    eager = layer(input.clone(), index, src)
    compiled = torch.compile(layer, fullgraph=True)(input.clone(), index, src)
    assert torch.equal(eager, compiled)
    assert torch.equal(eager, out)
