"""Expert-parallel MoE over torch.distributed (gloo, loopback only) with 2 and 4 processes, on
transformers' Mixtral block: the layer's output on every rank equals the block's own experts in
one process to float64 tolerance, for static capacity (with dropped pairs), dropless splits, and a
routing that sends every token to one rank; and every transfer has let go of its tensors when it
returns."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from distributed_worker import CASES


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4], ids=lambda w: f"{w}_ranks")
def test_distributed_expert_parallel_matches_single_process(tmp_path, world):
    """Every (mode, case) of distributed_worker.CASES in one launch of `world` ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
           str(ROOT / "tests" / "python" / "distributed_worker.py"), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for mode, case in CASES:
        results = [json.loads((tmp_path / f"{mode}-{case}-rank{i}.json").read_text()) for i in range(world)]
        for res in results:
            assert res["world"] == world, (mode, case, res)
            assert res["max_out"] > 0, (mode, case, res)
            assert res["max_diff"] <= 1e-12 * max(1.0, res["max_out"]), (mode, case, res)
        if (mode, case) == ("static", "one_rank"):  # 80 pairs into two experts' slots: most dropped
            assert all(res["dropped"] > 0 for res in results), results
    for i in range(world):
        for group, counts in json.loads((tmp_path / f"transfers-rank{i}.json").read_text()).items():
            assert counts == [[1, 1]] * len(counts), (i, group, counts)
        assert json.loads((tmp_path / f"compiled-rank{i}.json").read_text())["same"], i
        errors = json.loads((tmp_path / f"uneven-rank{i}.json").read_text())
        assert errors["error"] is not None and "same slots per expert on every rank" in errors["error"], (i, errors)
        shape = errors["shape_error"]
        assert shape is not None and ("got shape (8, 2)" in shape if i == world - 1 else "another rank" in shape), \
            (i, shape)


def test_capacity_queues_pairs_in_token_order():
    """Static capacity's slots by hand: pairs claim their expert's slots in token order, then
    choice order; with 2 slots per expert, token 2's first choice and both of token 3's find
    their experts full."""
    from expert_parallel import capacity_keep, capacity_slots

    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])
    keep = capacity_keep(experts, 3, 2)
    assert keep.tolist() == [[True, True], [True, True], [False, True], [False, False]]
    slot_token, slot_weight = capacity_slots(experts, weights, 3, 2)
    assert slot_token.tolist() == [0, 1, 0, 2, 1, -1]  # expert 0: tokens 0, 1; 1: 0, 2; 2: 1, empty
    assert slot_weight.tolist() == pytest.approx([0.6, 0.7, 0.4, 0.5, 0.3, 0.0])
