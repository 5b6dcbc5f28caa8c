"""Pipeline schedules as data: every generator's schedule validates, broken
ones are refused with the rank, item and action named, and the simulated
bubbles equal the known formulas."""
from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stepfx.runtime.pipeline_schedule import (
    Action, CommBatch, Schedule, ScheduleError, StageCosts, build, gpipe, interleaved_1f1b, one_f_one_b,
    predicted_bubble, simulate, timeline, validate, zero_bubble_h1)

FAST = settings(max_examples=25, deadline=None)


def _parse(row: str) -> tuple:
    """One rank's items in Schedule.__str__'s notation: ``F0.1 [SEND_F0.1 RECV_B0.0] B0.0``."""
    def action(token: str) -> Action:
        kind, stage, micro = re.fullmatch(r"([A-Z_]+?)(\d+)\.(\d+)", token).groups()
        return Action(kind, int(stage), int(micro))
    return tuple(CommBatch(tuple(map(action, t[1:-1].split()))) if t.startswith("[") else action(t)
                 for t in re.findall(r"\[[^\]]*\]|\S+", row))


def _schedule(*rows: str, micro_batches: int, split: bool = False) -> Schedule:
    """A hand-written schedule, one stage per rank."""
    ranks = len(rows)
    return Schedule("hand", ranks, ranks, micro_batches, tuple(range(ranks)), tuple(map(_parse, rows)), split)


def _replace(schedule: Schedule, rank: int, items: tuple) -> Schedule:
    program = list(schedule.program)
    program[rank] = tuple(items)
    return dataclasses.replace(schedule, program=tuple(program))


def _index(schedule: Schedule, rank: int, action: Action) -> int:
    return next(i for i, item in enumerate(schedule.program[rank])
                if action == item or isinstance(item, CommBatch) and action in item.actions)


def _comm(schedule: Schedule) -> list[Action]:
    return [a for items in schedule.program for item in items if isinstance(item, CommBatch) for a in item.actions]


# --- every generator's schedule is valid ---

