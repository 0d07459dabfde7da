"""scatter_add.moe as transformers' experts implementation: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE,
DeepSeek-V3 and GPT-OSS built from tiny configs (no network), against the models' own eager
experts loop: logits, every gradient, bf16 error against float64, bitwise results across thread
counts, greedy generation, torch.compile, expert-parallel sentinels, the decorator's other flags
(no gate, post-expert norm) and bad input."""
import copy
import functools
import os
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

tf = pytest.importorskip("transformers")

from conftest import ROOT  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)

MODELS = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=40)),
    # Qwen3-MoE's real shape has many small experts and top-8: 16 experts, top-4 here.
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=48, moe_intermediate_size=24, num_experts=16,
                                         num_experts_per_tok=4, head_dim=8)),
    "olmoe": ("OlmoeConfig", dict(intermediate_size=24, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=24,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                             first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                             n_shared_experts=1)),
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, head_dim=8,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=16)),
}


@pytest.fixture(scope="module")
def name(sa):
    """Registers our experts function under a test name through a counting wrapper, so every test
    also proves that transformers actually called it."""
    calls = {"n": 0}

    def counted(*args, **kwargs):
        calls["n"] += 1
        return sa.moe.experts_forward(*args, **kwargs)

    from transformers.integrations.moe import ExpertsInterface

    assert sa.moe.register() == "scatter_add"
    ExpertsInterface.register("scatter_add_counted", counted)
    counted.calls = calls
    return "scatter_add_counted"


def calls(name):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ALL_EXPERTS_FUNCTIONS[name].calls["n"]


def randomize(module, seed):
    """Every parameter drawn from a seeded normal (norm scales around 1, biases included), so that
    biases, routers and every expert take part and the output is not near zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in module.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in pname and p.dim() == 1:
                p.copy_(1 + 0.1 * r)
            else:
                p.copy_(0.2 * r)


def build(model, dtype=torch.float32, seed=0, wide=False):
    """wide: hidden 512 and 16x the intermediate sizes, big enough for the products and the
    dispatch/combine to split their work over threads."""
    cls_name, extra = MODELS[model]
    kw = {**COMMON, **extra}
    if wide:
        kw["hidden_size"] = 512
        for k in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
            if k in kw:
                kw[k] *= 16
    cfg = getattr(tf, cls_name)(**kw)
    torch.manual_seed(seed)
    m = tf.AutoModelForCausalLM.from_config(cfg)
    randomize(m, seed)
    m.set_experts_implementation("eager")
    return m.to(dtype).eval()


def with_impl(m, impl):
    m2 = copy.deepcopy(m)
    m2.set_experts_implementation(impl)
    return m2


def experts_modules(m):
    return [mod for mod in m.modules() if hasattr(mod, "has_gate") and hasattr(mod, "down_proj")]


def tokens(n=11, batch=2, seed=1):
    return torch.randint(3, COMMON["vocab_size"], (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(params=[False, True], ids=["plain_forms", "amx_forms_loop_backward"])
def forms(sa, monkeypatch, request):
    """The forward's product forms of a CPU without AMX and of one with it, on any CPU (moe._AMX:
    the forms differ, the results agree to rounding); with the second, the training backward
    block by block instead of by torch's grouped products (moe._GROUPED_BACKWARD), so that either
    backward runs under every test that takes this fixture."""
    monkeypatch.setattr(sa.moe, "_AMX", request.param)
    monkeypatch.setattr(sa.moe, "_GROUPED_BACKWARD", not request.param)
    return request.param


@pytest.mark.parametrize("model", MODELS)
def test_logits_match_eager_float32(sa, name, model, forms):
    eager = build(model)
    ours = with_impl(eager, name)
    ids = tokens()
    before = calls(name)
    with torch.no_grad():
        a = eager(ids).logits
        b = ours(ids).logits
    assert calls(name) - before == len(experts_modules(ours))
    assert a.abs().max() > 0.1
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", MODELS)
def test_gradients_match_eager(sa, name, model, forms):
    """With either forms and backward (see `forms`): torch's grouped products where they apply,
    or the per-expert loop."""
    eager = build(model).train()
    ours = with_impl(eager, name).train()
    ids = tokens()
    probe = torch.randn(ids.shape + (COMMON["vocab_size"],), generator=torch.Generator().manual_seed(2))
    for m in (eager, ours):
        (m(ids).logits * probe).sum().backward()
    ours_params = dict(ours.named_parameters())
    checked = 0
    for pname, p in eager.named_parameters():
        q = ours_params[pname]
        if p.grad is None:
            assert q.grad is None, pname
            continue
        # float32 sums in another order, carried back through the layers: relative to the largest
        # (up to 1.3e-6 of it seen on an EPYC, in an attention bias of Qwen2-MoE summed over tokens)
        scale = p.grad.abs().max().item()
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=3e-6 * scale, msg=lambda m: f"{pname} ({scale=}): {m}")
        checked += ".experts." in pname
    # every expert weight (and bias) of every layer has a gradient that matched
    assert checked == sum(len(list(e.parameters())) for e in experts_modules(eager))


@pytest.mark.parametrize("incoming", ["constant", "with_graph"])
def test_double_backward_raises(sa, name, forms, incoming):
    """A second derivative through the experts (a gradient penalty) is not supported: it raises,
    on either backward path, rather than returning the part of the graph the first one kept; also
    where the gradient reaching the experts is a constant (a loss linear in their output, constant
    routing weights) while another term gives the first gradient a graph (eager's second
    derivative differs from that term's alone here, so a result would be wrong)."""
    m = build("mixtral")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(4))
    ex.config._experts_implementation = name
    try:
        x = h.clone().requires_grad_(True)
        w = w.clone().requires_grad_(incoming == "with_graph")
        (gx,) = torch.autograd.grad(((ex(x, idx, w) + x.square()) * probe).sum(), x, create_graph=True)
        assert gx.requires_grad
        with pytest.raises(RuntimeError, match="no double backward"):
            gx.square().sum().backward()
    finally:
        ex.config._experts_implementation = "eager"


def capture_experts_inputs(m, ids):
    """(experts module, its (hidden_states, top_k_index, top_k_weights)) of the first MoE layer,
    as the model's own router produced them."""
    ex = experts_modules(m)[0]
    seen = []
    hook = ex.register_forward_pre_hook(lambda mod, args: seen.append(tuple(a.detach().clone() for a in args)))
    with torch.no_grad():
        m(ids)
    hook.remove()
    return ex, seen[0]


@pytest.mark.parametrize("model", MODELS)
def test_bf16_error_no_worse_than_eager(sa, name, model):
    """Same bf16 weights and inputs; the reference is the eager loop in float64. Ours sums the
    top-k expert rows in float32 and rounds once (eager rounds each weighted row to bf16, then
    each sum), and adds biases inside the product. The mean and RMS errors must be no worse than
    eager's. The largest single error comes from where the bf16 intermediates (the activation)
    happen to round on either side, so it may exceed eager's by at most one bf16 step at the
    output's magnitude."""
    m = build(model, torch.bfloat16)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=64, batch=4))
    ref_ex = copy.deepcopy(ex).double()
    ref_ex.config = copy.copy(ex.config)
    ref_ex.config._experts_implementation = "eager"
    with torch.no_grad():
        ref = ref_ex(h.double(), idx, w.double())
        errs = {}
        for impl in ("eager", name):
            ex.config._experts_implementation = impl
            out = ex(h, idx, w)
            assert out.dtype == torch.bfloat16
            d = (out.double() - ref).abs()
            errs[impl] = {"max": d.max().item(), "mean": d.mean().item(), "rms": d.square().mean().sqrt().item()}
    ex.config._experts_implementation = "eager"
    ours, eager = errs[name], errs["eager"]
    assert ours["mean"] <= eager["mean"], errs
    assert ours["rms"] <= eager["rms"], errs
    step = 2.0 ** (torch.frexp(ref.abs().max()).exponent.item() - 8)  # bf16 spacing at max |out|
    assert ours["max"] <= eager["max"] + step, errs


@pytest.mark.parametrize("model", MODELS)
def test_bf16_gradients_by_own_products(sa, name, model, monkeypatch):
    """Where torch has no oneDNN bf16 product (AVX2 CPUs; forced here on any CPU with the kernels)
    every product of a bf16 block, forward and backward, is this library's small_matmul (or
    small_matmul_grouped) / small_matmul_nn, which read the weights as they lie (GPT-OSS's
    transposed ones and biases included). The gradients of the input, every expert weight and
    bias against the eager loop in float64 on the same routing:
    ours' relative RMS error at most 1.5x eager's bf16 one (or 2^-8), and the kernels ran."""
    moe = sa.moe
    if not moe._kernel_here():
        pytest.skip("no small_matmul kernel on this CPU (below AVX2)")
    monkeypatch.setattr(moe, "_AMX", False)
    monkeypatch.setattr(moe, "_ONEDNN_BF16", False)
    calls = {"small_matmul_nn": 0, "small_matmul": 0, "small_matmul_grouped": 0}
    real = moe.ops

    class Counting:
        def __getattr__(self, op):
            if op not in calls:
                return getattr(real, op)

            class Counted:
                @staticmethod
                def default(*args):
                    calls[op] += 1
                    return getattr(real, op).default(*args)
            return Counted

    monkeypatch.setattr(moe, "ops", Counting())
    m = build(model, torch.bfloat16, wide=True)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=32, batch=2))
    g_out = torch.randn(h.shape, generator=torch.Generator().manual_seed(3)).bfloat16()

    def grads(dtype, impl):
        mod = copy.deepcopy(ex).to(dtype)
        mod.config = copy.copy(ex.config)
        mod.config._experts_implementation = impl
        hh = h.to(dtype).requires_grad_(True)
        mod(hh, idx, w.to(dtype)).backward(g_out.to(dtype))
        return {"input": hh.grad, **{n: p.grad for n, p in mod.named_parameters()}}

    ref, eager = grads(torch.float64, "eager"), grads(torch.bfloat16, "eager")
    before = dict(calls)
    ours = grads(torch.bfloat16, name)
    forward = ("small_matmul", "small_matmul_grouped")  # per block, or a gate group's blocks in one call
    assert calls["small_matmul_nn"] > before["small_matmul_nn"]
    assert sum(calls[op] for op in forward) > sum(before[op] for op in forward)
    for k, r in ref.items():
        assert ours[k] is not None and ours[k].dtype == torch.bfloat16, k
        scale = r.square().mean().sqrt().item()
        if scale == 0:
            assert not ours[k].any(), k
            continue

        def err(t):
            return (t.double() - r).square().mean().sqrt().item() / scale
        assert err(ours[k]) <= max(1.5 * err(eager[k]), 2.0 ** -8), (k, err(ours[k]), err(eager[k]))


