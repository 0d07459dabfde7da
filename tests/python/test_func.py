"""torch.func over index_add and gather: grad, vjp, jacrev, jacfwd / jvp, vmap, hessian and
per-sample gradients, each against the same function written with torch's own ops (float64)."""
import re

import pytest
import torch
from torch import func

IGN = -1


def index_add_ref(x, index, src, w, ignore=IGN):
    keep = index != ignore  # no boolean indexing: this reference also runs under vmap
    rows = torch.where(keep, index, torch.zeros((), dtype=index.dtype))
    return x.index_add(0, rows, torch.where(keep[:, None], src * w[:, None], torch.zeros((), dtype=src.dtype)))


def gather_ref(x, index, w, ignore=IGN):
    keep = (index != ignore)[:, None]
    return torch.where(keep, x[index.clamp(min=0)] * w[:, None], torch.zeros((), dtype=x.dtype))


@pytest.fixture
def data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g)
    index = torch.tensor([0, 5, IGN, 2, 0, 5, 3])
    src = torch.randn(7, 5, dtype=torch.float64, generator=g)
    w = torch.rand(7, dtype=torch.float64, generator=g) + 0.5
    return x, index, src, w


def ours(sa):
    return (lambda x, s, w, index: sa.index_add(x, index, s, weight=w, ignore_index=IGN),
            lambda x, w, index: sa.gather(x, index, weight=w, ignore_index=IGN))


def close(a, b):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for p, q in zip(a, b):
            close(p, q)
    else:
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_grad(sa, data):
    x, index, src, w = data
    ia, ga = ours(sa)
    loss = lambda f: (lambda *a: (f(*a) ** 2).sum())  # noqa: E731
    close(func.grad(loss(ia), argnums=(0, 1, 2))(x, src, w, index),
          func.grad(loss(index_add_ref), argnums=(0, 2, 3))(x, index, src, w))
    close(func.grad(loss(ga), argnums=(0, 1))(x, w, index), func.grad(loss(gather_ref), argnums=(0, 2))(x, index, w))


def test_vjp(sa, data):
    x, index, src, w = data
    ia, ga = ours(sa)
    ct = torch.randn(6, 5, dtype=torch.float64)
    out, pull = func.vjp(lambda x, s, w: ia(x, s, w, index), x, src, w)
    ref_out, ref_pull = func.vjp(lambda x, s, w: index_add_ref(x, index, s, w), x, src, w)
    close(out, ref_out)
    close(pull(ct), ref_pull(ct))
    ct = torch.randn(7, 5, dtype=torch.float64)
    out, pull = func.vjp(lambda x, w: ga(x, w, index), x, w)
    ref_out, ref_pull = func.vjp(lambda x, w: gather_ref(x, index, w), x, w)
    close(out, ref_out)
    close(pull(ct), ref_pull(ct))


@pytest.mark.parametrize("mode", ["jacrev", "jacfwd"])
def test_jacobians(sa, data, mode):
    x, index, src, w = data
    ia, ga = ours(sa)
    jac = getattr(func, mode)
    close(jac(ia, argnums=(0, 1, 2))(x, src, w, index),
          jac(lambda x, s, w: index_add_ref(x, index, s, w), argnums=(0, 1, 2))(x, src, w))
    close(jac(ga, argnums=(0, 1))(x, w, index), jac(lambda x, w: gather_ref(x, index, w), argnums=(0, 1))(x, w))