@st.composite
def _shapes(draw, interleaved: bool = False):
    ranks = draw(st.integers(1, 8))
    if not interleaved:
        return ranks, 1, draw(st.integers(1, 16))
    # micro_batches must be a multiple of ranks (Megatron's requirement)
    return ranks, draw(st.integers(1, 3)), ranks * draw(st.integers(1, max(1, 16 // ranks)))


def _check_layout(schedule: Schedule, name: str, ranks: int, virtual: int, micro_batches: int, split: bool) -> None:
    assert (schedule.name, schedule.ranks, schedule.stages, schedule.micro_batches, schedule.split_backward) == \
        (name, ranks, ranks * virtual, micro_batches, split)
    assert schedule.stage_rank == tuple(s % ranks for s in range(ranks * virtual))
    assert [schedule.stages_of(r) for r in range(ranks)] == \
        [tuple(range(r, ranks * virtual, ranks)) for r in range(ranks)]
    backward = ("BI", "BW") if split else ("B",)
    compute = [a for items in schedule.program for a in items if isinstance(a, Action)]
    assert sorted(compute, key=str) == sorted((Action(k, s, m) for s in range(ranks * virtual)
                                               for m in range(micro_batches) for k in ("F",) + backward), key=str)


@FAST
@given(_shapes())
def test_gpipe_one_f_one_b_and_zero_bubble_validate(shape):
    ranks, _, micro_batches = shape
    for make, name, split in ((gpipe, "gpipe", False), (one_f_one_b, "1f1b", False),
                              (zero_bubble_h1, "zero_bubble", True)):
        schedule = make(ranks, micro_batches)
        validate(schedule)
        _check_layout(schedule, name, ranks, 1, micro_batches, split)
        assert build(name, ranks, micro_batches) == schedule


@FAST
@given(_shapes(interleaved=True))
def test_interleaved_validates(shape):
    ranks, virtual, micro_batches = shape
    schedule = interleaved_1f1b(ranks, virtual, micro_batches)
    validate(schedule)
    _check_layout(schedule, "interleaved_1f1b", ranks, virtual, micro_batches, False)
    assert build("interleaved_1f1b", ranks, micro_batches, virtual) == schedule


def test_one_rank_has_no_communication_and_hands_virtual_stages_over_locally():
    for schedule in (gpipe(1, 3), one_f_one_b(1, 3), zero_bubble_h1(1, 3), interleaved_1f1b(1, 3, 2)):
        validate(schedule)
        assert _comm(schedule) == [] and all(isinstance(i, Action) for i in schedule.program[0])
    # the local hand-off is still ordered: stage 1's forward needs stage 0's, on the same rank
    schedule = interleaved_1f1b(1, 2, 1)
    items = list(schedule.program[0])
    first, second = _index(schedule, 0, Action("F", 0, 0)), _index(schedule, 0, Action("F", 1, 0))
    items[first], items[second] = items[second], items[first]
    with pytest.raises(ScheduleError, match=r"rank 0, item 0 F\(stage 1, micro 0\).*needs F\(stage 0, micro 0\)"):
        validate(_replace(schedule, 0, items))


def test_steady_one_f_one_b_sends_forward_and_receives_backward_together():
    schedule = one_f_one_b(4, 8)
    batches = [i for i in schedule.program[1] if isinstance(i, CommBatch)]
    assert CommBatch((Action("RECV_B", 1, 1), Action("SEND_F", 1, 3))) in batches
    assert schedule.peer(Action("RECV_B", 1, 1)) == schedule.peer(Action("SEND_F", 1, 3)) == 2
    assert schedule.peer(Action("SEND_B", 1, 1)) == schedule.peer(Action("RECV_F", 1, 3)) == 0
    # interleaved stages wrap around: the last rank's first stage feeds rank 0's second stage
    ring = interleaved_1f1b(2, 2, 2)
    assert ring.peer(Action("SEND_F", 1, 0)) == 0 and ring.peer(Action("RECV_F", 2, 0)) == 1


def test_bad_arguments_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"multiple of ranks.*micro_batches=6, ranks=4"):
        interleaved_1f1b(4, 2, 6)
    with pytest.raises(ValueError, match=r"unknown pipeline schedule 'pipedream'.*gpipe, 1f1b, interleaved_1f1b"):
        build("pipedream", 2, 4)
    with pytest.raises(ValueError, match=r"virtual=2: virtual stages are for 'interleaved_1f1b' only, not '1f1b'"):
        build("1f1b", 2, 4, virtual=2)
    with pytest.raises(ValueError, match=r"ranks must be a positive integer, got 0"):
        one_f_one_b(0, 4)
    with pytest.raises(ValueError, match=r"micro_batches must be a positive integer, got 2.5"):
        gpipe(2, 2.5)
    assert issubclass(ScheduleError, ValueError)


# --- broken schedules are refused ---

def test_the_parse_helper_reads_what_the_schedule_prints():
    schedule = zero_bubble_h1(3, 4)
    rows = [line.split(": ", 1)[1] for line in str(schedule).splitlines()[1:]]
    assert tuple(map(_parse, rows)) == schedule.program


def test_a_dropped_send_is_refused():
    schedule = one_f_one_b(2, 2)
    send = Action("SEND_F", 0, 1)
    i = _index(schedule, 0, send)
    items = list(schedule.program[0])
    items[i] = CommBatch(tuple(a for a in items[i].actions if a != send))
    with pytest.raises(ScheduleError, match=r"rank 1, item \d+ .*RECV_F\(stage 1, micro 1\) has no partner: "
                                            r"rank 0 has no SEND_F\(stage 0, micro 1\)"):
        validate(_replace(schedule, 0, items))


def test_a_dropped_receive_is_refused():
    schedule = gpipe(3, 2)
    receive = Action("RECV_B", 0, 0)
    i, b = _index(schedule, 0, receive), _index(schedule, 0, Action("B", 0, 0))
    items = list(schedule.program[0])
    items[i] = CommBatch(tuple(a for a in items[i].actions if a != receive))
    with pytest.raises(ScheduleError, match=rf"rank 0, item {b} B\(stage 0, micro 0\): B\(stage 0, micro 0\) needs "
                                            r"RECV_B\(stage 0, micro 0\) in an earlier item of rank 0; there is none"):
        validate(_replace(schedule, 0, items))


def test_a_swap_that_breaks_a_data_dependency_is_refused():
    schedule = zero_bubble_h1(2, 3)
    items = list(schedule.program[1])
    bi, bw = _index(schedule, 1, Action("BI", 1, 0)), _index(schedule, 1, Action("BW", 1, 0))
    items[bi], items[bw] = items[bw], items[bi]
    with pytest.raises(ScheduleError, match=rf"rank 1, item {bi} BW\(stage 1, micro 0\): .*needs BI\(stage 1, "
                                            rf"micro 0\) in an earlier item of rank 1; it is at item {bw}"):
        validate(_replace(schedule, 1, items))
    # a send before the forward that produces it
    items = list(schedule.program[0])
    assert isinstance(items[0], Action) and items[1] == CommBatch((Action("SEND_F", 0, 0),))
    items[0], items[1] = items[1], items[0]
    with pytest.raises(ScheduleError, match=r"rank 0, item 0 \[SEND_F\(stage 0, micro 0\)\]: .*needs F\(stage 0, "
                                            r"micro 0\)"):
        validate(_replace(schedule, 0, items))


def test_sends_in_another_order_than_the_receives_are_refused():
    ok = ("F0.0 F0.1 [SEND_F0.0] [SEND_F0.1] [RECV_B0.0] B0.0 [RECV_B0.1] B0.1",
          "[RECV_F1.0] [RECV_F1.1] F1.0 F1.1 B1.0 [SEND_B1.0] B1.1 [SEND_B1.1]")
    validate(_schedule(*ok, micro_batches=2))
    swapped = ok[0].replace("[SEND_F0.0] [SEND_F0.1]", "[SEND_F0.1] [SEND_F0.0]")
    with pytest.raises(ScheduleError, match=r"rank 0, item 2 \[SEND_F\(stage 0, micro 1\)\]: SEND_F\(stage 0, "
                                            r"micro 1\) is rank 0's message 0 to rank 1, but rank 1's receive 0 "
                                            r"from rank 0 is RECV_F\(stage 1, micro 0\) \(rank 1, item 0"):
        validate(_schedule(swapped, ok[1], micro_batches=2))
    # within one batch the tuple order counts
    batched = ok[0].replace("[SEND_F0.0] [SEND_F0.1]", "[SEND_F0.1 SEND_F0.0]")
    with pytest.raises(ScheduleError, match=r"message 0 to rank 1"):
        validate(_schedule(batched, ok[1], micro_batches=2))
    validate(_schedule(batched.replace("SEND_F0.1 SEND_F0.0", "SEND_F0.0 SEND_F0.1"), ok[1], micro_batches=2))


def test_two_ranks_receiving_before_sending_deadlock():
    rank0 = "F0.0 F0.1 [SEND_F0.0] [RECV_B0.0] [SEND_F0.1] B0.0 [RECV_B0.1] B0.1"
    rank1 = "[RECV_F1.0] F1.0 B1.0 [RECV_F1.1] [SEND_B1.0] F1.1 B1.1 [SEND_B1.1]"
    with pytest.raises(ScheduleError, match=r"deadlock under rendezvous semantics: ranks \[0, 1\] .*"
                                            r"rank 0, item 3 \[RECV_B\(stage 0, micro 0\)\] waits for rank 1 to "
                                            r"post item 4 \[SEND_B\(stage 1, micro 0\)\]"):
        validate(_schedule(rank0, rank1, micro_batches=2))
    # posting the receive and the send together breaks the cycle
    validate(_schedule(rank0, rank1.replace("[RECV_F1.1] [SEND_B1.0]", "[RECV_F1.1 SEND_B1.0]"), micro_batches=2))


def test_splitting_a_generated_exchange_receive_first_deadlocks():
    schedule = one_f_one_b(2, 3)
    # rank 1 receives micro-batch 1's input before it sends micro-batch 0's gradient, as separate items
    assert _index(schedule, 1, Action("RECV_F", 1, 1)) < _index(schedule, 1, Action("SEND_B", 1, 0))
    items = list(schedule.program[0])
    i = _index(schedule, 0, Action("RECV_B", 0, 0))
    assert items[i] == CommBatch((Action("SEND_F", 0, 1), Action("RECV_B", 0, 0)))
    send, receive = (CommBatch((a,)) for a in items[i].actions)
    with pytest.raises(ScheduleError, match=rf"deadlock under rendezvous semantics: ranks \[0, 1\].*rank 0, item "
                                            rf"{i} \[RECV_B\(stage 0, micro 0\)\] waits for rank 1"):
        validate(_replace(schedule, 0, items[:i] + [receive, send] + items[i + 1:]))
    validate(_replace(schedule, 0, items[:i] + [send, receive] + items[i + 1:]))


def test_misplaced_duplicated_missing_and_needless_actions_are_refused():
    schedule = gpipe(2, 2)
    items = list(schedule.program[0])
    with pytest.raises(ScheduleError, match=r"rank 0, item 0 F\(stage 1, micro 0\): F\(stage 1, micro 0\) "
                                            r"belongs on rank 1"):
        validate(_replace(schedule, 0, [Action("F", 1, 0)] + items[1:]))
    with pytest.raises(ScheduleError, match=r"rank 0, item \d+ F\(stage 0, micro 0\): F\(stage 0, micro 0\) again "
                                            r"\(first at rank 0, item 0\)"):
        validate(_replace(schedule, 0, items + [Action("F", 0, 0)]))
    last_b = _index(schedule, 0, Action("B", 0, 1))
    with pytest.raises(ScheduleError, match=r"rank 0: B\(stage 0, micro 1\) is missing"):
        validate(_replace(schedule, 0, items[:last_b] + items[last_b + 1:]))
    with pytest.raises(ScheduleError, match=r"RECV_F\(stage 0, micro 0\) crosses no ranks"):
        validate(_replace(schedule, 0, [CommBatch((Action("RECV_F", 0, 0),))] + items))
    with pytest.raises(ScheduleError, match=r"rank 0, item 1 SEND_F\(stage 0, micro 0\): an item is a compute "
                                            r"Action"):
        validate(_replace(schedule, 0, [items[0], Action("SEND_F", 0, 0)] + items[2:]))
    with pytest.raises(ScheduleError, match=r"BI\(stage 0, micro 0\), but this schedule's backward is whole"):
        validate(_replace(schedule, 0, items + [Action("BI", 0, 0)]))


# --- timing ---

@FAST
@given(_shapes())
def test_gpipe_and_one_f_one_b_bubbles_and_memory(shape):
    p, _, m = shape
    for schedule in (gpipe(p, m), one_f_one_b(p, m)):
        assert predicted_bubble(schedule) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    assert simulate(gpipe(p, m)).peak_in_flight == (m,) * p
    assert simulate(one_f_one_b(p, m)).peak_in_flight == tuple(min(p - r, m) for r in range(p))


@FAST
@given(_shapes(interleaved=True))
def test_interleaving_divides_the_bubble_by_virtual(shape):
    p, v, m = shape
    bubble = predicted_bubble(interleaved_1f1b(p, v, m))
    # Megatron: the bubble is (p-1)/(v*m) of the ideal time
    assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    if p > 1 and v > 1:
        assert bubble < predicted_bubble(one_f_one_b(p, m))


@FAST
@given(_shapes())
def test_zero_bubble_h1_beats_one_f_one_b_in_one_f_one_b_memory(shape):
    p, _, m = shape
    zero, one = simulate(zero_bubble_h1(p, m)), simulate(one_f_one_b(p, m))
    if p > 1:
        assert zero.bubble < one.bubble
    if m >= p:  # Qi et al.: a bubble of (p-1)(F + BI - BW) per rank, here p-1 of 3m+p-1
        assert zero.bubble == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert zero.peak_in_flight[0] == one.peak_in_flight[0] == min(p, m)
    assert max(zero.peak_in_flight) == max(one.peak_in_flight)


def test_costs_per_stage_and_communication_time():
    costs = StageCosts(forward=(1, 1.5), backward_input=(1, 2), backward_weight=(0.5, 0.5), comm=0.2)
    sim = simulate(gpipe(2, 1), costs)
    # F0 [0, 1]; send/receive 0.2; F1 [1.2, 2.7]; B1 = 2 + 0.5 [2.7, 5.2]; send/receive 0.2; B0 = 1.5 -> 6.9
    assert sim.makespan == pytest.approx(6.9)
    assert sim.busy == pytest.approx((2.5, 4.0))
    assert sim.bubble == pytest.approx(1 - 6.5 / (2 * 6.9))
    assert sim.end[1][sim.schedule.program[1].index(Action("F", 1, 0))] == pytest.approx(2.7)
    with pytest.raises(ValueError, match="one value per stage"):
        StageCosts((1, 1), (1,), (1, 1))
    with pytest.raises(ValueError, match="StageCosts has 3 stages, the schedule 2"):
        simulate(gpipe(2, 1), StageCosts.uniform(3))


def test_simulate_refuses_a_broken_schedule():
    schedule = gpipe(2, 1)
    with pytest.raises(ScheduleError):
        simulate(_replace(schedule, 1, schedule.program[1][1:]))


# --- the timeline ---

def _rows(text: str) -> list[str]:
    return [line.split("|")[1] for line in text.splitlines() if line.startswith("rank ")]


def test_timeline_draws_each_rank_and_the_bubble():
    schedule = one_f_one_b(4, 8)
    text = timeline(schedule)
    rows = _rows(text)
    assert len(rows) == 4 and len({len(r) for r in rows}) == 1 and len(rows[0]) <= 100
    assert rows[0].startswith("F0 F1 F2 F3 ") and rows[3].startswith(".........F0 B0")
    assert re.search(r"B7 +$", rows[0]) and rows[3].endswith(".")  # rank 0 ends last, the last rank idles
    lines = text.splitlines()
    assert [line.endswith(f"peak {4 - r} in flight") for r, line in enumerate(lines[2:6])] == [True] * 4
    ruler, times = lines[-3:-1]
    assert ruler.strip().startswith("+") and ruler.endswith("+") and times.split()[0] == "0"
    # the ruler runs from under the rows' opening bar (time 0) to under their last column (its right edge)
    assert len(ruler) == len(lines[2].split("| peak")[0]) and ruler.index("+") == lines[2].index("|")
    assert text.splitlines()[-1] == "predicted bubble: 27.3% (busy 96 of 132 rank-time, makespan 33)"
    assert "I0" in timeline(zero_bubble_h1(2, 2)) and "W1" in timeline(zero_bubble_h1(2, 2))
    assert "F0a" in timeline(interleaved_1f1b(2, 2, 2)) and "B1b" in timeline(interleaved_1f1b(2, 2, 2))


def test_a_long_timeline_keeps_its_width_and_cuts_the_middle():
    text = timeline(one_f_one_b(8, 32), width=80)
    rows = _rows(text)
    assert len(rows) == 8 and all(len(r) == 80 and " ~~ " in r for r in rows)
    assert rows[7].startswith(".......F") and rows[0].startswith("FFFFFFFF.")
    assert "the middle" in text.splitlines()[0] and text.splitlines()[-1].startswith("predicted bubble: 17.9%")
    with pytest.raises(ValueError, match="at least 20 columns"):
        timeline(gpipe(2, 2), width=5)