def outputs_per_thread_count(make, run, counts=(1, 2)):
    threads = torch.get_num_threads()
    try:
        out = []
        for n in counts:
            torch.set_num_threads(n)
            out.append(run(make()))
        return out
    finally:
        torch.set_num_threads(threads)


def bitwise_equal(a, b):
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


@pytest.mark.parametrize("model", MODELS)
def test_bitwise_identical_for_1_and_2_threads(sa, name, model, forms):
    """The experts of a bf16 model wide enough (hidden 512) for the dispatch and combine to split
    their work over 2 threads, on the model's own routing: a batch, and one token (one row per
    expert: the matrix-vector path with AMX's forms). Then a training step of the tiny model: logits and
    expert-weight gradients.

    The expert products are torch's: oneDNN and MKL split the reduction of some product shapes
    over threads (for every experts implementation alike; at these shapes they do not here). A
    failure says whether eager's output differed too."""
    m = build(model, torch.bfloat16, wide=True)
    ex, batch = capture_experts_inputs(m, tokens(n=64, batch=3))
    _, one = capture_experts_inputs(m, tokens(n=1, batch=1))

    def infer(impl):
        def run(_):
            ex.config._experts_implementation = impl
            with torch.no_grad():
                return [ex(*batch), ex(*one)]
        return run

    a, b = outputs_per_thread_count(lambda: None, infer(name))
    if not bitwise_equal(a, b):
        e1, e2 = outputs_per_thread_count(lambda: None, infer("eager"))
        pytest.fail(f"ours differs between 1 and 2 threads; eager {'too' if not bitwise_equal(e1, e2) else 'does not'}")

    def train(m):
        m.train()
        logits = m(tokens(n=40, batch=3)).logits
        logits.float().square().sum().backward()
        return [logits.detach()] + [e.gate_up_proj.grad if e.has_gate else e.up_proj.grad for e in experts_modules(m)]

    a, b = outputs_per_thread_count(lambda: with_impl(build(model, torch.bfloat16), name), train)
    assert bitwise_equal(a, b)


@pytest.fixture
def teams(sa, monkeypatch):
    """The expert blocks split over teams of threads on the tiny models: every block its own gate
    group, any rows per block, two intra-op threads. Yields a count of the calls that ran on the
    team threads."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_GATE_GROUP_ELEMS", 1)
    monkeypatch.setattr(moe, "_TEAM_MIN_ROWS", 1)
    runs = {"n": 0}
    real = moe._TeamPool.run

    def counted(self, fns):
        runs["n"] += 1
        return real(self, fns)
    monkeypatch.setattr(moe._TeamPool, "run", counted)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield runs
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model", MODELS)
def test_teams_match_eager(sa, name, model, forms, teams):
    """With the blocks split over teams: float32 logits and every gradient as eager's."""
    test_logits_match_eager_float32(sa, name, model, forms)
    forward = teams["n"]
    assert forward > 0
    test_gradients_match_eager(sa, name, model, forms)
    assert teams["n"] > 2 * forward  # the training forward and the backward's passes ran on them too


@pytest.mark.parametrize("model", MODELS)
def test_teams_give_the_bits_of_one_thread(sa, name, model, forms, teams):
    """Two teams of one intra-op thread each run every product as one thread does: the experts'
    output (no grad, and training) and every gradient (input, routing weights, each expert weight
    and bias) are bitwise those of a one-thread run, where without teams two-thread products may
    differ in the last bit. A bf16 model wide enough (hidden 512) for torch's products to split
    over threads."""
    m = build(model, torch.bfloat16, wide=True)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=64, batch=3))
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    ex.config._experts_implementation = name

    def run():
        ex.zero_grad(set_to_none=True)
        with torch.no_grad():
            infer = ex(h, idx, w)
        x, wt = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = ex(x, idx, wt)
        (y.float() * probe).sum().backward()
        return [infer, y.detach(), x.grad, wt.grad] + [p.grad for p in ex.parameters()]
    torch.set_num_threads(1)
    one = run()
    before = teams["n"]
    torch.set_num_threads(2)
    two = run()
    assert teams["n"] - before >= 3  # the forward without grad, with it, and the backward
    assert all(t is not None for t in one)
    assert bitwise_equal(one, two)


def run_teams(moe, groups, run):
    moe._teams(groups, run, moe._team_parts(groups, torch.device("cpu"), 1))


def team_groups(rows=(4, 4)):
    blocks, start = [], 0
    for e, n in enumerate(rows):
        blocks.append([(e, start, start + n)])
        start += n
    return blocks


def test_teams_hand_errors_back_and_keep_nothing(sa, teams):
    """An error in a part reaches the caller as raised, and the teams keep working; no part of a
    task outlives the call on a team thread (autograd would copy a gradient something else still
    holds); each part runs on its own team thread with one intra-op thread; a thread started
    afterwards runs with the caller's thread count, not the teams'."""
    moe = sa.moe

    def fail(part):
        if part[0][0][0] == 1:
            raise KeyError("raised in a part")
    with pytest.raises(KeyError, match="raised in a part"):
        run_teams(moe, team_groups(), fail)

    seen = []

    def submit():
        t = torch.ones(3)
        run_teams(moe, team_groups(), lambda part: seen.append(
            (part[0][0][0], threading.current_thread().name, torch.get_num_threads(), t.sum().item())))
        return weakref.ref(t)
    ref = submit()
    assert ref() is None
    assert sorted(seen) == [(0, "scatter_add.moe-team-0", 1, 3.0), (1, "scatter_add.moe-team-1", 1, 3.0)]
    later = []
    th = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    th.start()
    th.join()
    assert later == [2]


def test_teams_finish_before_an_interrupt_is_raised(sa, teams):
    """A KeyboardInterrupt (a real SIGINT) that reaches the caller while the parts run is raised
    once every part has stopped: they write the caller's tensors, and a part still running at
    interpreter exit aborted the process. 300 times, the signal at a random moment of the wait:
    a wait that took a part's report and was then interrupted lost it and never ended (so a
    watchdog ends the process, exit status 1, if this hangs). The teams then work as before."""
    import faulthandler
    import random
    import signal

    moe = sa.moe
    rng = random.Random(0)
    finished = []

    def part(p, delay):
        time.sleep(delay)
        if p[0][0][0] == 0:
            os.kill(os.getpid(), signal.SIGINT)
        finished.append(p[0][0][0])
    # Python raises KeyboardInterrupt on SIGINT unless SIGINT was ignored when it started (as in a
    # job started in the background by a shell): the handler is set here either way
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    faulthandler.dump_traceback_later(60, exit=True)
    try:
        for _ in range(300):
            finished.clear()
            delays = {0: rng.random() * 0.002, 1: rng.random() * 0.002}
            with pytest.raises(KeyboardInterrupt):
                run_teams(moe, team_groups(), lambda p: part(p, delays[p[0][0][0]]))
            assert sorted(finished) == [0, 1]
    finally:
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGINT, previous)
    finished.clear()
    run_teams(moe, team_groups(), lambda p: finished.append(p[0][0][0]))
    assert sorted(finished) == [0, 1]


