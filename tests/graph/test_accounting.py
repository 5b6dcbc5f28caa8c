"""estimate_memory: what allocates and what does not (the collectives)."""
from __future__ import annotations

import operator

import torch

from stepfx.graph import META_PHASE
from stepfx.graph.accounting import estimate_memory
from stepfx.graph.build import clone_step_graph
from stepfx.passes import PIPELINE, PassManager, PassOptions
from tests.steps import captured_mlp

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
BIG = 4_000_000  # elements: far above the MLP step's own peak, so the peak is where the bucket lives


def _final_mlp():
    """The MLP step after the pipeline: (graph, fx graph, its output node, a phase, a fake input) to append
    nodes before the output."""
    graph, *_ = captured_mlp()
    graph = clone_step_graph(PassManager(PIPELINE).run(graph, PassOptions())[-1].graph)
    g = graph.gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    phase = next(n for n in g.nodes if n.op == "call_function").meta[META_PHASE]
    fake = next(n for n in g.nodes if n.op == "placeholder").meta["val"]
    return graph, g, out, phase, fake


def _with_bucket(all_reduce_op):
    """The final MLP graph with, just before its output, a BIG fp32 bucket
    all-reduced by ``all_reduce_op``, waited for and read by a sum."""
    graph, g, out, phase, fake = _final_mlp()
    with g.inserting_before(out):
        bucket = g.call_function(aten.zeros.default, ([BIG],), {"dtype": torch.float32})
        reduced = g.call_function(all_reduce_op, (bucket, "sum", "0"))
        done = g.call_function(c10d.wait_tensor.default, (reduced,))
        total = g.call_function(aten.sum.default, (done,))
    with fake.fake_mode:
        big = torch.empty(BIG, dtype=torch.float32)
        small = torch.empty((), dtype=torch.float32)
    for node, val in ((bucket, big), (reduced, big), (done, big), (total, small)):
        node.meta.update(val=val, **{META_PHASE: phase})
    graph.gm.recompile()
    return graph


def test_in_place_all_reduce_and_its_wait_allocate_nothing():
    est = estimate_memory(_with_bucket(c10d.all_reduce_.default))
    # the bucket once (not 3x): the in-place collective and the wait are the bucket itself
    assert est.resident + 4 * BIG <= est.peak < est.resident + 4 * BIG + 4 * BIG // 4
    assert est.peak_node.startswith(("zeros", "all_reduce_", "wait_tensor", "sum"))


def test_out_of_place_all_reduce_holds_input_and_result():
    in_place = estimate_memory(_with_bucket(c10d.all_reduce_.default)).peak
    out_of_place = estimate_memory(_with_bucket(c10d.all_reduce.default)).peak
    # the clone: a second buffer while the input is still read (less the 4-byte sum, counted after it in place)
    assert abs(out_of_place - in_place - 4 * BIG) <= 8


def test_each_result_of_a_multi_output_op_is_freed_after_its_own_last_reader():
    # aten.var_mean's BIG variance is read at once, its 1-element mean at the very end (as cat_column_sum's
    # [tokens, 3d] gradient and its [3d] bias sum, which waits for the gradient bucket): the big result is freed
    # after its reader, not kept alive by the small one (the 13B plan was over-predicted ~2 GiB a block by that)
    graph, g, out, phase, fake = _final_mlp()
    with g.inserting_before(out):
        x = g.call_function(aten.zeros.default, ([2, BIG],), {"dtype": torch.float32})
        both = g.call_function(aten.var_mean.correction, (x, [0]), {"keepdim": False})
        var = g.call_function(operator.getitem, (both, 0))
        mean = g.call_function(operator.getitem, (both, 1))
        var_sum = g.call_function(aten.sum.default, (var,))
        later = g.call_function(aten.zeros.default, ([3, BIG],), {"dtype": torch.float32})  # while only the mean lives
        later_sum = g.call_function(aten.sum.default, (later,))
        mean_sum = g.call_function(aten.sum.default, (mean,))
    with fake.fake_mode:
        vals = {x: torch.empty(2, BIG), both: (torch.empty(BIG), torch.empty(BIG)), var: torch.empty(BIG),
                mean: torch.empty(BIG), var_sum: torch.empty(()), later: torch.empty(3, BIG),
                later_sum: torch.empty(()), mean_sum: torch.empty(())}
    for node, val in vals.items():
        node.meta.update(val=val, **{META_PHASE: phase})
    graph.gm.recompile()
    est = estimate_memory(graph)
    # bytes: at var_mean x (8 BIG) + var + mean (8 BIG); at ``later`` the mean (4 BIG) and ``later`` (12 BIG): 16
    # both; 20 where the var were kept alive by the mean
    assert est.resident + 16 * BIG <= est.peak < est.resident + 16 * BIG + 4 * BIG // 4, (est.peak - est.resident) / BIG