def test_jvp(sa, data):
    x, index, src, w = data
    ia, ga = ours(sa)
    tx, ts, tw = torch.randn_like(x), torch.randn_like(src), torch.randn_like(w)
    close(func.jvp(lambda x, s, w: ia(x, s, w, index), (x, src, w), (tx, ts, tw)),
          func.jvp(lambda x, s, w: index_add_ref(x, index, s, w), (x, src, w), (tx, ts, tw)))
    close(func.jvp(lambda x, w: ga(x, w, index), (x, w), (tx, tw)),
          func.jvp(lambda x, w: gather_ref(x, index, w), (x, w), (tx, tw)))
    # one tangent at a time (the others absent)
    close(func.jvp(lambda s: ia(x, s, w, index), (src,), (ts,)),
          func.jvp(lambda s: index_add_ref(x, index, s, w), (src,), (ts,)))
    close(func.jvp(lambda w: ga(x, w, index), (w,), (tw,)), func.jvp(lambda w: gather_ref(x, index, w), (w,), (tw,)))


def test_forward_ad_dual_tensors(sa, data):
    import torch.autograd.forward_ad as fwAD

    x, index, src, w = data
    t = torch.randn_like(src)
    with fwAD.dual_level():
        out = sa.index_add(x, index, fwAD.make_dual(src, t), weight=w, ignore_index=IGN)
        tangent = fwAD.unpack_dual(out).tangent
    assert tangent is not None
    close(tangent, index_add_ref(torch.zeros_like(x), index, t, w))


@pytest.mark.parametrize("outer", ["jacfwd", "jacrev"])
def test_second_order(sa, data, outer):
    """Nested transforms: the inner level's kernel call must be recorded by the outer level."""
    x, index, src, w = data
    jac = getattr(func, outer)
    f = lambda x, w: (sa.gather(x, index, weight=w, ignore_index=IGN) ** 2).sum()  # noqa: E731
    ref = lambda x, w: (gather_ref(x, index, w) ** 2).sum()  # noqa: E731
    close(jac(func.jacrev(f, argnums=(0, 1)), argnums=(0, 1))(x, w),
          jac(func.jacrev(ref, argnums=(0, 1)), argnums=(0, 1))(x, w))
    f = lambda x, s, w: (sa.index_add(x, index, s, weight=w, ignore_index=IGN) ** 3).sum()  # noqa: E731
    ref = lambda x, s, w: (index_add_ref(x, index, s, w) ** 3).sum()  # noqa: E731
    close(jac(func.jacrev(f, argnums=(0, 1, 2)), argnums=(0, 1, 2))(x, src, w),
          jac(func.jacrev(ref, argnums=(0, 1, 2)), argnums=(0, 1, 2))(x, src, w))


def test_hessian_and_grad_of_grad(sa, data):
    x, index, src, w = data
    f = lambda w: (sa.gather(x, index, weight=w, ignore_index=IGN) ** 2).sum()  # noqa: E731
    ref = lambda w: (gather_ref(x, index, w) ** 2).sum()  # noqa: E731
    h = func.hessian(f)(w)
    assert h.abs().sum() > 0
    close(h, func.hessian(ref)(w))
    close(func.grad(lambda w: func.grad(f)(w)[0])(w), func.grad(lambda w: func.grad(ref)(w)[0])(w))


def test_per_sample_grads(sa, data):
    """vmap over grad: one gradient of src per sample of a batch of inputs."""
    x, index, src, w = data
    batch = torch.randn(4, 6, 5, dtype=torch.float64)
    f = lambda s, xb: (sa.index_add(xb, index, s, weight=w, ignore_index=IGN) ** 3).sum()  # noqa: E731
    ref = lambda s, xb: (index_add_ref(xb, index, s, w) ** 3).sum()  # noqa: E731
    close(func.vmap(func.grad(f), in_dims=(None, 0))(src, batch),
          func.vmap(func.grad(ref), in_dims=(None, 0))(src, batch))


