"""In-place semantics of scatter_add, as torch's own index_add_ has them: the version counter bumps
whether or not anything needs grad, an inference tensor is refused outside inference_mode, and a
tensor saved for backward and then modified is caught. Through the Python function, through a
direct torch.ops call, and under torch.compile."""
import pytest
import torch


def calls(sa):
    """The in-place update three ways: (name, fn(x, index, src))."""
    def ops(x, i, s):
        sa.ops.scatter_add_(x, i, s)
        return x

    def compiled(x, i, s):
        return _compiled(sa)(x, i, s)

    return [("scatter_add", lambda x, i, s: sa.scatter_add(x, i, s)), ("torch.ops", ops), ("compiled", compiled)]


_COMPILED = {}


def _compiled(sa):
    if "f" not in _COMPILED:
        _COMPILED["f"] = torch.compile(lambda x, i, s: sa.scatter_add(x, i, s), fullgraph=True, dynamic=True)
    return _COMPILED["f"]


@pytest.fixture(params=["scatter_add", "torch.ops", "compiled"])
def inplace(sa, request):
    return dict(calls(sa))[request.param]


def test_version_counter_bumps_without_grad(inplace):
    x = torch.zeros(4, 3)
    v = x._version
    out = inplace(x, torch.tensor([0, 3]), torch.ones(2, 3))
    assert out is x or torch.equal(out, x)
    assert x._version > v
    assert torch.equal(x[0], torch.ones(3)) and torch.equal(x[1], torch.zeros(3))
    v = x._version
    with torch.no_grad():
        inplace(x, torch.tensor([1]), torch.ones(1, 3))
    assert x._version > v


def test_version_bump_shared_with_views(sa):
    base = torch.zeros(4, 6)
    view = base[:, 2:5]
    v = base._version
    sa.scatter_add(view, torch.tensor([2]), torch.ones(1, 3))
    assert base._version > v and view._version == base._version
    assert base[2].tolist() == [0, 0, 1, 1, 1, 0]


def test_modified_after_save_is_caught(inplace):
    """w's gradient needs x as it was before the update: autograd raises, as for x.index_add_
    (it used to give w.grad [4, 2, 2] instead of [2, 2, 2])."""
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(3, 2)
    y = (w[:, None] * x).sum()
    inplace(x, torch.tensor([0]), torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_torch_reference_behaves_the_same():
    """What the three cases above compare with: torch's own in-place index_add_."""
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(3, 2)
    y = (w[:, None] * x).sum()
    x.index_add_(0, torch.tensor([0]), torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_unmodified_save_still_backpropagates(sa):
    w = torch.ones(3, requires_grad=True)
    x = torch.ones(3, 2)
    y = (w[:, None] * x).sum()
    other = torch.zeros(3, 2)
    sa.scatter_add(other, torch.tensor([0]), torch.ones(1, 2))
    y.backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))


def test_inference_tensor_refused_outside_inference_mode(sa):
    with torch.inference_mode():
        x = torch.zeros(4, 3)
    before = x.clone()
    for name, fn in calls(sa)[:2]:
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            fn(x, torch.tensor([0]), torch.ones(1, 3))
        assert torch.equal(x, before), name
    # torch refuses the same
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        x.index_add_(0, torch.tensor([0]), torch.ones(1, 3))


def test_inference_tensor_accepted_inside_inference_mode(sa):
    with torch.inference_mode():
        x = torch.zeros(4, 3)
        sa.scatter_add(x, torch.tensor([0, 0]), torch.ones(2, 3))
        sa.ops.scatter_add_(x, torch.tensor([1]), torch.ones(1, 3))
    assert x[0].tolist() == [2, 2, 2] and x[1].tolist() == [1, 1, 1]
    normal = torch.zeros(2, 3)
    with torch.inference_mode():
        v = normal._version
        sa.scatter_add(normal, torch.tensor([1]), torch.ones(1, 3))
        assert normal._version > v  # a normal tensor keeps its version counter in inference mode