def test_teams_follow_the_callers_autocast(sa, name, teams):
    """A backward run under torch.autocast: the team threads multiply as the caller's thread
    would (GPT-OSS's transposed weights take plain torch.mm there, which autocast casts), so the
    gradients keep the bits of a one-thread run."""
    m = build("gpt_oss")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=32, batch=2))
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(7))
    ex.config._experts_implementation = name

    def run():
        ex.zero_grad(set_to_none=True)
        x = h.clone().requires_grad_(True)
        y = ex(x, idx, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (y * probe).sum().backward()
        return [x.grad] + [p.grad for p in ex.parameters()]
    torch.set_num_threads(1)
    one = run()
    before = teams["n"]
    torch.set_num_threads(2)
    two = run()
    assert teams["n"] > before
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_teams_off_where_they_cannot_run(sa, teams):
    """Everything runs on the calling thread with one intra-op thread, blocks of fewer rows than
    _TEAM_MIN_ROWS, a group larger than _TEAM_MAX_GROUP_BYTES, one group, under a dispatch or
    torch function mode or a profiler (which the team threads would not see), and for a call
    made from within a part."""
    from torch.utils._python_dispatch import TorchDispatchMode

    moe = sa.moe

    class Through(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class ThroughFunctions(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    where = []
    max_bytes = moe._TEAM_MAX_GROUP_BYTES

    def note(part):
        where.append(threading.current_thread().name)
    run_teams(moe, team_groups(), note)
    assert sorted(where) == ["scatter_add.moe-team-0", "scatter_add.moe-team-1"]
    me = threading.current_thread().name
    for setup in ("one thread", "few rows", "large group", "one group", "dispatch mode", "function mode", "profiler",
                  "nested"):
        where.clear()
        groups = [team_groups()[0]] if setup == "one group" else team_groups()
        if setup == "one thread":
            torch.set_num_threads(1)
        try:
            if setup == "few rows":
                moe._TEAM_MIN_ROWS = 5
            if setup == "large group":
                moe._TEAM_MAX_GROUP_BYTES = 3  # rows of 4 blocks of one byte a row
            if setup == "dispatch mode":
                with Through():
                    run_teams(moe, groups, note)
            elif setup == "function mode":
                with ThroughFunctions():
                    run_teams(moe, groups, note)
            elif setup == "profiler":  # it records the calling thread's ops only
                with torch.autograd.profiler.profile():
                    run_teams(moe, groups, note)
            elif setup == "nested":
                run_teams(moe, groups, lambda part: run_teams(moe, groups, note))
            else:
                run_teams(moe, groups, note)
        finally:
            torch.set_num_threads(2)
            moe._TEAM_MIN_ROWS, moe._TEAM_MAX_GROUP_BYTES = 1, max_bytes
        if setup == "nested":  # each part ran the whole call where it was
            assert sorted(where) == ["scatter_add.moe-team-0", "scatter_add.moe-team-1"], setup
        else:
            assert where == [me], setup


def test_teams_under_inference_mode_and_from_several_threads(sa, name, teams):
    """Under torch.inference_mode the teams write the caller's inference tensors; calls from
    several threads at once take the teams in turn, each with the bits of a call alone."""
    m = build("mixtral", torch.bfloat16, wide=True)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=64, batch=3))
    ex.config._experts_implementation = name
    with torch.no_grad():
        want = ex(h, idx, w)
    before = teams["n"]
    with torch.inference_mode():
        got = ex(h, idx, w)
    assert got.is_inference() and torch.equal(got, want) and teams["n"] > before
    results, errors = [], []

    def call():
        try:
            with torch.no_grad():
                for _ in range(4):
                    results.append(ex(h, idx, w))
        except BaseException as e:  # noqa: B036
            errors.append(e)
    threads = [threading.Thread(target=call) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(results) == 12
    assert all(torch.equal(r, want) for r in results)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork: POSIX only")
def test_teams_in_a_forked_child(sa, teams):
    """A child forked after the teams ran has none of their threads: its calls start new ones
    (rather than wait forever on the parent's) and give the parent's bits. The expert loop is
    called directly: torch's own parallel ops on the calling thread may hang in a forked child
    (GNU OpenMP), whoever calls them."""
    moe = sa.moe
    g = torch.Generator().manual_seed(6)
    E, H, inter = 8, 64, 96
    w_in = torch.randn(E, 2 * inter, H, generator=g).to(torch.bfloat16)
    w_out = torch.randn(E, H, inter, generator=g).to(torch.bfloat16)
    xs = torch.randn(8 * 20, H, generator=g).to(torch.bfloat16)
    ends = torch.arange(1, E + 1) * 20
    gate = lambda h: torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]  # noqa: E731

    def loop():
        return moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate)
    want = loop()
    assert teams["n"] > 0
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when the call gave the parent's bits
        code = 1
        try:
            code = 0 if torch.equal(loop(), want) else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's call did not return")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("model", MODELS)
def test_greedy_generate_matches_eager(sa, name, model):
    eager = build(model)
    ours = with_impl(eager, name)
    ids = tokens(n=5, batch=2)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    a = eager.generate(ids, **kw)
    before = calls(name)
    b = ours.generate(ids, **kw)
    assert calls(name) - before >= 8 * len(experts_modules(ours))
    assert a.shape == (2, 13)
    assert torch.equal(a, b)


def moe_block(m):
    """The sparse MoE block that owns the first experts module."""
    ex = experts_modules(m)[0]
    return next(mod for mod in m.modules() if any(c is ex for c in mod.children()))


def graph_breaks(block, x):
    torch._dynamo.reset()
    return torch._dynamo.explain(block)(x).graph_break_count


@pytest.mark.parametrize("model", MODELS)
def test_torch_compile_block(sa, name, model):
    m = build(model)
    block = moe_block(m)
    x = torch.randn(2, 9, COMMON["hidden_size"], generator=torch.Generator().manual_seed(3))
    ex = experts_modules(m)[0]
    ex.config._experts_implementation = "grouped_mm"
    theirs = graph_breaks(block, x)
    ex.config._experts_implementation = name
    ours = graph_breaks(block, x)
    assert ours <= theirs
    assert ours == 0  # one graph: the grouped products are ops of their own
    # bf16, where grouped_mm takes torch's grouped_mm kernel
    block16 = moe_block(build(model, torch.bfloat16))
    ex16 = experts_modules(block16)[0]
    ex16.config._experts_implementation = "grouped_mm"
    theirs_bf16 = graph_breaks(block16, x.bfloat16())
    ex16.config._experts_implementation = name
    assert graph_breaks(block16, x.bfloat16()) <= theirs_bf16
    eager_out = block(x)
    eager_out = eager_out[0] if isinstance(eager_out, tuple) else eager_out
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    out = compiled(x)
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-5)
    # and backward through the compiled graph
    x.requires_grad_(True)
    out = compiled(x)
    (out[0] if isinstance(out, tuple) else out).sum().backward()
    assert ex.gate_up_proj.grad is not None and ex.gate_up_proj.grad.abs().sum() > 0
    ex.config._experts_implementation = "eager"


def test_expert_parallel_sentinels(sa, name, forms):
    """Under expert parallelism transformers passes ids >= num_experts (experts held by other ranks)
    with zero weight: they cost no compute, add nothing, and get no gradient. An expert that no
    pair names (here expert 0) gets a zero weight gradient."""
    m = build("mixtral")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    e = ex.num_experts
    idx = idx.clone()
    idx[::3, 0] = e
    idx[1::4, 1] = e
    idx[idx == 0] = e
    w = w.clone()
    w[idx >= e] = 0
    ex._is_expert_parallel = True
    grads = []
    for impl in (name, "grouped_mm"):
        ex.config._experts_implementation = impl
        ex.zero_grad(set_to_none=True)
        hi = h.clone().requires_grad_(True)
        wi = w.clone().requires_grad_(True)
        out = ex(hi, idx, wi)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
        grads.append((out.detach(), hi.grad, wi.grad, ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone()))
    ex.config._experts_implementation = "eager"
    ours, ref = grads
    assert torch.all(ours[2][idx >= e] == 0)
    assert torch.all(ours[3][0] == 0) and torch.all(ours[4][0] == 0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["some", "all"])
def test_expert_parallel_sentinels_without_grad(sa, name, which):
    """The inference loop (no autograd) with sentinel ids: rows of other ranks' experts add
    nothing; when every id is a sentinel there are no rows to compute and the output is zero."""
    m = build("mixtral")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    e = ex.num_experts
    idx = idx.clone()
    if which == "all":
        idx[:] = e
    else:
        idx[::3, 0] = e
        idx[1::4, 1] = e
    w = w.clone()
    w[idx >= e] = 0
    ex._is_expert_parallel = True
    with torch.no_grad():
        ex.config._experts_implementation = name
        out = ex(h, idx, w)
        ex.config._experts_implementation = "grouped_mm"
        ref = ex(h, idx, w)
    ex.config._experts_implementation = "eager"
    ex._is_expert_parallel = False
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    if which == "all":
        assert torch.equal(out, torch.zeros_like(out))


def test_frozen_experts_still_train_the_router(sa, name):
    """Experts frozen, hidden states without grad (e.g. adapters on the router only): the products
    run without recording, and the routing weights still get their gradient through the combine."""
    m = build("mixtral")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    ex.requires_grad_(False)
    grads = {}
    for impl in ("eager", name):
        ex.config._experts_implementation = impl
        wg = w.clone().requires_grad_(True)
        ex(h, idx, wg).square().sum().backward()
        grads[impl] = wg.grad
    ex.config._experts_implementation = "eager"
    assert grads[name].abs().sum() > 0
    torch.testing.assert_close(grads[name], grads["eager"], rtol=1e-5, atol=1e-5)


def flag_experts(kind):
    if kind == "no_gate":  # up_proj -> act_fn -> down_proj (NemotronH)
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

        cfg = tf.NemotronHConfig(hidden_size=32, moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2)
        ex = NemotronHExperts(cfg)
    else:  # RMSNorm after each expert (MuseSpark)
        from transformers.models.muse_spark.configuration_muse_spark import MuseSparkTextConfig
        from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

        cfg = MuseSparkTextConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, moe_hidden_size=32,
                                  moe_intermediate_size=24, num_local_experts=8, num_experts_per_tok=2)
        ex = MuseSparkExperts(cfg)
    randomize(ex, 4)
    return ex


