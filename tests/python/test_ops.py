"""Correctness of scatter_add / index_add / gather against torch computed in float64, every
dtype x index dtype x weight x ignore_index, non-contiguous views, determinism, and bad input
(the right exception, a message naming the argument, and input left bit-for-bit untouched)."""
import itertools

import pytest
import torch

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-12, 1e-12)}


def make_case(n, k, d, dtype, index_dtype, device, *, seed=0, weighted=False, ignore=None, dup="random"):
    g = torch.Generator().manual_seed(seed)
    inp = torch.randn(n, d, generator=g).to(dtype).to(device)
    src = torch.randn(k, d, generator=g).to(dtype).to(device)
    if dup == "topk":  # every token twice, expert-sorted order
        index = torch.arange(k) % n
        index = index[torch.randperm(k, generator=g)]
    elif dup == "same":
        index = torch.full((k,), n // 2)
    else:
        index = torch.randint(0, n, (k,), generator=g)
    if ignore is not None:
        index[::3] = ignore
    weight = torch.rand(k, generator=g).to(device) if weighted else None
    return inp, index.to(index_dtype).to(device), src, weight


def reference(inp, index, src, weight=None, ignore=None):
    keep = torch.ones_like(index, dtype=torch.bool) if ignore is None else index != ignore
    contrib = src.double()
    if weight is not None:
        contrib = contrib * weight.double()[:, None]
    return inp.double().index_add(0, index[keep].long(), contrib[keep])


def torch_same_dtype(inp, index, src, weight=None, ignore=None):
    """What a user would write in torch at the op's own precision."""
    keep = torch.ones_like(index, dtype=torch.bool) if ignore is None else index != ignore
    contrib = src if weight is None else src * weight.to(src.dtype)[:, None]
    return inp.index_add(0, index[keep].long(), contrib[keep])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["noweight", "weight"])
@pytest.mark.parametrize("ignore", [None, -1, 0], ids=["noignore", "ignore-1", "ignore0"])
def test_index_add_matches_float64_reference(sa, device, dtype, index_dtype, weighted, ignore):
    for seed, (n, k, d, dup) in enumerate([(64, 128, 96, "topk"), (7, 300, 33, "random"), (1, 5, 17, "same"),
                                           (50, 0, 8, "random"), (300, 600, 1, "random")]):
        inp, index, src, weight = make_case(n, k, d, dtype, index_dtype, device, seed=seed, weighted=weighted,
                                            ignore=ignore, dup=dup)
        ref = reference(inp, index, src, weight, ignore)
        ours = sa.index_add(inp, index, src, weight=weight, ignore_index=ignore)
        assert ours.dtype == dtype and ours.shape == inp.shape
        err = (ours.double() - ref).abs().max().item() if ours.numel() else 0.0
        if dtype in TOL:
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(ours.double(), ref, atol=atol * max(1, k), rtol=rtol)
        else:
            # bf16/fp16: no worse than torch's own error at the same dtype.
            theirs = torch_same_dtype(inp, index, src, weight, ignore)
            torch_err = (theirs.double() - ref).abs().max().item() if ours.numel() else 0.0
            assert err <= torch_err + 1e-12, (err, torch_err, n, k, d)
        # The in-place form gives the same bits and returns input.
        inp2 = inp.clone()
        ret = sa.scatter_add(inp2, index, src, weight=weight, ignore_index=ignore)
        assert ret is inp2
        assert torch.equal(inp2, ours)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bf16_like_dtypes_accumulate_in_float32(sa, dtype):
    # 256 + 256 * 1: exact in every dtype; a low-precision running sum stalls at 256 (bf16).
    inp = torch.full((1, 4), 256.0, dtype=dtype)
    src = torch.ones(256, 4, dtype=dtype)
    out = sa.index_add(inp, torch.zeros(256, dtype=torch.int32), src)
    assert torch.all(out == 512)