def test_leaf_requiring_grad_is_refused_as_torch_does(sa):
    x = torch.zeros(4, 3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        sa.scatter_add(x, torch.tensor([0]), torch.ones(1, 3))
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.index_add_(0, torch.tensor([0]), torch.ones(1, 3))


def test_differentiable_in_place_update_bumps_and_tracks(sa):
    src = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    x = torch.zeros(4, 3, dtype=torch.float64)
    v = x._version
    sa.scatter_add(x, torch.tensor([0, 0]), src, weight=torch.tensor([2.0, 3.0], dtype=torch.float64))
    assert x._version > v and x.grad_fn is not None
    x.sum().backward()
    assert torch.equal(src.grad, torch.tensor([[2.0] * 3, [3.0] * 3], dtype=torch.float64))


def test_compiled_in_place_update_matches_eager(sa):
    torch._dynamo.reset()
    _COMPILED.clear()
    g = torch.Generator().manual_seed(5)
    for n, k in [(8, 5), (13, 40), (3, 2)]:
        x = torch.randn(n, 4, generator=g)
        i = torch.randint(0, n, (k,), generator=g)
        s = torch.randn(k, 4, generator=g)
        ref = x.clone()
        sa.scatter_add(ref, i, s)
        v = x._version
        _compiled(sa)(x, i, s)
        assert torch.equal(x, ref) and x._version > v


def test_direct_op_refuses_a_leaf_requiring_grad(sa):
    """torch.ops.scatter_add_ refuses a leaf that requires grad (or a view of one) as torch's own
    in-place ops do, before anything is written; under no_grad it updates it."""
    x = torch.zeros(4, 3, requires_grad=True)
    for target in (x, x[1:], x[:, :2]):
        with pytest.raises(RuntimeError, match="leaf Variable that requires grad is being used in an in-place"):
            sa.ops.scatter_add_(target, torch.tensor([0]), torch.ones(1, target.shape[1]))
        assert torch.equal(x.detach(), torch.zeros(4, 3))
    with torch.no_grad():
        sa.ops.scatter_add_(x, torch.tensor([0]), torch.ones(1, 3))
    assert x.detach()[0].tolist() == [1, 1, 1]


def test_direct_op_on_a_non_leaf_records_the_gradients(sa):
    """torch.ops.scatter_add_ on a tensor that autograd records: the gradients of input, src and
    weight are those of torch's index_add_, none dropped."""
    index = torch.tensor([0, 3, 0, 2])
    results = []
    for fn in ("ours", "torch"):
        base = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        src = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
        w = torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(3), requires_grad=True)
        x = base * 2
        if fn == "ours":
            sa.ops.scatter_add_(x, index, src, w)
        else:
            x.index_add_(0, index, src * w[:, None])
        assert x.grad_fn is not None
        (x * torch.arange(12.0, dtype=torch.float64).view(4, 3)).sum().backward()
        results.append((x.detach(), base.grad, src.grad, w.grad))
    for a, b in zip(*results):
        assert b is not None and a is not None
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_inference_tensor_with_src_requiring_grad_is_untouched(sa):
    """An inference tensor given a src or weight that requires grad: refused as before, and the
    input is untouched."""
    with torch.inference_mode():
        x = torch.zeros(4, 3)
    for kw in ({"src": torch.ones(1, 3, requires_grad=True)},
               {"src": torch.ones(1, 3), "weight": torch.ones(1, requires_grad=True)}):
        for fn in (lambda: sa.scatter_add(x, torch.tensor([0]), kw["src"], weight=kw.get("weight")),
                   lambda: sa.ops.scatter_add_(x, torch.tensor([0]), kw["src"], kw.get("weight"))):
            with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
                fn()
            assert torch.equal(x, torch.zeros(4, 3))


def test_traced_graphs_keep_autograd_and_the_version_bump(sa):
    """make_fx and torch.jit.trace of calls whose inputs need no grad record the ops that keep
    their autograd and in-place kernels: a replayed graph still differentiates, bumps the version
    counter and so lets autograd catch a saved tensor modified in place."""
    from torch.fx.experimental.proxy_tensor import make_fx

    n, k, d = 5, 7, 3
    x, idx, src = torch.randn(n, d), torch.tensor([0, 2, 2, 4, 1, 0, 3]), torch.randn(k, d)

    def update(a, i, s):
        sa.scatter_add(a, i, s)
        return a

    g = make_fx(update)(x.clone(), idx, src)
    a = torch.randn(n, d, requires_grad=True)
    b = a.exp()  # exp saves its output for backward
    before = b._version
    with torch.no_grad():
        g(b, idx, src)
    assert b._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        b.sum().backward()

    s = src.clone().requires_grad_(True)
    h = make_fx(lambda a, i, s: sa.index_add(a, i, s))(x, idx, src)
    h(x, idx, s).sum().backward()
    assert s.grad is not None and torch.equal(s.grad, torch.ones_like(src))

    w = torch.rand(k)
    gx = x.clone().requires_grad_(True)
    tr = torch.jit.trace(lambda a, i, w: sa.gather(a, i, weight=w), (x, idx, w))
    tr(gx, idx, w).sum().backward()
    assert gx.grad is not None and torch.allclose(gx.grad, torch.zeros(n, d).index_add_(0, idx, w[:, None].expand(k, d)))


@pytest.mark.parametrize("op", ["gather", "index_add"])
def test_unweighted_backward_needs_no_value_of_its_operand(sa, op):
    """An unweighted gather's input, or index_add's src, changed in place after the call: the
    backward needs no value of it, so it runs (as torch's index_select / index_add backwards do,
    and transformers' eager experts around ours) and gives the gradient; weighted, the weight's
    gradient needs it, and autograd raises as it does for torch."""
    index = torch.tensor([2, 0, 2])
    g = torch.arange(6.0).reshape(3, 2)
    for weighted in (False, True):
        leaf = torch.ones(3, 2, requires_grad=True)
        w = torch.tensor([1.0, 2.0, 3.0], requires_grad=True) if weighted else None
        x = leaf * 1  # not a leaf: may change in place
        if op == "gather":
            out, ref = sa.gather(x, index, weight=w), torch.index_select(x, 0, index)
        else:
            out, ref = sa.index_add(torch.zeros(3, 2), index, x, weight=w), torch.zeros(3, 2).index_add(0, index, x)
        ref.backward(g, retain_graph=True)
        want, leaf.grad = leaf.grad, None
        x.add_(1)
        if weighted:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                out.backward(g)
            continue
        out.backward(g)
        assert torch.equal(leaf.grad, want)