def flag_routing(seed, tokens):
    """Hidden states and a top-2 routing over the 8 experts of flag_experts' modules."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, 32, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tokens)])
    return h, idx, torch.rand(tokens, 2, generator=g)


@pytest.mark.parametrize("kind", ["no_gate", "post_expert_norm"])
def test_decorator_flags(sa, name, kind):
    ex = flag_experts(kind)
    assert (not ex.has_gate) if kind == "no_gate" else ex.has_post_expert_norm
    h, idx, w = flag_routing(5, 20)
    outs = {}
    for impl in ("eager", name):
        ex.config._experts_implementation = impl
        x = h.clone().requires_grad_(True)
        out = ex(x, idx, w)
        out.square().sum().backward()
        outs[impl] = (out.detach(), x.grad, ex.down_proj.grad.clone())
        ex.zero_grad()
    for a, b in zip(outs["eager"], outs[name]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("frozen_experts", [False, True])
def test_activation_with_parameters_gets_gradients(sa, name, frozen_experts):
    """An act_fn with trainable parameters (here a PReLU in NemotronH's ungated experts) is traced
    by autograd instead of differentiated block by block: its parameters get their gradients,
    also when the expert weights are frozen."""
    ex = flag_experts("no_gate")
    ex.act_fn = torch.nn.PReLU(init=0.3)
    ex.up_proj.requires_grad_(not frozen_experts)
    ex.down_proj.requires_grad_(not frozen_experts)
    h, idx, w = flag_routing(6, 24)
    grads = {}
    for impl in ("eager", name):
        ex.config._experts_implementation = impl
        ex.zero_grad()
        out = ex(h, idx, w)
        out.square().sum().backward()
        grads[impl] = [out.detach(), ex.act_fn.weight.grad.clone()]
        if not frozen_experts:
            grads[impl].append(ex.up_proj.grad.clone())
    assert grads[name][1].abs().sum() > 0
    for a, b in zip(grads["eager"], grads[name]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


SILU_GATED = {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3"}


@pytest.mark.parametrize("model", MODELS)
def test_default_gate_is_recognised(sa, model):
    """Experts with transformers' default gate and a plain SiLU take the written-out derivative;
    GPT-OSS's own gate does not, nor does anything that changes what the gate computes or what
    autograd runs through it: another activation, an in-place SiLU, a gate or a forward set on
    the instance, a forward replaced on the activation's class, forward or backward hooks."""
    ex = experts_modules(build(model))[0]
    assert sa.moe._silu_gate(ex) == (model in SILU_GATED)
    if model not in SILU_GATED:
        return
    act = ex.act_fn
    nn_module = torch.nn.modules.module
    changes = [
        lambda: act.register_forward_hook(lambda mod, args, out: out).remove,
        lambda: act.register_forward_pre_hook(lambda mod, args: None).remove,
        lambda: act.register_full_backward_hook(lambda mod, gi, go: None).remove,
        lambda: act.register_full_backward_pre_hook(lambda mod, go: None).remove,
        lambda: nn_module.register_module_forward_hook(lambda mod, args, out: out).remove,
        lambda: nn_module.register_module_full_backward_hook(lambda mod, gi, go: None).remove,
    ]
    for change in changes:
        undo = change()
        assert not sa.moe._silu_gate(ex)
        undo()
        assert sa.moe._silu_gate(ex)

    def setting(obj, attr, value):  # obj.attr = value, and how to undo it (submodules included)
        had = attr in vars(obj) or attr in getattr(obj, "_modules", {})
        old = getattr(obj, attr) if had else None
        setattr(obj, attr, value)
        return lambda: setattr(obj, attr, old) if had else delattr(obj, attr)
    for undo in (lambda: setting(ex, "_apply_gate", lambda h: h[..., :h.shape[-1] // 2]),
                 lambda: setting(act, "forward", lambda x: 2 * torch.nn.functional.silu(x)),
                 lambda: setting(type(act), "forward", lambda self, x: 2 * torch.nn.functional.silu(x)),
                 lambda: setting(ex, "act_fn", torch.nn.GELU()),
                 lambda: setting(ex, "act_fn", torch.nn.SiLU(inplace=True)),
                 lambda: setting(torch.nn.functional, "silu", doubled_silu())):
        undo = undo()
        try:
            assert not sa.moe._silu_gate(ex)
        finally:
            undo()
        assert sa.moe._silu_gate(ex)
    ex.act_fn = torch.nn.SiLU()
    assert sa.moe._silu_gate(ex)
    # a mode may change what silu computes (a TorchFunctionMode, a TorchDispatchMode)
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class PassingDispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    for mode in (Passing, PassingDispatch):
        with mode():
            assert not sa.moe._silu_gate(ex)
    assert sa.moe._silu_gate(ex)


def doubled_silu():
    """2 * silu, in torch.nn.functional.silu's name (functools.wraps): what the activations
    compute once it replaces torch's."""
    real = torch.nn.functional.silu

    @functools.wraps(real)
    def silu(x, inplace=False):
        return 2 * real(x)
    return silu


@pytest.mark.parametrize("act", ["config", "nn.SiLU"])
def test_replaced_silu_gets_its_own_gradients(sa, name, monkeypatch, act):
    """With torch.nn.functional.silu replaced (which transformers' SiLUActivation and nn.SiLU
    call at each call), the experts' gradients are those of what the forward computed, as
    eager's: the written-out derivative of torch's silu does not run."""
    eager = build("mixtral")
    if act == "nn.SiLU":
        for ex in experts_modules(eager):
            ex.act_fn = torch.nn.SiLU()
    ours = with_impl(eager, name)
    monkeypatch.setattr(torch.nn.functional, "silu", doubled_silu())
    ids = tokens()
    probe = torch.randn(ids.shape + (COMMON["vocab_size"],), generator=torch.Generator().manual_seed(3))
    for m in (eager, ours):
        (m(ids).logits * probe).sum().backward()
    ours_params = dict(ours.named_parameters())
    for pname, p in eager.named_parameters():
        if ".experts." in pname:
            scale = p.grad.abs().max().item()
            torch.testing.assert_close(ours_params[pname].grad, p.grad, rtol=1e-4, atol=3e-6 * scale,
                                       msg=lambda m: f"{pname}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_gate_derivative_has_the_bits_of_autograd(sa, dtype):
    """_silu_gate_backward against autograd over the model's own gate, on values that reach the
    activation's tails, strided gradient rows included."""
    ex = experts_modules(build("mixtral"))[0]
    g = torch.Generator().manual_seed(8)
    h = (torch.randn(37, 2 * 40, generator=g) * torch.tensor([0.1, 3.0, 30.0]).repeat_interleave(27)[:80]).to(dtype)
    grad_a = torch.randn(37, 2 * 40, generator=g).to(dtype)[:, ::2]
    hh = h.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(ex._apply_gate(hh), hh, grad_a)
    got = sa.moe._silu_gate_backward(h, grad_a)
    assert got.dtype == dtype and got.shape == h.shape
    assert torch.equal(got, want)


def test_gradients_by_either_gate_derivative(sa, name, monkeypatch, forms):
    """The experts' gradients with the written-out derivative of the default gate and with autograd
    over the gate are bitwise the same, on either backward path, and the written-out one ran."""
    m = build("mixtral")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    ran = {"n": 0}
    real = sa.moe._silu_gate_backward

    def counted(*args, **kwargs):
        ran["n"] += 1
        return real(*args, **kwargs)
    monkeypatch.setattr(sa.moe, "_silu_gate_backward", counted)
    results = {}
    for which in (True, False):
        monkeypatch.setattr(sa.moe, "_silu_gate", lambda self, which=which: which)
        ex.config._experts_implementation = name
        ex.zero_grad()
        x = h.clone().requires_grad_(True)
        out = ex(x, idx, w)
        (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(5))).sum().backward()
        results[which] = [x.grad] + [p.grad.clone() for p in ex.parameters()]
    ex.config._experts_implementation = "eager"
    assert ran["n"] == 1
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)


def test_bad_input_names_the_argument(sa, name):
    m = build("mixtral")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    f = sa.moe.experts_forward
    bad = idx.clone()
    bad[2, 1] = -3
    with pytest.raises(ValueError, match=r"top_k_index.*-3"):
        f(ex, h, bad, w)
    with pytest.raises(ValueError, match=r"top_k_index.*shape"):
        f(ex, h, idx[:-1], w)
    with pytest.raises(ValueError, match=r"top_k_weights.*shape"):
        f(ex, h, idx, w[:, :1])
    with pytest.raises(ValueError, match=r"hidden_states.*2-D"):
        f(ex, h[None], idx, w)
    with pytest.raises(TypeError, match=r"top_k_index.*float"):
        f(ex, h, idx.float(), w)
    # compiled, the negative id is caught when the graph runs, not routed to expert 0
    torch._dynamo.reset()
    compiled = torch.compile(lambda hs, i, tw: f(ex, hs, i, tw), fullgraph=True)
    torch.testing.assert_close(compiled(h, idx, w), f(ex, h, idx, w))
    with pytest.raises(RuntimeError, match=r"top_k_index must hold expert ids >= 0"):
        compiled(h, bad, w)


@pytest.mark.parametrize("cast", [True, False], ids=["cast", "few_rows"])
@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_autocast(sa, name, model, forms, cast, monkeypatch):
    """float32 experts under torch.autocast("cpu", bfloat16), with grad, against eager under the
    same autocast (whose per-expert F.linear runs in bf16) and float64. Where the experts that
    run get enough rows (forced here: moe._AUTOCAST_MIN_ROWS), their weights are cast and the
    products run in bf16: the output and every gradient at bf16's level, and no worse than twice
    eager's (the products used to run in float32 where they write into given memory, the others
    in bf16). GPT-OSS's eager adds its biases in float32 after each bf16 product (a float32 gate,
    float32 bias gradients), where ours adds them in bf16, as F.linear under autocast does: there,
    no worse than twice eager's or bf16's level (3e-2 of the largest; 2.3e-2 seen, eager 1.0e-2,
    in the gate/up weight's gradient), whichever is more. With few rows nothing is cast: float32's
    level. Either way the dtypes are eager's."""
    monkeypatch.setattr(sa.moe, "_AUTOCAST_MIN_ROWS", 0 if cast else 1 << 30)
    ex, (h, idx, w) = capture_experts_inputs(build(model), tokens())
    gy = torch.randn(h.shape, generator=torch.Generator().manual_seed(6))

    def run(module, impl, dtype, autocast):
        module = copy.deepcopy(module).to(dtype)
        module.config._experts_implementation = impl
        x = h.to(dtype, copy=True).requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = module(x, idx, w.to(dtype))
        out.backward(gy.to(out.dtype))
        module.config._experts_implementation = "eager"
        return out.dtype, {"out": out.detach(), "hidden_states": x.grad,
                           **{n: p.grad for n, p in module.named_parameters()}}
    _, ref = run(ex, "eager", torch.float64, False)
    eager_dtype, eager = run(ex, "eager", torch.float32, True)
    ours_dtype, ours = run(ex, name, torch.float32, True)
    assert ours_dtype == eager_dtype == torch.float32
    assert all(ours[k].dtype == eager[k].dtype for k in ref)

    def err(a, r):
        return ((a.double() - r).abs().max() / r.abs().max()).item()
    for key, r in ref.items():
        o, e = err(ours[key], r), err(eager[key], r)
        if cast:
            bound = 2 * e if model != "gpt_oss" else max(2 * e, 3e-2)
            assert 1e-4 < o <= bound, (key, o, e)
        else:
            assert o < 1e-5 < e or key == "down_proj_bias", (key, o, e)


@pytest.mark.parametrize("model", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_autocast_inference_casts_group_by_group_with_the_same_bits(sa, name, model, monkeypatch):
    """Without grad, under autocast, the loop casts each group's weights as it comes: the output
    has the bits of the training forward, which casts every expert that runs up front (the
    plain forms: with AMX the training forward leaves out the swapped grouped products), and is
    as close to float64 as eager's under the same autocast."""
    monkeypatch.setattr(sa.moe, "_AUTOCAST_MIN_ROWS", 0)
    monkeypatch.setattr(sa.moe, "_AMX", False)
    ex, (h, idx, w) = capture_experts_inputs(build(model), tokens())
    with torch.no_grad():
        ref = copy.deepcopy(ex).double()(h.double(), idx, w.double())
    outs = {}
    for impl, grad in (("eager", False), (name, False), (name, True)):
        ex.config._experts_implementation = impl
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            outs[impl, grad] = ex(h.clone().requires_grad_(grad), idx, w).detach()
    ex.config._experts_implementation = "eager"
    assert torch.equal(outs[name, False], outs[name, True])

    def err(a):
        return ((a.double() - ref).abs().max() / ref.abs().max()).item()
    assert 1e-4 < err(outs[name, False]) <= 2 * err(outs["eager", False])


@pytest.mark.parametrize("cast", [True, False], ids=["cast", "few_rows"])
def test_autocast_with_an_activation_that_has_float32_parameters(sa, name, cast, monkeypatch):
    """transformers' xIELU has float32 parameters, which promote the gate's bf16 output to float32
    under autocast: the next product still gets its operands in one dtype (F.linear would cast
    them), for inference and training, close to eager under the same autocast."""
    monkeypatch.setattr(sa.moe, "_AUTOCAST_MIN_ROWS", 0 if cast else 1 << 30)
    cls_name, extra = MODELS["mixtral"]
    cfg = getattr(tf, cls_name)(**{**COMMON, **extra, "hidden_act": "xielu"})
    torch.manual_seed(0)
    eager = tf.AutoModelForCausalLM.from_config(cfg)
    randomize(eager, 0)
    eager.set_experts_implementation("eager")
    ours = with_impl(eager, name)
    ids = tokens()
    outs = []
    for m in (eager, ours):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(ids).logits
        logits.float().square().mean().backward()
        outs.append((logits.detach().float(), m.model.layers[0].mlp.experts.gate_up_proj.grad))
    (le, ge), (lo, go) = outs
    torch.testing.assert_close(lo, le, rtol=0.05, atol=0.05 * le.abs().max().item())
    torch.testing.assert_close(go, ge, rtol=0.05, atol=0.05 * ge.abs().max().item())


class ScaledSiLU(torch.nn.Module):
    """An activation with a parameter: silu(x) * scale."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([1.5]))

    def forward(self, x):
        return torch.nn.functional.silu(x) * self.scale


@pytest.mark.parametrize("where", ["hidden_states", "weights"])
def test_forward_mode_ad_raises(sa, name, where):
    """Dual tensors (forward-mode AD, torch.func.jvp) are refused with a clear error, with or
    without grad mode: the products write into given memory, where a tangent would be dropped
    (it was, silently, on this library's own products)."""
    import torch.autograd.forward_ad as fwad
    m = build("mixtral")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    ex.config._experts_implementation = name
    try:
        for grad in (False, True):
            with fwad.dual_level(), torch.set_grad_enabled(grad), pytest.raises(NotImplementedError, match="forward-mode AD"):
                if where == "hidden_states":
                    ex(fwad.make_dual(h, torch.ones_like(h)), idx, w)
                else:
                    with torch.nn.utils.stateless._reparametrize_module(
                            ex, {"gate_up_proj": fwad.make_dual(ex.gate_up_proj.detach(), torch.ones_like(ex.gate_up_proj))}):
                        ex(h, idx, w)
        with pytest.raises(NotImplementedError, match="forward-mode AD"):
            torch.func.jvp(lambda x: ex(x, idx, w), (h,), (torch.ones_like(h),))
        # a tangent on a parameter of the activation (one with parameters, as xIELU has)
        ex.act_fn = ScaledSiLU()
        for grad in (False, True):
            with fwad.dual_level(), torch.set_grad_enabled(grad), pytest.raises(NotImplementedError, match="forward-mode AD"):
                with torch.nn.utils.stateless._reparametrize_module(
                        ex, {"act_fn.scale": fwad.make_dual(ex.act_fn.scale.detach(), torch.ones_like(ex.act_fn.scale))}):
                    ex(h, idx, w)
    finally:
        ex.config._experts_implementation = "eager"


def test_no_tokens(sa, name):
    m = build("mixtral")
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    out = sa.moe.experts_forward(ex, h[:0], idx[:0], w[:0])
    assert out.shape == (0, h.shape[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_idle_experts_gradients_are_zero_in_reused_memory(sa, monkeypatch, dtype, transposed, forms):
    """The backward writes its gradients into new, unfilled tensors and zeroes only the idle
    experts' slices (runs of them). Memory handed back by the allocator may hold anything: with
    every new tensor filled with NaN first, each gradient must be what it is with clean memory,
    the idle experts' slices exactly zero, whichever experts are idle (first, last, inner runs,
    none, all)."""
    moe = sa.moe
    real_empty_like = torch.empty_like

    def dirty_empty_like(t, *args, **kwargs):
        r = real_empty_like(t, *args, **kwargs)
        if r.is_floating_point():
            r.fill_(float("nan"))
        return r

    hid, inter = 16, 12
    gate = lambda h: torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]  # noqa: E731
    patterns = [[0, 0, 0, 0, 0], [1, 2, 1, 1, 3], [3, 0, 0, 0, 0], [0, 0, 0, 0, 4], [2, 0, 0, 0, 1],
                [0, 2, 0, 3, 0], [0, 0, 5, 5, 0], [1, 0, 1, 0, 1]]
    for counts in patterns:
        g = torch.Generator().manual_seed(sum(counts))
        E = len(counts)
        w_in = (0.3 * torch.randn(E, *((hid, 2 * inter) if transposed else (2 * inter, hid)), generator=g)).to(dtype)
        w_out = (0.3 * torch.randn(E, *((inter, hid) if transposed else (hid, inter)), generator=g)).to(dtype)
        ends = torch.tensor(counts).cumsum(0)
        xs = torch.randn(int(ends[-1]) + 2, hid, generator=g).to(dtype)  # two sentinel rows past the blocks
        gy = torch.randn(xs.shape[0], hid, generator=g).to(dtype)
        gh = torch.randn(xs.shape[0], 2 * inter, generator=g).to(dtype)  # the first product's output

        def grads():
            via_autograd = []
            for silu_gate in (False, True):  # the gate is the default one: either derivative
                leaves = [t.detach().requires_grad_() for t in (xs, w_in, w_out)]
                ys = moe._Experts.apply(leaves[0], ends, leaves[1], None, leaves[2], None, transposed, gate, silu_gate)
                via_autograd += torch.autograd.grad(ys, leaves, gy)
            via_op = moe._grouped_linear_backward_impl(gh, xs, w_in, ends, False, transposed, True, True)[:2]
            return via_autograd + list(via_op)

        clean = grads()
        monkeypatch.setattr(torch, "empty_like", dirty_empty_like)
        try:
            dirty = grads()
        finally:
            monkeypatch.setattr(torch, "empty_like", real_empty_like)
        for a, b in zip(clean, dirty):
            assert not b.isnan().any(), counts
            assert torch.equal(a, b), counts
        for a, b in zip(clean[:3], clean[3:6]):
            assert torch.equal(a, b), counts
        for w_grad in (dirty[1], dirty[2], dirty[4], dirty[5], dirty[7]):  # per-expert weight gradients
            for e, c in enumerate(counts):
                if c == 0:
                    assert (w_grad[e] == 0).all(), (counts, e)


def test_package_import_does_not_import_transformers():
    code = ("import sys; sys.path.insert(0, 'tests/python'); from conftest import load_sa; sa = load_sa(); "
            "assert 'transformers' not in sys.modules, 'imported'; assert callable(sa.moe.experts_forward); print('ok')")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("profile", ["few_rows", "one_row", "many_rows", "groups"])
def test_inference_products_have_the_bits_of_per_expert_products(sa, monkeypatch, dtype, profile, forms):
    """The no-grad expert loop, with torch's grouped product where it pays: every block's result
    equals the per-expert product of the form it takes bit for bit, idle experts and sentinel rows
    included. With AMX's forms: swapped W_e @ x_e.T for small blocks, the loop's own otherwise, the
    grouped product for small blocks and never for blocks of one row. Without: the plain form,
    grouped for every gate group of more than one block, except bf16 groups of mostly small blocks
    (this library's small_matmul, through _linear, where the CPU has it). With AMX's forms, bf16
    blocks of at most _TILE_ROWS rows take small_matmul where it runs on the tiles. Bit for bit in float32 only with this
    CPU's own forms (MKL may round the other CPU's float32 forms otherwise); bf16 always. Row
    counts are odd, so that the gate's transposed output needs its padded copy."""
    moe = sa.moe
    g = torch.Generator().manual_seed(7)
    e_count, hidden, inter = 6, 64, 48
    w_in = (0.2 * torch.randn(e_count, 2 * inter, hidden, generator=g)).to(dtype)
    w_out = (0.2 * torch.randn(e_count, hidden, inter, generator=g)).to(dtype)
    rows = {"few_rows": [3, 0, 5, 1, 0, 4], "one_row": [1, 1, 0, 1, 1, 0],
            "many_rows": [300, 0, 257, 301, 0, 280], "groups": [3, 0, 5, 1, 0, 4]}[profile]
    if profile == "groups":  # gate groups [3], [5, 1], [4] rows: one of two blocks, not at row 0
        monkeypatch.setattr(moe, "_GATE_GROUP_ELEMS", 6 * 2 * inter)
    sentinels = 3
    ends = torch.tensor(rows).cumsum(0)
    xs = torch.randn(int(ends[-1]) + sentinels, hidden, generator=g).to(dtype)
    xs[int(ends[-1]):] = 0

    def gate(h):  # exactly rounded elementwise ops: the same bits in any layout
        return torch.relu(h[:, :inter]) * h[:, inter:]

    calls = {"n": 0}
    real = torch._grouped_mm

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    with torch.no_grad():
        ys = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate)
    monkeypatch.setattr(torch, "_grouped_mm", real)

    grouped = profile in ("few_rows", "groups") or not forms
    if not forms and (profile != "many_rows" or not moe._ONEDNN_BF16) and moe._small_ok(xs, w_in, None, False):
        grouped = False  # bf16 blocks of a few rows (every block without oneDNN): small_matmul in the loop
    if forms and profile != "many_rows" and moe._small_ok(xs, w_in, None, False):
        grouped = False  # bf16 blocks of at most _TILE_ROWS rows on AMX tiles: small_matmul
    assert (calls["n"] > 0) == grouped
    ref = torch.zeros_like(ys)
    start = 0
    for e, end in enumerate(ends.tolist()):
        x = xs[start:end]
        if end > start and grouped and forms:
            ref[start:end] = torch.mm(w_out[e], gate(torch.mm(w_in[e], x.t()).t()).t()).t()
        elif end > start:
            h = moe._linear(x, w_in, e, None, False)
            ref[start:end] = moe._linear(gate(h), w_out, e, None, False)
        start = end
    if forms == moe._amx_tiles() or dtype == torch.bfloat16:
        assert torch.equal(ys, ref)
    else:  # float32 products of the other CPU's forms: MKL's kernels for them may round otherwise here
        torch.testing.assert_close(ys, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(ys[int(ends[-1]):], torch.zeros_like(ys[int(ends[-1]):]))


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("profile", ["few_rows", "many_rows", "groups"])
def test_inference_gathers_each_group_with_the_bits_of_one_gather(sa, monkeypatch, dtypes, profile):
    """The no-grad loop given the hidden states and each pair's token gathers every gate group's
    rows itself: the result equals the loop over the rows of one gather of every pair, bit for
    bit (sentinel pairs included, hidden states of another dtype than the weights converted)."""
    moe = sa.moe
    h_dtype, w_dtype = dtypes
    g = torch.Generator().manual_seed(11)
    e_count, hidden, inter, tokens, k = 6, 64, 48, 40, 3
    w_in = (0.2 * torch.randn(e_count, 2 * inter, hidden, generator=g)).to(w_dtype)
    w_out = (0.2 * torch.randn(e_count, hidden, inter, generator=g)).to(w_dtype)
    top = torch.randint(0, e_count, (tokens, k), generator=g)
    if profile == "few_rows":
        top = top[:4]
    if profile == "groups":  # several gate groups, each gathered on its own
        monkeypatch.setattr(moe, "_GATE_GROUP_ELEMS", 12 * 2 * inter)
    top[1, 0] = e_count  # a sentinel: no rows, token -1
    h = torch.randn(top.shape[0], hidden, generator=g).to(h_dtype)
    token, _, offsets = moe._route(top, e_count)
    calls = []
    real_gather = moe.gather

    def counted(x, index, **kw):
        calls.append(index.numel())
        return real_gather(x, index, **kw)

    def gate(a):
        return torch.nn.functional.silu(a[:, :inter]) * a[:, inter:]

    with torch.no_grad():
        monkeypatch.setattr(moe, "gather", counted)
        ys = moe._experts_loop(h, offsets, w_in, None, w_out, None, False, gate, token=token)
        monkeypatch.setattr(moe, "gather", real_gather)
        xs = sa.gather(h, token, ignore_index=-1).to(w_dtype)
        ref = moe._experts_loop(xs, offsets, w_in, None, w_out, None, False, gate)
    assert ys.dtype == w_dtype
    assert torch.equal(ys, ref)
    assert sum(calls) == int(offsets[-1])  # every pair's row once, no sentinel
    assert (len(calls) > 1) == (profile == "groups")


@pytest.mark.parametrize("layout", ["intermediate_1", "hidden_1", "tied_rows", "stepped", "broadcast_gate"])
def test_inference_products_take_every_layout(sa, monkeypatch, layout):
    """Operands torch's grouped product cannot read as they lie (a dimension of one element, a
    stride of 0, a stepped view, a broadcast gate output) are copied or left to the loop: the
    result equals the loop's."""
    moe = sa.moe
    g = torch.Generator().manual_seed(3)
    e_count, hidden, inter = 4, 64, 48
    if layout == "intermediate_1":
        inter = 1
    if layout == "hidden_1":
        hidden = 1
    w_in = 0.2 * torch.randn(e_count, 2 * inter, hidden, generator=g)
    w_out = 0.2 * torch.randn(e_count, hidden, inter, generator=g)
    if layout == "tied_rows":
        w_in, w_out = w_in[:, :1].expand_as(w_in), w_out[:, :1].expand_as(w_out)
    if layout == "stepped":
        w_in = torch.randn(e_count, 2 * inter, 4 * hidden, generator=g)[:, :, ::4]
        w_out = torch.randn(e_count, hidden, 4 * inter, generator=g)[:, :, ::4]
    ends = torch.tensor([3, 3, 8, 10])
    xs = torch.randn(10, hidden, generator=g)

    def gate(h):
        a = torch.relu(h[:, :inter]) * h[:, inter:]
        return a[:, :1].expand_as(a) if layout == "broadcast_gate" else a

    with torch.no_grad():
        ys = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate)
        monkeypatch.setattr(moe, "_grouped_ok", lambda *args: False)
        ref = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate)
    torch.testing.assert_close(ys, ref, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split", ["one_thread", "teams"])
def test_default_gate_in_kept_buffers_has_the_bits_of_the_gate(sa, monkeypatch, forms, dtype, split):
    """With transformers' default gate (silu=True), the expert loop runs silu and the product
    itself into buffers carved from this thread's kept scratch block: its output, and the
    training forward's pre-activations, are bitwise those of the gate called as it is, with or
    without teams, block by block or grouped, for several calls in a row; the kept block is never
    the memory of the output."""
    moe = sa.moe
    if split == "teams":
        monkeypatch.setattr(moe, "_GATE_GROUP_ELEMS", 1)
        monkeypatch.setattr(moe, "_TEAM_MIN_ROWS", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2 if split == "teams" else 1)
    try:
        g = torch.Generator().manual_seed(7)
        experts, hidden, inter = 6, 64, 40
        w_in = (torch.randn(experts, 2 * inter, hidden, generator=g) / 8).to(dtype)
        w_out = (torch.randn(experts, hidden, inter, generator=g) / 8).to(dtype)
        rows = [3, 0, 40, 1, 250, 17]  # idle, one row, small and large blocks
        ends = torch.tensor(rows).cumsum(0)
        xs = torch.randn(int(ends[-1]) + 2, hidden, generator=g).to(dtype)
        xs[int(ends[-1]):] = 0

        def gate(h):  # transformers' default: act_fn(gate) * up
            gate_, up = h.chunk(2, dim=-1)
            return torch.nn.functional.silu(gate_) * up
        monkeypatch.setattr(moe, "_scratch", threading.local())
        with torch.no_grad():
            want = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate)
            hs_want = xs.new_empty(xs.shape[0], 2 * inter)
            want_t = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate, hs=hs_want)
            assert getattr(moe._scratch, "block", None) is None  # other gates never take the scratch
            for _ in range(3):
                got = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate, silu=True)
                block = moe._scratch.block
                hs = xs.new_empty(xs.shape[0], 2 * inter)
                got_t = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, gate, hs=hs, silu=True)
                assert moe._scratch.block is block  # kept, and taken again
                assert bitwise_equal([got, got_t, hs[:int(ends[-1])]], [want, want_t, hs_want[:int(ends[-1])]])
                start, stop = block.data_ptr(), block.data_ptr() + block.numel()
                assert all(not start <= t.data_ptr() < stop for t in (got, got_t, hs))
    finally:
        torch.set_num_threads(threads)