@pytest.mark.parametrize("batched", ["input", "src", "both", "index", "weight"])
def test_vmap(sa, data, batched):
    x, index, src, w = data
    b = 3
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(b, 6, 5, dtype=torch.float64, generator=g) if batched in ("input", "both") else x
    ss = torch.randn(b, 7, 5, dtype=torch.float64, generator=g) if batched in ("src", "both") else src
    idx = torch.randint(-1, 6, (b, 7), generator=g) if batched == "index" else index
    ws = torch.rand(b, 7, dtype=torch.float64, generator=g) if batched == "weight" else w
    dims = tuple(0 if t.dim() == d + 1 else None for t, d in ((xs, 2), (idx, 1), (ss, 2), (ws, 1)))
    got = func.vmap(lambda x, i, s, w: sa.index_add(x, i, s, weight=w, ignore_index=IGN), in_dims=dims)(xs, idx, ss, ws)
    want = func.vmap(index_add_ref, in_dims=dims)(xs, idx, ss, ws)
    close(got, want)
    if batched in ("input", "index", "weight"):
        gdims = (dims[0], dims[1], dims[3])
        got = func.vmap(lambda x, i, w: sa.gather(x, i, weight=w, ignore_index=IGN), in_dims=gdims)(xs, idx, ws)
        close(got, func.vmap(gather_ref, in_dims=gdims)(xs, idx, ws))


def test_vmap_keeps_exact_bits(sa):
    """Folding the batch into the columns changes no bits: each sample equals its own call."""
    g = torch.Generator().manual_seed(12)
    xs = torch.randn(4, 9, 33, generator=g).to(torch.bfloat16)
    ss = torch.randn(4, 50, 33, generator=g).to(torch.bfloat16)
    index = torch.randint(0, 9, (50,), generator=g)
    w = torch.rand(50, generator=g)
    got = func.vmap(lambda x, s: sa.index_add(x, index, s, weight=w))(xs, ss)
    for b in range(4):
        assert torch.equal(got[b], sa.index_add(xs[b], index, ss[b], weight=w))
    got = func.vmap(lambda x: sa.gather(x, index, weight=w))(xs)
    for b in range(4):
        assert torch.equal(got[b], sa.gather(xs[b], index, weight=w))


def test_gradgradcheck_and_forward_mode_gradcheck(sa, data):
    x, index, src, w = data
    args = (x.clone().requires_grad_(), src.clone().requires_grad_(), w.clone().requires_grad_())
    f = lambda x, s, w: sa.index_add(x, index, s, weight=w, ignore_index=IGN)  # noqa: E731
    g = lambda x, w: sa.gather(x, index, weight=w, ignore_index=IGN)  # noqa: E731
    assert torch.autograd.gradgradcheck(f, args)
    assert torch.autograd.gradgradcheck(g, (args[0], args[2]))
    assert torch.autograd.gradcheck(f, args, check_forward_ad=True, check_backward_ad=False, check_undefined_grad=False)
    assert torch.autograd.gradcheck(g, (args[0], args[2]), check_forward_ad=True, check_backward_ad=False,
                                    check_undefined_grad=False)


def scatter_add_ref(x, index, src, w, ignore=IGN):
    return x.copy_(index_add_ref(x, index, src, w, ignore))


