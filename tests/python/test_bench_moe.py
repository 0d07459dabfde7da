"""benchmarks/bench_moe.py, the MoE-layer half of `make bench`, at its smallest: one Mixtral row of
each mode runs, its split and the products timed alone come out, the goal lines name the
products' share where a goal is missed, and the plot is written."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import ROOT  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_moe  # noqa: E402


class Quiet:
    def __init__(self, total, label):
        self.steps = 0

    def step(self, what):
        self.steps += 1


@pytest.fixture(scope="module")
def rows(sa):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        bench = bench_moe.MoEBench(sa, sizes={"mixtral": ([8], [8])})
        return bench, bench.run(Quiet)
    finally:
        torch.set_num_threads(threads)


def test_a_row_of_each_mode_with_its_split_and_products(rows):
    _, got = rows
    assert [(r["mode"], r["tokens"]) for r in got] == [("fwd", 8), ("fwd_bwd", 8)]
    for r in got:
        assert set(r["split_ms"]) == {"dispatch", "experts", "combine"}
        assert all(v > 0 for v in r["split_ms"].values())
        # the products are a part of the experts part: within the noise of two timings of it
        assert 0 < r["products_ms"] < 2 * r["split_ms"]["experts"]
        assert r["impls"]["ours"]["ms"] > 0 and r["speedup"] > 0


def test_goal_lines_name_the_products_share_of_rows_below_a_goal(rows, capsys):
    bench, got = rows
    slow = [dict(r, speedup=0.5) for r in got]
    bench.print_goals(slow)
    out = capsys.readouterr().out
    share = slow[0]["products_ms"] / sum(slow[0]["split_ms"].values())
    assert f"mixtral 8 {share:.0%}" in out
    assert out.count("rows below it") == 2
    bench.print_goals([dict(r, speedup=5.0) for r in got])
    assert "rows below it" not in capsys.readouterr().out


def test_bars_split_the_experts_part(rows):
    _, got = rows
    r = dict(got[0], split_ms=dict(dispatch=1.0, experts=10.0, combine=2.0), products_ms=7.5)
    assert [bench_moe.split_part(r, p) for p in bench_moe.SPLIT_COLORS] == [1.0, 7.5, 2.5, 2.0]
    r["products_ms"] = 12.0  # timed alone above its part: the whole part
    assert [bench_moe.split_part(r, p) for p in bench_moe.SPLIT_COLORS] == [1.0, 10.0, 0.0, 2.0]
    del r["products_ms"]  # a saved run from before
    assert [bench_moe.split_part(r, p) for p in bench_moe.SPLIT_COLORS] == [1.0, 10.0, 0.0, 2.0]


def test_the_plot_is_written(rows, tmp_path):
    pytest.importorskip("matplotlib")
    _, got = rows
    files = bench_moe.plot_moe(got, tmp_path, {"cpu": "test", "cpus": 1, "threads": 1, "torch": torch.__version__,
                                               "date": "today"})
    assert len(files) == 1 and Path(files[0]).stat().st_size > 10_000