def test_scratch_is_taken_out_while_in_use_and_kept_up_to_its_limit(sa, monkeypatch):
    moe = sa.moe
    monkeypatch.setattr(moe, "_scratch", threading.local())
    monkeypatch.setattr(moe, "_SCRATCH_KEEP_BYTES", 1000)
    cpu = torch.device("cpu")
    a = moe._scratch_take(100, cpu)
    b = moe._scratch_take(100, cpu)  # a nested call: its own block
    assert a.data_ptr() != b.data_ptr() and a.numel() >= 100
    moe._scratch_give(a)
    moe._scratch_give(b)  # not larger than the one kept
    assert moe._scratch.block is a
    assert moe._scratch_take(60, cpu) is a and getattr(moe._scratch, "block", None) is None
    c = moe._scratch_take(600, cpu)
    moe._scratch_give(a)
    moe._scratch_give(c)  # larger: kept instead
    assert moe._scratch.block is c
    big = moe._scratch_take(1001, cpu)
    assert big is not c
    moe._scratch_give(big)  # past the limit: not kept
    assert moe._scratch.block is c
    seen = []
    t = threading.Thread(target=lambda: seen.append(getattr(moe._scratch, "block", None)))
    t.start()
    t.join()
    assert seen == [None]  # each thread keeps its own


