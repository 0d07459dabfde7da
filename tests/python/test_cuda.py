"""The ops on CUDA tensors (scripts/gpu_check.sh runs these on a GPU machine; where torch sees no
CUDA device every test here is skipped with that reason, and tests/cuda/host_sim.cu, run by
`make cuda`, checks the kernels' code on the CPU instead).

The CUDA kernels round exactly as the CPU core does (one sequential fma per contribution in source
order, one rounding), so the checks are bit for bit against the CPU ops: every dtype x index dtype
x weight x ignore_index, the MoE shape, hot rows (small and large D, small and large K), subnormal
data, strided and misaligned views; then determinism, the bad-input catalogue (same exception,
message, input untouched), an expanded input, the three index-check modes (deferred: no wait, the
error at the next call; sync; trap), CUDA graph capture, a side stream, autograd, torch.compile and
offsets past 2^31 elements."""
import re
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from test_errors import ERROR_CASES, bits, call
from test_ops import DTYPES, make_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device: run scripts/gpu_check.sh on a GPU machine")

SHAPES = [(64, 128, 96, "topk"), (7, 300, 33, "random"), (1, 5, 17, "same"), (50, 0, 8, "random"),
          (300, 600, 1, "random"), (4096, 8192, 2048, "topk"),  # the MoE combine shape, top-2
          (16, 256, 520, "same"), (2000, 4000, 64, "random"),
          # hot rows (more than 64 contributions: narrow column tiles): tiny D, wide D, and K past
          # the one-block plan (4096)
          (4, 3000, 8, "same"), (3, 700, 2048, "same"), (16, 9000, 136, "same")]

# SCATTER_ADD_CUDA_CHECK: deferred (default), sync (raise in the call), trap.
CHECK_ENV = "SCATTER_ADD_CUDA_CHECK"


def cuda(t):
    return None if t is None else t.cuda()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["noweight", "weight"])
@pytest.mark.parametrize("ignore", [None, -1, 0], ids=["noignore", "ignore-1", "ignore0"])
def test_cuda_equals_cpu_bitwise(sa, dtype, index_dtype, weighted, ignore):
    for seed, (n, k, d, dup) in enumerate(SHAPES):
        inp, index, src, w = make_case(n, k, d, dtype, index_dtype, "cpu", seed=seed, weighted=weighted,
                                       ignore=ignore, dup=dup)
        cpu = sa.index_add(inp, index, src, weight=w, ignore_index=ignore)
        gpu = sa.index_add(inp.cuda(), index.cuda(), src.cuda(), weight=cuda(w), ignore_index=ignore)
        assert gpu.is_cuda and torch.equal(bits(gpu.cpu()), bits(cpu)), (n, k, d, dup)
        x = inp.cuda()
        assert sa.scatter_add(x, index.cuda(), src.cuda(), weight=cuda(w), ignore_index=ignore) is x
        assert torch.equal(bits(x.cpu()), bits(cpu))
        g_cpu = sa.gather(inp, index, weight=w, ignore_index=ignore)
        g_gpu = sa.gather(inp.cuda(), index.cuda(), weight=cuda(w), ignore_index=ignore)
        assert torch.equal(bits(g_gpu.cpu()), bits(g_cpu)), (n, k, d, dup)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_cuda_strided_and_misaligned_views(sa, dtype):
    g = torch.Generator().manual_seed(5)
    base = torch.randn(40, 2048 + 9, generator=g).to(dtype)
    src_base = torch.randn(100, 2048 + 3, generator=g).to(dtype)
    index = torch.randint(0, 40, (100,), generator=g)
    for cols in (slice(0, 2048), slice(1, 2049), slice(8, 2056)):  # aligned rows, misaligned, padded
        for s in (src_base[:, :2048], src_base[:, 3:2051], src_base[:, :2048].clone()):
            inp = base[:, cols]
            cpu = inp.clone()
            sa.scatter_add(cpu, index, s)
            gbase = base.cuda()
            ginp = gbase[:, cols]
            sa.scatter_add(ginp, index.cuda(), s.cuda())
            assert torch.equal(bits(ginp.cpu()), bits(cpu))
            outside = torch.ones(base.shape[1], dtype=torch.bool)
            outside[cols] = False
            assert torch.equal(bits(gbase[:, outside].cpu()), bits(base[:, outside]))  # untouched
            assert torch.equal(bits(sa.gather(ginp, index.cuda()).cpu()), bits(sa.gather(inp, index)))
    # a column-strided (transposed) input
    t = torch.randn(64, 40, generator=g).to(dtype).t()
    s = torch.randn(100, 64, generator=g).to(dtype)
    cpu = t.clone()
    sa.scatter_add(cpu, index, s)
    gt = t.cuda()
    sa.scatter_add(gt, index.cuda(), s.cuda())
    assert torch.equal(bits(gt.cpu()), bits(cpu))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["noweight", "weight"])