def test_gather_matches_indexing(sa, device):
    for dtype, index_dtype in itertools.product(DTYPES, [torch.int32, torch.int64]):
        x = torch.randn(20, 37).to(dtype).to(device)
        index = torch.randint(0, 20, (50,)).to(index_dtype).to(device)
        assert torch.equal(sa.gather(x, index), x[index.long()])
        w = torch.rand(50, device=device)
        torch.testing.assert_close(sa.gather(x, index, weight=w).double(),
                                   (x.double() * 1)[index.long()] * w.double()[:, None],
                                   atol=1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6, rtol=1e-2)
        index[5] = -1
        g = sa.gather(x, index, ignore_index=-1)
        assert torch.all(g[5] == 0)
        keep = index != -1
        assert torch.equal(g[keep], x[index[keep].long()])


def test_non_contiguous_views(sa):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(40, 64, generator=g)
    inp = base[:, 8:40]                 # row stride 64 > D = 32
    src_t = torch.randn(32, 50, generator=g).t()  # [50, 32] with column stride 50
    index = torch.randint(0, 40, (100,), generator=g)[::2]  # non-contiguous index of 50
    ref = reference(inp, index, src_t)
    before = base.clone()
    sa.scatter_add(inp, index, src_t)
    torch.testing.assert_close(inp.double(), ref, atol=1e-5, rtol=1e-5)
    # columns outside the view are untouched
    assert torch.equal(base[:, :8], before[:, :8]) and torch.equal(base[:, 40:], before[:, 40:])
    # a transposed (column-strided) input is updated correctly too
    inp_t = torch.randn(32, 40, generator=g).t()
    ref_t = reference(inp_t, index, src_t)
    sa.scatter_add(inp_t, index, src_t)
    torch.testing.assert_close(inp_t.double(), ref_t, atol=1e-5, rtol=1e-5)
    # gather from a strided view
    assert torch.equal(sa.gather(inp, index), inp[index])


def bits(t):
    return t.contiguous().view(torch.uint8).clone() if t.numel() else t.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_deterministic_across_threads_and_runs(sa, dtype):
    inp, index, src, weight = make_case(500, 4000, 257, dtype, torch.int64, "cpu", seed=9, weighted=True)
    hot = index.clone()
    hot[: 3000] = 7  # a hot row split across threads by columns
    saved = torch.get_num_threads()
    try:
        for idx in (index, hot):
            results = []
            for threads in (1, 2, 1, 2):
                torch.set_num_threads(threads)
                results.append(bits(sa.index_add(inp, idx, src, weight=weight)))
            for r in results[1:]:
                assert torch.equal(r, results[0])
    finally:
        torch.set_num_threads(saved)


def test_empty_and_edge_shapes(sa):
    inp = torch.randn(5, 0)
    assert sa.index_add(inp, torch.tensor([1, 2]), torch.randn(2, 0)).shape == (5, 0)
    inp = torch.randn(5, 3)
    assert torch.equal(sa.index_add(inp, torch.tensor([], dtype=torch.long), torch.randn(0, 3)), inp)
    assert sa.gather(inp, torch.tensor([], dtype=torch.int32)).shape == (0, 3)


# Property test: random shapes, strides, dtypes, index dtypes, weights and ignore_index.
from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 40), k=st.integers(0, 120), d=st.integers(0, 70), pad=st.integers(0, 5),
       dtype=st.sampled_from(DTYPES), index_dtype=st.sampled_from([torch.int32, torch.int64]),
       weighted=st.booleans(), ignore=st.sampled_from([None, -1, 0]), seed=st.integers(0, 2**31 - 1))
def test_property_index_add_and_gather(sa, n, k, d, pad, dtype, index_dtype, weighted, ignore, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d + pad, generator=g).to(dtype)
    inp = base[:, :d]  # row stride d + pad
    src = torch.randn(k, d, generator=g).to(dtype)
    index = torch.randint(0, n, (k,), generator=g)
    if ignore is not None and k:
        index[torch.rand(k, generator=g) < 0.3] = ignore
    index = index.to(index_dtype)
    weight = torch.rand(k, generator=g) if weighted else None
    ref = reference(inp, index, src, weight, ignore)
    ours = sa.index_add(inp, index, src, weight=weight, ignore_index=ignore)
    mag = reference(inp.abs(), index, src.abs(), None if weight is None else weight.abs(), ignore)
    eps = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    acc = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    bound = eps * ref.abs() + 2 * (k + 1) * acc * mag + 1e-30
    assert bool(((ours.double() - ref).abs() <= bound).all())
    g_ours = sa.gather(inp, index, ignore_index=ignore)
    keep = torch.ones(k, dtype=torch.bool) if ignore is None else index != ignore
    assert torch.equal(g_ours[keep], inp[index[keep].long()])
    assert bool((g_ours[~keep] == 0).all())