def test_default_gate_models_keep_their_bits_through_the_kept_buffers(sa, name, monkeypatch):
    """Mixtral's experts (the default gate) without grad and in training: the same bits whether the
    loop runs the gate itself or calls it."""
    m = build("mixtral", torch.bfloat16, wide=True)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=64, batch=3))
    ex.config._experts_implementation = name
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))

    def run():
        ex.zero_grad(set_to_none=True)
        with torch.no_grad():
            infer = ex(h, idx, w)
        x = h.clone().requires_grad_(True)
        y = ex(x, idx, w)
        (y.float() * probe).sum().backward()
        return [infer, y.detach(), x.grad] + [p.grad for p in ex.parameters()]
    assert sa.moe._silu_gate(ex)
    taken = []
    real = sa.moe._scratch_take
    monkeypatch.setattr(sa.moe, "_scratch_take", lambda n, d: taken.append(n) or real(n, d))
    monkeypatch.setattr(sa.moe, "_scratch", threading.local())
    got = run()
    # the loop ran the gate itself, without grad and in training, and the backward took its own
    assert len(taken) == 3 and taken[2] > max(taken[:2])
    block = sa.moe._scratch.block
    start, stop = block.data_ptr(), block.data_ptr() + block.numel()
    assert all(not start <= t.data_ptr() < stop for t in got)
    monkeypatch.setattr(sa.moe, "_silu_gate", lambda self: False)
    assert bitwise_equal(got, run())