def test_cuda_long_runs(sa, dtype, weighted):
    """Rows of thousands of contributions: bit for bit as on the CPU (hot rows are summed
    sequentially too), within the float64 reference's rounding bound, no worse than torch's own
    error at bf16/fp16, and the same bits on every run."""
    g = torch.Generator().manual_seed(11)
    n, k, d = 64, 20000, 520
    index = torch.randint(0, n, (k,), generator=g)
    index[torch.rand(k, generator=g) < 0.7] = 3      # one row with ~14000 contributions
    index[torch.rand(k, generator=g) < 0.1] = n - 1  # another long run right after it
    index[::97] = -1
    inp = torch.randn(n, d, generator=g).to(dtype)
    src = torch.randn(k, d, generator=g).to(dtype)
    w = torch.rand(k, generator=g) if weighted else None
    gpu = sa.index_add(inp.cuda(), index.cuda(), src.cuda(), weight=cuda(w), ignore_index=-1).cpu()
    cpu = sa.index_add(inp, index, src, weight=w, ignore_index=-1)
    keep = index != -1
    contrib = src.double() * (w.double()[:, None] if weighted else 1)
    ref = inp.double().index_add(0, index[keep], contrib[keep])
    counts = torch.bincount(index[keep], minlength=n)
    short = counts <= 256
    assert torch.equal(bits(gpu[short]), bits(cpu[short]))
    assert torch.equal(bits(gpu), bits(cpu))  # the long rows too: one sequential sum, as on the CPU
    long_rows = (~short).nonzero().flatten()
    assert len(long_rows) >= 2
    mag = inp.double().abs().index_add(0, index[keep], contrib[keep].abs())
    eps_acc = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24
    ulp = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    bound = (counts[:, None] + 2) * eps_acc * mag + ref.abs() * ulp
    err = (gpu.double() - ref).abs()
    assert torch.all(err[long_rows] <= bound[long_rows])
    if dtype in (torch.bfloat16, torch.float16):
        theirs = inp.index_add(0, index[keep], (src * w.to(dtype)[:, None] if weighted else src)[keep])
        assert err[long_rows].max() <= (theirs.double() - ref).abs()[long_rows].max()
    again = sa.index_add(inp.cuda(), index.cuda(), src.cuda(), weight=cuda(w), ignore_index=-1).cpu()
    assert torch.equal(bits(again), bits(gpu))


def test_cuda_deterministic(sa):
    inp, index, src, w = make_case(2048, 32768, 1024, torch.bfloat16, torch.int64, "cuda", seed=3, weighted=True)
    hot = index.clone()
    hot[:20000] = 5
    for idx in (index, hot):
        runs = [bits(sa.index_add(inp, idx, src, weight=w)) for _ in range(4)]
        for r in runs[1:]:
            assert torch.equal(r, runs[0])


def _on_cuda(kw):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


# The catalogue's cases that do not depend on where the tensors live (the device-mismatch and
# memory-overlap cases are built from CPU storage).
CUDA_ERROR_CASES = [c for c in ERROR_CASES if c[1] is not None and c[0] != "device-mismatch" and "overlaps" not in c[0]]


@pytest.mark.parametrize("case", CUDA_ERROR_CASES, ids=[c[0] for c in CUDA_ERROR_CASES])
def test_cuda_error_case(sa, case, monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "sync")  # bad index values raise in the call, as on the CPU
    name, kw, op, exc, fragment = case
    kw = _on_cuda(kw)
    tensor_input = isinstance(kw["input"], torch.Tensor)
    before = bits(kw["input"]) if tensor_input else None
    with pytest.raises(exc, match=re.escape(fragment)):
        call(sa, op, kw)
    if tensor_input:
        assert torch.equal(bits(kw["input"]), before), f"{name}: input changed"