def test_scatter_add_forward_mode(sa, data):
    """Forward mode through the in-place update: the tangents of src and weight (and of input)
    reach the result, through the function, the module and dual tensors."""
    import torch.autograd.forward_ad as fwAD

    x, index, src, w = data
    g = torch.Generator().manual_seed(13)
    tx, ts, tw = (torch.randn(t.shape, dtype=t.dtype, generator=g) for t in (x, src, w))
    layer = sa.layers.ScatterAdd(ignore_index=IGN)
    for f in (lambda x, s, w: sa.scatter_add(x.clone(), index, s, weight=w, ignore_index=IGN),
              lambda x, s, w: layer(x.clone(), index, s, weight=w)):
        ref = lambda x, s, w: scatter_add_ref(x.clone(), index, s, w)  # noqa: E731
        close(func.jvp(f, (x, src, w), (tx, ts, tw)), func.jvp(ref, (x, src, w), (tx, ts, tw)))
        close(func.jvp(lambda s: f(x, s, w), (src,), (ts,)), func.jvp(lambda s: ref(x, s, w), (src,), (ts,)))
        close(func.jvp(lambda w: f(x, src, w), (w,), (tw,)), func.jvp(lambda w: ref(x, src, w), (w,), (tw,)))
        close(func.jacfwd(f, argnums=(0, 1, 2))(x, src, w), func.jacrev(ref, argnums=(0, 1, 2))(x, src, w))
    with fwAD.dual_level():
        out = torch.zeros_like(x)
        sa.scatter_add(out, index, fwAD.make_dual(src, ts), weight=fwAD.make_dual(w, tw), ignore_index=IGN)
        tangent = fwAD.unpack_dual(out).tangent
    assert tangent is not None
    close(tangent, index_add_ref(torch.zeros_like(x), index, ts, w) + index_add_ref(torch.zeros_like(x), index, src, tw))
    args = (x.clone().requires_grad_(), src.clone().requires_grad_(), w.clone().requires_grad_())
    f = lambda x, s, w: sa.scatter_add(x * 1, index, s, weight=w, ignore_index=IGN)  # noqa: E731
    assert torch.autograd.gradcheck(f, args, check_forward_ad=True)