def test_a_loop_inside_a_teams_part_runs_there(sa, monkeypatch):
    """A gate that itself runs an expert loop (a hooked activation running another layer): the
    inner loop, on a team thread whose intra-op threads could split it again, runs there, in
    that part, with buffers of its own."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_GATE_GROUP_ELEMS", 1)
    monkeypatch.setattr(moe, "_TEAM_MIN_ROWS", 1)
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter = 4, 32, 16
    w_in, w_out = torch.randn(experts, 2 * inter, hidden, generator=g) / 4, torch.randn(experts, hidden, inter,
                                                                                         generator=g) / 4
    w_in2, w_out2 = torch.randn(experts, 2 * inter, inter, generator=g) / 4, torch.randn(experts, inter, inter,
                                                                                          generator=g) / 4
    ends = torch.tensor([40, 80, 80, 80])
    xs = torch.randn(80, hidden, generator=g)
    on_team = []

    def plain(h):
        a, b = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b

    def nesting(h):
        on_team.append(getattr(moe._team_thread, "on", False))
        a = plain(h)
        inner = torch.tensor([a.shape[0] * (i + 1) // experts for i in range(experts)])
        return a + moe._experts_loop(a.contiguous(), inner, w_in2, None, w_out2, None, False, plain, silu=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # teams of two intra-op threads each
    try:
        with torch.no_grad():
            got = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, nesting)
            assert any(on_team)
            monkeypatch.setattr(moe, "_TEAMS", False)
            want = moe._experts_loop(xs, ends, w_in, None, w_out, None, False, nesting)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("raw,limit", [("0", 0), ("1", 1 << 20), (" 3 ", 3 << 20), ("-1", None), ("1.5", None),
                                       ("lots", None), ("", None)])
def test_scratch_limit_from_the_environment(sa, monkeypatch, raw, limit):
    """SCATTER_ADD_MOE_SCRATCH_MIB sets how much each thread keeps (0: nothing); a bad value raises
    a ValueError naming the variable and the value, before the call writes anything."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_SCRATCH_KEEP_BYTES", None)
    monkeypatch.setattr(moe, "_scratch", threading.local())
    monkeypatch.setenv("SCATTER_ADD_MOE_SCRATCH_MIB", raw)
    cpu = torch.device("cpu")
    if limit is None:
        with pytest.raises(ValueError, match=f"SCATTER_ADD_MOE_SCRATCH_MIB.*{raw!r}"):
            moe._scratch_take(64, cpu)
        return
    block = moe._scratch_take(64, cpu)
    moe._scratch_give(block)
    assert (getattr(moe._scratch, "block", None) is block) == (limit >= 64)
    big = moe._scratch_new(limit + 1, cpu)
    moe._scratch_give(big)
    assert getattr(moe._scratch, "block", None) is not big


def experts_step(ex, h, idx, w, probe, scale=1.0, keep_grads=True):
    """One backward of the experts module on (h * scale); returns each weight's .grad."""
    x = (h * scale).requires_grad_(True)
    (ex(x, idx, w).float() * probe).sum().backward()
    return [p.grad for p in ex.parameters()]


@pytest.mark.parametrize("model,threads,grouped,n", [("mixtral", 1, True, 64), ("mixtral", 2, True, 64),
                                                     ("mixtral", 2, False, 64), ("qwen3_moe", 1, True, 64),
                                                     ("gpt_oss", 1, True, 64), ("mixtral", 1, True, 2),
                                                     ("qwen3_moe", 2, False, 2)])
def test_kept_weight_gradients_have_the_bits_of_new_ones(sa, name, monkeypatch, model, threads, grouped, n):
    """The expert weights' gradients written into kept buffers: bitwise those of new tensors (by
    torch's grouped products, per expert on one or two threads, and block by block), for one
    backward and for two accumulated into the .grad, with the buffers' old contents NaN (at two
    tokens most experts get no rows: their slices too)."""
    moe = sa.moe
    m = build(model, torch.bfloat16, wide=True)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=n, batch=3 if n > 2 else 1))
    ex.config._experts_implementation = name
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(moe, "_GROUPED_BACKWARD", grouped)
    monkeypatch.setattr(moe, "_AMX", moe._AMX and n > 2)  # with AMX, fewer rows than experts go block by block
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = {}
        for keep in (False, True, True):
            monkeypatch.setattr(moe, "_KEEP_GRADS", keep)
            ex.zero_grad(set_to_none=True)
            for kept in (moe._grad_kept or {}).values():  # stale data: every element must be written
                for buf, _ in kept:
                    buf.fill_(float("nan"))
            once = [g.clone() for g in experts_step(ex, h, idx, w, probe)]
            twice = experts_step(ex, h, idx, w, probe, scale=0.5)  # added into the .grad
            got.setdefault(keep, []).append(once + [g.clone() for g in twice])
    finally:
        torch.set_num_threads(before)
    assert len(moe._grad_kept[ex.down_proj]) == 2  # the .grad and the second backward's gradient
    assert bitwise_equal(got[False][0], got[True][0]) and bitwise_equal(got[True][0], got[True][1])