def test_cuda_bad_index_in_a_large_call_writes_nothing(sa, monkeypatch):
    monkeypatch.setenv(CHECK_ENV, "sync")  # raise in the call
    inp, index, src, w = make_case(4096, 8192, 2048, torch.bfloat16, torch.int32, "cuda", seed=4, weighted=True,
                                   dup="topk")
    index[8000] = 4096
    index[7000] = -3
    before = bits(inp)
    with pytest.raises(IndexError, match=r"index\[7000\] = -3 is out of range for 4096 rows"):
        sa.scatter_add(inp, index, src, weight=w)
    assert torch.equal(bits(inp), before)
    with pytest.raises(IndexError, match=r"gather: index\[7000\] = -3"):
        sa.gather(inp, index)


SUBNORMAL_SCALE = {torch.float32: 2.0 ** -136, torch.bfloat16: 2.0 ** -136, torch.float16: 2.0 ** -20,
                   torch.float64: 2.0 ** -1040}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["noweight", "weight"])
def test_cuda_subnormals_equal_cpu_bitwise(sa, dtype, weighted):
    """Data whose sums are subnormal in the storage type: the GPU keeps them (no flush to zero)
    and rounds them as the CPU does, hot rows included."""
    g = torch.Generator().manual_seed(21)
    scale = SUBNORMAL_SCALE[dtype]
    for n, k, d, hot in [(64, 256, 136, False), (8, 2000, 64, True)]:
        inp = (torch.rand(n, d, generator=g, dtype=torch.float64) * 4 - 2).mul(scale).to(dtype)
        src = (torch.rand(k, d, generator=g, dtype=torch.float64) * 4 - 2).mul(scale).to(dtype)
        index = torch.full((k,), 3) if hot else torch.randint(0, n, (k,), generator=g)
        w = (torch.rand(k, generator=g) * 3 - 1.5).to(torch.float64 if dtype == torch.float64 else torch.float32) \
            if weighted else None
        cpu = sa.index_add(inp, index, src, weight=w)
        assert (cpu != 0).any() and (cpu.abs() < torch.finfo(dtype).tiny).any()  # subnormal results exist
        gpu = sa.index_add(inp.cuda(), index.cuda(), src.cuda(), weight=cuda(w))
        assert torch.equal(bits(gpu.cpu()), bits(cpu))
        assert torch.equal(bits(sa.gather(inp.cuda(), index.cuda(), weight=cuda(w)).cpu()),
                           bits(sa.gather(inp, index, weight=w)))


def test_cuda_hot_row_bits_depend_only_on_its_contributions(sa):
    """One more contribution to another row, placed first (every later source moves one sorted
    position), leaves the hot row's bits as they were."""
    g = torch.Generator().manual_seed(23)
    n, k, d = 6, 3000, 72
    index = torch.where(torch.rand(k, generator=g) < 0.8, 3, torch.randint(0, n, (k,), generator=g))
    inp = torch.randn(n, d, generator=g).to(torch.bfloat16).cuda()
    src = torch.randn(k, d, generator=g).to(torch.bfloat16).cuda()
    w = torch.rand(k, generator=g).cuda()
    base = sa.index_add(inp, index.cuda(), src, weight=w)
    for other in (2, 4):
        index2 = torch.cat([torch.tensor([other]), index]).cuda()
        src2 = torch.cat([torch.randn(1, d, generator=g).to(torch.bfloat16).cuda(), src])
        w2 = torch.cat([torch.tensor([0.5]).cuda(), w])
        moved = sa.index_add(inp, index2, src2, weight=w2)
        assert torch.equal(bits(moved[3]), bits(base[3]))
        assert not torch.equal(bits(moved[other]), bits(base[other]))


def test_cuda_expanded_input_is_refused(sa):
    """An expanded (row stride 0) input would have warps race on the same bytes: refused, as on
    the CPU, before anything is written."""
    base = torch.zeros(1, 8, device="cuda")
    x = base.expand(4, 8)
    index = torch.tensor([0, 1, 2], device="cuda")
    with pytest.raises(ValueError, match=r"row stride 0 is smaller than its row length 8 \(rows would alias"):
        sa.scatter_add(x, index, torch.ones(3, 8, device="cuda"))
    assert torch.equal(base, torch.zeros(1, 8, device="cuda"))