def test_scatter_add_module_settings(sa):
    import numpy as np

    assert repr(sa.ScatterAdd(lnc=2)) == "ScatterAdd(lnc=2, ignore_index=None)"
    layer = sa.ScatterAdd(lnc=np.int32(2), ignore_index=np.int64(-1))
    assert repr(layer) == "ScatterAdd(lnc=2, ignore_index=-1)"
    assert type(layer.lnc) is int and type(layer.ignore_index) is int
    out = layer(torch.zeros(3, 2), torch.tensor([0, -1, 2, 0]), torch.ones(4, 2), torch.tensor([1.0, 5.0, 2.0, 3.0]))
    assert torch.equal(out, torch.tensor([[4.0, 4.0], [0.0, 0.0], [2.0, 2.0]]))
    with pytest.raises(TypeError, match="ScatterAdd: ignore_index must be an int or None, got 0.5"):
        sa.ScatterAdd(ignore_index=0.5)
    with pytest.raises(ValueError, match=r"ScatterAdd: ignore_index must be in the int64 range"):
        sa.ScatterAdd(ignore_index=-(2**63) - 1)
    assert "ignore_index" in sa.ScatterAdd.__doc__


_STRATEGY_CODE = """
import hashlib, sys, torch
sys.path.insert(0, 'tests/python')
from conftest import load_sa
sa = load_sa()
g = torch.Generator().manual_seed(5)
digest = hashlib.sha256()
for n, k, d, dtype in [(7, 300, 1, torch.float32), (300, 40, 8, torch.bfloat16), (50, 900, 33, torch.float16),
                       (64, 128, 64, torch.float64), (1000, 100000, 1, torch.float32)]:
    index = torch.randint(0, n, (k,), generator=g)
    index[::5] = -1
    src = torch.randn(k, d, generator=g).to(dtype)
    weight = torch.rand(k, generator=g)
    out = torch.randn(n, d, generator=g).to(dtype)
    before = out.clone()
    x = torch.randn(n, d, generator=g).to(dtype)
    calls = [lambda: sa.scatter_add(out, index.int(), src, weight=weight, ignore_index=-1),
             lambda: sa.index_add(before, index, src, ignore_index=-1),
             lambda: sa.gather(x, index.int(), weight=weight, ignore_index=-1),
             lambda: sa.gather(x, index, ignore_index=-1)]
    errors = []
    for call in calls:
        try:
            digest.update(call().contiguous().view(torch.uint8).numpy().tobytes())
        except ValueError as e:
            errors.append(str(e))
    if errors:
        assert len(errors) == len(calls), errors
        assert torch.equal(out.view(torch.uint8), before.view(torch.uint8))
        print("errors", " | ".join(errors))
        sys.exit(0)
print("bits", digest.hexdigest())
"""


def test_strategy_from_the_environment_reaches_every_op(sa):
    """SCATTER_ADD_CPU_STRATEGY through the binding: each strategy gives the unforced bits for
    scatter_add, index_add and gather (weighted, ignore_index, every dtype); an unknown name is a
    ValueError naming the variable, with out untouched."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    seen = {}
    for value in ("", "direct", "count", "radix", "bogus"):
        env = dict(os.environ, SCATTER_ADD_CPU_STRATEGY=value)
        r = subprocess.run([sys.executable, "-c", _STRATEGY_CODE], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, (value, r.stderr[-2000:])
        seen[value] = r.stdout.strip().splitlines()[-1]
    errors = seen["bogus"].removeprefix("errors ").split(" | ")
    assert len(errors) == 4 and all("SCATTER_ADD_CPU_STRATEGY='bogus'" in e for e in errors), seen["bogus"]
    assert seen[""].startswith("bits "), seen[""]
    for value in ("direct", "count", "radix"):
        assert seen[value] == seen[""], value