def test_kept_weight_gradient_buffers_are_reused_only_when_free(sa, name, monkeypatch):
    """A buffer kept for a weight's gradient is written again only when nothing else holds its
    memory: a .grad set to None frees it, a gradient the caller keeps (a .grad or
    torch.autograd.grad's result) never changes, gradient accumulation takes the second buffer,
    past two a gradient is new memory, and the buffers go with their weight."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_KEEP_GRADS", True)
    m = build("mixtral", torch.bfloat16, wide=True)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=64, batch=3))
    ex.config._experts_implementation = name
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    weight = ex.gate_up_proj

    def fresh(scale):  # the same backward's gradient with nothing kept
        monkeypatch.setattr(moe, "_KEEP_GRADS", False)
        ex.zero_grad(set_to_none=True)
        g = experts_step(ex, h, idx, w, probe, scale)[0].clone()
        ex.zero_grad(set_to_none=True)
        monkeypatch.setattr(moe, "_KEEP_GRADS", True)
        return g

    want = {s: fresh(s) for s in (1.0, 0.5, 0.25, 2.0)}
    first = experts_step(ex, h, idx, w, probe, 1.0)[0].data_ptr()
    ex.zero_grad(set_to_none=True)
    assert experts_step(ex, h, idx, w, probe, 0.5)[0].data_ptr() == first  # free again: reused
    held = weight.grad  # the caller keeps this one
    ex.zero_grad(set_to_none=True)
    second = experts_step(ex, h, idx, w, probe, 0.25)[0]
    assert second.data_ptr() != first and torch.equal(held, want[0.5]) and torch.equal(second, want[0.25])
    # both buffers held (held, and the .grad that a second backward adds into): new memory
    third = experts_step(ex, h, idx, w, probe, 2.0)[0]
    assert third.data_ptr() == second.data_ptr() and torch.equal(held, want[0.5])
    assert torch.equal(third, want[0.25] + want[2.0])
    assert len(moe._grad_kept[weight]) == 2
    # torch.autograd.grad: the caller holds every result
    x = h.requires_grad_(False)
    results = [torch.autograd.grad((ex(x * s, idx, w).float() * probe).sum(), weight)[0] for s in (1.0, 0.5, 0.25)]
    assert all(torch.equal(r, want[s]) for r, s in zip(results, (1.0, 0.5, 0.25)))
    assert held.data_ptr() == first and len({r.data_ptr() for r in results} | {first, second.data_ptr()}) == 5
    # the buffers go with their weight
    ref = weakref.ref(weight)
    ex = m = weight = held = second = third = results = None
    import gc
    gc.collect()
    assert ref() is None and len(moe._grad_kept) == 0


@pytest.mark.parametrize("raw,keep", [("1", True), (" 0 ", False), ("yes", None), ("2", None), ("", None)])
def test_keep_grads_from_the_environment(sa, name, monkeypatch, raw, keep):
    """SCATTER_ADD_MOE_KEEP_GRADS=0 keeps no gradient buffer; a value other than 0 or 1 raises a
    ValueError naming the variable and the value at the training forward, before anything runs."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_KEEP_GRADS", None)
    monkeypatch.setenv("SCATTER_ADD_MOE_KEEP_GRADS", raw)
    m = build("mixtral", torch.bfloat16)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    ex.config._experts_implementation = name
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    if keep is None:
        with pytest.raises(ValueError, match=f"SCATTER_ADD_MOE_KEEP_GRADS.*{raw.strip()!r}"):
            experts_step(ex, h, idx, w, probe)
        assert all(p.grad is None for p in ex.parameters())
        return
    experts_step(ex, h, idx, w, probe)
    assert all(p.grad is not None for p in ex.parameters())
    assert (moe._grad_kept is not None and ex.gate_up_proj in moe._grad_kept) == keep


def test_kept_gradient_buffers_held_by_storage_or_in_shared_memory_are_not_written(sa, name, monkeypatch):
    """A kept gradient buffer whose storage object the caller holds is not written again until it
    is let go; one moved to shared memory (as torch.multiprocessing does for a gradient it sends,
    and Module.share_memory()) is never written again; release_gradient_buffers() drops them all."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_KEEP_GRADS", True)
    monkeypatch.setattr(moe, "_grad_kept", None)
    m = build("mixtral", torch.bfloat16)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    ex.config._experts_implementation = name
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    weight = ex.down_proj
    first = experts_step(ex, h, idx, w, probe, 1.0)[1]
    storage, snap, ptr = first.untyped_storage(), first.clone(), first.data_ptr()
    first = None
    ex.zero_grad(set_to_none=True)  # the .grad goes; its storage object stays with the caller
    second = experts_step(ex, h, idx, w, probe, 0.5)[1]
    assert second.data_ptr() != ptr
    assert torch.equal(torch.empty(0, dtype=snap.dtype).set_(storage, 0, snap.shape, snap.stride()), snap)
    storage = second = None
    ex.zero_grad(set_to_none=True)
    assert experts_step(ex, h, idx, w, probe, 0.25)[1].data_ptr() == ptr  # let go: written again
    weight.grad.share_memory_()
    shared = weight.grad.data_ptr()
    ex.zero_grad(set_to_none=True)
    again = experts_step(ex, h, idx, w, probe, 2.0)[1]
    assert again.data_ptr() != shared
    assert [b.untyped_storage().is_shared() for b, _ in moe._grad_kept[weight]] == [False]
    held = sum(p.numel() * p.element_size() for p in ex.parameters())
    assert moe.release_gradient_buffers() == held and moe._grad_kept is None
    assert moe.release_gradient_buffers() == 0
    ex.zero_grad(set_to_none=True)
    experts_step(ex, h, idx, w, probe)
    assert len(moe._grad_kept[weight]) == 1


def test_no_kept_gradient_buffers_without_the_storage_use_count(sa, name, monkeypatch):
    """On a torch without torch._C._storage_Use_Count a free buffer cannot be told from a held one:
    nothing is kept, and training works as with new memory."""
    moe = sa.moe
    monkeypatch.setattr(moe, "_KEEP_GRADS", None)
    monkeypatch.setattr(moe, "_grad_kept", None)
    monkeypatch.delenv("SCATTER_ADD_MOE_KEEP_GRADS", raising=False)
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    m = build("mixtral", torch.bfloat16)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    ex.config._experts_implementation = name
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    got = [g.clone() for g in experts_step(ex, h, idx, w, probe)]
    assert moe._KEEP_GRADS is False and moe._grad_kept is None
    ex.zero_grad(set_to_none=True)
    assert bitwise_equal(got, experts_step(ex, h, idx, w, probe))


def test_kept_gradient_buffers_are_laid_out_as_their_weight(sa, name, monkeypatch):
    """An expert weight stored transposed gets its gradient in its own layout (which autograd takes
    over as the .grad without a copy), the same bits as with nothing kept, and the buffer again on
    the next step."""
    moe = sa.moe
    m = build("mixtral", torch.bfloat16)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens())
    ex.config._experts_implementation = name
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ex.down_proj = torch.nn.Parameter(ex.down_proj.detach().transpose(1, 2).contiguous().transpose(1, 2))
    weight = ex.down_proj
    assert not weight.is_contiguous()
    monkeypatch.setattr(moe, "_KEEP_GRADS", False)
    want = experts_step(ex, h, idx, w, probe)[1].clone()
    monkeypatch.setattr(moe, "_KEEP_GRADS", True)
    ptrs = []
    for _ in range(2):
        ex.zero_grad(set_to_none=True)
        got = experts_step(ex, h, idx, w, probe)[1]
        assert got.stride() == weight.stride() and torch.equal(got, want)
        ptrs.append(got.data_ptr())
        got = None  # held, it would keep its buffer busy
    assert ptrs[0] == ptrs[1] and ptrs[0] == moe._grad_kept[weight][0][0].data_ptr()


def test_no_kept_gradient_buffers_under_a_dispatch_mode(sa, name, monkeypatch):
    """Under a dispatch mode (a tracer, a FLOP counter) nothing is kept: the grouped backward makes
    the weight gradients with torch's grouped products, as with keeping off (the same bits; a mode
    also turns off paths that torch's ops would not show it, so a step without it is no
    reference), and leaves no buffer for the weights."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    moe = sa.moe
    monkeypatch.setattr(moe, "_GROUPED_BACKWARD", True)
    monkeypatch.setattr(moe, "_grad_kept", None)
    m = build("mixtral", torch.bfloat16, wide=True)
    ex, (h, idx, w) = capture_experts_inputs(m, tokens(n=64, batch=3))
    ex.config._experts_implementation = name
    probe = torch.randn(h.shape, generator=torch.Generator().manual_seed(5))
    got = {}
    for keep in (False, True):
        monkeypatch.setattr(moe, "_KEEP_GRADS", keep)
        ex.zero_grad(set_to_none=True)
        x = h.clone().requires_grad_(True)
        loss = (ex(x, idx, w).float() * probe).sum()
        with Record() as rec:  # the backward's ops (the forward makes its products block by block)
            loss.backward()
        got[keep] = [p.grad.clone() for p in ex.parameters()]
        assert torch.ops.aten.mm.out not in rec.ops
        assert sum(f is torch.ops.aten._grouped_mm.default for f in rec.ops) == 4  # grad_a, grad_x, the weights
    assert bitwise_equal(got[False], got[True])
    assert moe._grad_kept is None or all(moe._grad_kept.get(p) is None for p in ex.parameters())