def test_cuda_default_mode_does_not_wait(sa, monkeypatch):
    """The default check never waits for the GPU: with the stream busy (a sleep kernel of about a
    second), the call returns while the stream still runs; sync mode returns after it ran."""
    monkeypatch.delenv(CHECK_ENV, raising=False)
    x = torch.zeros(64, 128, device="cuda")
    index = torch.randint(0, 64, (256,), device="cuda")
    src = torch.randn(256, 128, device="cuda")
    sa.scatter_add(x, index, src)  # warm-up (module load, first allocation)
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(2_000_000_000)
    sa.scatter_add(x, index, src)
    assert not stream.query()  # still busy: the call did not wait
    torch.cuda.synchronize()
    monkeypatch.setenv(CHECK_ENV, "sync")
    torch.cuda._sleep(2_000_000_000)
    sa.scatter_add(x, index, src)
    assert stream.query()  # sync mode waited for the stream
    expected = torch.zeros(64, 128, device="cuda")
    for _ in range(3):
        sa.scatter_add(expected, index, src)
    assert torch.equal(x, expected)


def test_cuda_deferred_bad_index_raises_at_the_next_call(sa, monkeypatch):
    """Default mode: a bad index writes nothing and the call returns; once the GPU has run it, the
    next call raises IndexError naming the position and value (and does nothing itself); the
    call after that runs normally."""
    monkeypatch.delenv(CHECK_ENV, raising=False)
    inp, index, src, w = make_case(4096, 8192, 2048, torch.bfloat16, torch.int32, "cuda", seed=4, weighted=True,
                                   dup="topk")
    index[8000] = 4096
    index[7000] = -3
    before = bits(inp)
    sa.scatter_add(inp, index, src, weight=w)  # returns: nothing reported yet
    torch.cuda.synchronize()
    assert torch.equal(bits(inp), before)
    y = torch.zeros(16, 8, device="cuda")
    with pytest.raises(IndexError, match=r"index\[7000\] = -3 is out of range for 4096 rows .*earlier"):
        sa.scatter_add(y, torch.tensor([1, 2], device="cuda"), torch.ones(2, 8, device="cuda"))
    assert torch.equal(y, torch.zeros(16, 8, device="cuda"))  # the reporting call did nothing
    sa.scatter_add(y, torch.tensor([1, 2], device="cuda"), torch.ones(2, 8, device="cuda"))
    assert y.sum().item() == 16
    # gather too
    sa.gather(inp, index)
    torch.cuda.synchronize()
    with pytest.raises(IndexError, match=r"index\[7000\] = -3"):
        sa.gather(inp, torch.tensor([0, 1], device="cuda"))
    assert torch.equal(bits(inp), before)


def test_cuda_index_on_cpu_is_rejected(sa):
    x = torch.zeros(4, 8, device="cuda")
    with pytest.raises(ValueError, match="index is on cpu but input is on cuda"):
        sa.scatter_add(x, torch.tensor([0, 1]), torch.ones(2, 8, device="cuda"))


def test_cuda_check_modes_give_the_same_bits(sa, monkeypatch):
    monkeypatch.delenv("SCATTER_ADD_CUDA_CHECK", raising=False)
    inp, index, src, w = make_case(512, 1024, 2048, torch.bfloat16, torch.int32, "cuda", seed=6, weighted=True,
                                   dup="topk")
    host = bits(sa.index_add(inp, index, src, weight=w))
    monkeypatch.setenv("SCATTER_ADD_CUDA_CHECK", "trap")
    assert torch.equal(bits(sa.index_add(inp, index, src, weight=w)), host)
    monkeypatch.setenv("SCATTER_ADD_CUDA_CHECK", "sync")
    assert torch.equal(bits(sa.index_add(inp, index, src, weight=w)), host)
    monkeypatch.setenv("SCATTER_ADD_CUDA_CHECK", "sometimes")
    with pytest.raises(ValueError, match="SCATTER_ADD_CUDA_CHECK must be 'deferred', 'sync' or 'trap', got 'sometimes'"):
        sa.index_add(inp, index, src, weight=w)