def test_vmap_over_an_empty_batch(sa, data):
    """A batch of size 0 gives an empty result of the right shape, as torch's own vmap does; its
    arguments are still checked."""
    x, index, src, w = data
    assert func.vmap(lambda x: x.index_add(0, index.clamp(min=0), src))(torch.zeros(0, 6, 5, dtype=torch.float64)).shape == (0, 6, 5)
    xs, ss = torch.zeros(0, 6, 5, dtype=torch.float64), torch.zeros(0, 7, 5, dtype=torch.float64)
    idx, ws = torch.zeros(0, 7, dtype=torch.long), torch.zeros(0, 7, dtype=torch.float64)
    cases = [((0, None, None, None), (xs, index, src, w)), ((None, None, 0, None), (x, index, ss, w)),
             ((0, None, 0, None), (xs, index, ss, w)), ((None, 0, None, None), (x, idx, src, w)),
             ((None, None, None, 0), (x, index, src, ws)), ((0, 0, 0, 0), (xs, idx, ss, ws))]
    for dims, args in cases:
        got = func.vmap(lambda x, i, s, w: sa.index_add(x, i, s, weight=w, ignore_index=IGN), in_dims=dims)(*args)
        assert (got.shape, got.dtype) == ((0, 6, 5), torch.float64), (dims, got.shape)
        gdims, gargs = (dims[0], dims[1], dims[3]), (args[0], args[1], args[3])
        if gdims == (None, None, None):
            continue  # gather has no src
        got = func.vmap(lambda x, i, w: sa.gather(x, i, weight=w, ignore_index=IGN), in_dims=gdims)(*gargs)
        assert (got.shape, got.dtype) == ((0, 7, 5), torch.float64), (gdims, got.shape)
    with pytest.raises(ValueError, match="^index_add: src has 7 rows but index has 3 entries$"):
        func.vmap(lambda x, i: sa.index_add(x, i, src), in_dims=(None, 0))(x, torch.zeros(0, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=re.escape("gather: weight must be 1-D with 7 entries (one per index), got shape [3]")):
        func.vmap(lambda x, w: sa.gather(x, index, weight=w), in_dims=(None, 0))(x, torch.zeros(0, 3, dtype=torch.float64))


@pytest.mark.parametrize("batched", ["input", "input and src", "input and index", "input and weight", "strided input"])
def test_vmap_over_the_in_place_update(sa, data, batched):
    """vmap over scatter_add updates each sample of a batched input in place, as torch's vmap over
    index_add_ does."""
    x, index, src, w = data
    b = 3
    g = torch.Generator().manual_seed(14)
    xs = torch.randn(b, 6, 5, dtype=torch.float64, generator=g)
    if batched == "strided input":  # the batch cannot be folded into the columns as a view
        xs = torch.randn(6, 5, b, dtype=torch.float64, generator=g).permute(2, 0, 1)
    ss = torch.randn(b, 7, 5, dtype=torch.float64, generator=g) if batched == "input and src" else src
    idx = torch.randint(-1, 6, (b, 7), generator=g) if batched == "input and index" else index
    ws = torch.rand(b, 7, dtype=torch.float64, generator=g) if batched == "input and weight" else w
    dims = tuple(0 if t.dim() == d + 1 else None for t, d in ((xs, 2), (idx, 1), (ss, 2), (ws, 1)))
    want = xs.clone()
    func.vmap(scatter_add_ref, in_dims=dims)(want, idx, ss, ws)
    got = xs.clone() if batched != "strided input" else xs.permute(1, 2, 0).clone().permute(2, 0, 1)
    out = func.vmap(lambda x, i, s, w: sa.scatter_add(x, i, s, weight=w, ignore_index=IGN), in_dims=dims)(got, idx, ss, ws)
    close(got, want)
    close(out, want)
    empty = torch.zeros(0, 6, 5, dtype=torch.float64)
    func.vmap(lambda x: sa.scatter_add(x, index, src, weight=w, ignore_index=IGN))(empty)
    with pytest.raises(ValueError, match="input must be batched"):
        func.vmap(lambda s: sa.scatter_add(x.clone(), index, s), in_dims=0)(torch.zeros(b, 7, 5, dtype=torch.float64))


@pytest.mark.parametrize("op", ["index_add", "scatter_add", "gather"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("d", [1, 3, 64])
def test_weight_gradient_in_chunks_keeps_the_bits(sa, monkeypatch, op, dtype, d):
    """A large weight gradient's row dots run in chunks on the CPU (the last one takes the tail):
    the same bits as taken whole, zero at ignored entries, close to float64."""
    g = torch.Generator().manual_seed(d)
    n, k = 37, 301
    index = torch.randint(0, n, (k,), generator=g)
    index[::7] = IGN
    x = torch.randn(n, d, generator=g).to(dtype)
    src = torch.randn(k, d, generator=g).to(dtype)
    wdt = torch.float32 if dtype == torch.bfloat16 else dtype
    weight = torch.rand(k, generator=g).to(wdt)
    probe = torch.randn(k if op == "gather" else n, d, generator=g).to(dtype)

    def weight_grad():
        w = weight.clone().requires_grad_(True)
        s = src.clone().requires_grad_(True)
        if op == "gather":
            out = sa.gather(x, index, weight=w, ignore_index=IGN)
        elif op == "index_add":
            out = sa.index_add(x, index, s, weight=w, ignore_index=IGN)
        else:
            out = sa.scatter_add(x.clone(), index, s, weight=w, ignore_index=IGN)
        out.backward(probe)
        return w.grad

    autograd = sa._autograd
    dots = []
    row_dot = autograd._row_dot
    monkeypatch.setattr(autograd, "_row_dot", lambda *a: dots.append(a[0].shape[0]) or row_dot(*a))
    whole = weight_grad()
    assert dots == [k]
    dots.clear()
    monkeypatch.setattr(autograd, "ROW_DOT_CHUNK_ELEMS", 8 * d)  # chunks of 8 rows, the tail of 13 last
    chunked = weight_grad()
    assert dots == [8] * 36 + [13]
    assert chunked.dtype == whole.dtype == wdt and chunked.shape == (k,)
    assert torch.equal(chunked, whole)
    assert torch.all(chunked[::7] == 0)
    if op == "gather":
        ref = (x.double()[index.clamp(min=0)] * probe.double()).sum(-1)
    else:
        ref = (probe.double()[index.clamp(min=0)] * src.double()).sum(-1)
    ref[index == IGN] = 0
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(chunked.double(), ref, rtol=tol, atol=tol * d)