def test_cuda_trap_mode_reports_a_bad_index_on_the_device(tmp_path):
    """No wait in the call; the error surfaces at the next synchronisation (a separate process:
    a device trap leaves the CUDA context unusable)."""
    script = f"""
import os, sys
sys.path.insert(0, {str(ROOT / 'tests' / 'python')!r})
os.environ["SCATTER_ADD_CUDA_CHECK"] = "trap"
import torch
from conftest import load_sa
sa = load_sa()
x = torch.zeros(4, 8, device="cuda")
sa.scatter_add(x, torch.tensor([0, 9], device="cuda"), torch.ones(2, 8, device="cuda"))
print("call returned", flush=True)
try:
    torch.cuda.synchronize()
    print("NO ERROR", flush=True)
except Exception as e:
    print("CUDA error:", type(e).__name__, e, flush=True)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert "call returned" in r.stdout, out
    assert "NO ERROR" not in r.stdout, out
    assert "CUDA error" in r.stdout or r.returncode != 0, out


def test_cuda_graph_capture_and_replay(sa):
    g = torch.Generator().manual_seed(7)
    x0 = torch.randn(1024, 2048, generator=g).to(torch.bfloat16).cuda()
    index = torch.randint(0, 1024, (2048,), generator=g).int().cuda()
    src = torch.randn(2048, 2048, generator=g).to(torch.bfloat16).cuda()
    w = torch.rand(2048, generator=g).cuda()
    x = x0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sa.scatter_add(x.clone(), index, src, weight=w)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sa.scatter_add(x, index, src, weight=w)
    for trial in range(3):
        new_src = torch.randn(2048, 2048, generator=g).to(torch.bfloat16).cuda()
        new_index = torch.randint(0, 1024, (2048,), generator=g).int().cuda()
        x.copy_(x0)
        src.copy_(new_src)
        index.copy_(new_index)
        graph.replay()
        torch.cuda.synchronize()
        expected = sa.index_add(x0, new_index, new_src, weight=w)
        assert torch.equal(bits(x), bits(expected)), trial


def test_cuda_side_stream(sa):
    inp, index, src, w = make_case(1024, 4096, 1024, torch.float16, torch.int64, "cpu", seed=8, weighted=True)
    expected = sa.index_add(inp, index, src, weight=w)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        x = inp.cuda(non_blocking=False)
        y = sa.index_add(x, index.cuda(), src.cuda(), weight=w.cuda())
        z = sa.gather(y, index.cuda())
    s.synchronize()
    assert torch.equal(bits(y.cpu()), bits(expected))
    assert torch.equal(bits(z.cpu()), bits(sa.gather(expected, index)))


def test_cuda_gradcheck(sa):
    g = torch.Generator().manual_seed(0)
    inp = torch.randn(12, 10, dtype=torch.float64, generator=g).cuda().requires_grad_()
    src = torch.randn(20, 10, dtype=torch.float64, generator=g).cuda().requires_grad_()
    w = torch.rand(20, dtype=torch.float64, generator=g).cuda().requires_grad_()
    index = torch.randint(0, 12, (20,), generator=g).cuda()
    index[3] = -1
    assert torch.autograd.gradcheck(lambda a, b, c: sa.index_add(a, index, b, weight=c, ignore_index=-1), (inp, src, w))
    assert torch.autograd.gradcheck(lambda a, c: sa.gather(a, index, weight=c, ignore_index=-1), (inp, w))


def test_cuda_torch_compile_matches_eager(sa):
    torch._dynamo.reset()

    def f(x, index, src, w):
        return sa.index_add(x, index, src, weight=w)

    inp, index, src, w = make_case(512, 1024, 2048, torch.bfloat16, torch.int32, "cuda", seed=9, weighted=True,
                                   dup="topk")
    compiled = torch.compile(f, fullgraph=True)
    assert torch.equal(bits(compiled(inp, index, src, w)), bits(f(inp, index, src, w)))


def test_cuda_offsets_past_2_31(sa):
    """N*D > 2^31 bf16 elements (4.3 GB on the device): rows near the end are written exactly."""
    d = 32768
    n = (1 << 31) // d + 64
    x = torch.zeros(n, d, dtype=torch.bfloat16, device="cuda")
    rows = torch.tensor([n - 1, n - 2, n - 1, 60000], device="cuda")
    src = (torch.arange(4 * d, device="cuda") % 7 + 1).view(4, d).to(torch.bfloat16)
    sa.scatter_add(x, rows, src, weight=torch.tensor([1.0, 2.0, 3.0, 1.0], device="cuda"))
    s = src.float()
    assert torch.equal(x[n - 1].float(), s[0] + 3 * s[2])
    assert torch.equal(x[n - 2].float(), 2 * s[1])
    g = sa.gather(x, torch.tensor([60000, n - 2], device="cuda"))
    assert torch.equal(g, torch.stack([src[3], (2 * s[1]).to(torch.bfloat16)]))
    del x
    torch.cuda.empty_cache()
