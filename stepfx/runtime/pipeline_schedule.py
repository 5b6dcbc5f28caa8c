"""Pipeline-parallel schedules as data: what each rank computes and sends, in order.

A ``Schedule`` is a plain value. Per rank it lists compute actions (``F``;
``B``, or ``BI`` then ``BW`` when the backward is split) and communication
batches (``CommBatch``: sends and receives posted together, as
``batch_isend_irecv`` does, and all waited before the rank's next item).
The pipeline executor runs it; this module makes it (``gpipe``,
``one_f_one_b``, ``interleaved_1f1b``, ``zero_bubble_h1``, ``build``),
proves it right (``validate``) and times it (``simulate``, ``timeline``).

Conventions the executor relies on:

- stage ``s`` runs on rank ``stage_rank[s]``; stage ``s``'s input is stage
  ``s-1``'s output, the last stage computes the loss;
- ``SEND_F(s, m)`` is received as ``RECV_F(s+1, m)``, ``SEND_B(s, m)`` (the
  gradient of stage ``s``'s input) as ``RECV_B(s-1, m)``;
- a hand-off between two consecutive stages on the same rank (only one rank
  with several virtual stages) is local: no SEND/RECV, the producer's compute
  comes earlier in the rank's program;
- communication is always inside a ``CommBatch``; compute never is.

The communication model is rendezvous, the strictest one: a send may wait
until its receive is posted, and a receive until its send is. An item is
posted when the rank's previous item has ended, so a ``CommBatch`` ends when
every item holding one of its partners has been posted. ``validate`` proves
that a schedule finishes under that model; ``simulate`` times it under it.
"""
from __future__ import annotations

import bisect
import math
import statistics
from dataclasses import dataclass
from typing import Union

import networkx as nx

__all__ = ["KINDS", "SCHEDULES", "Action", "CommBatch", "Schedule", "ScheduleError", "StageCosts", "Simulation",
           "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1", "build", "validate", "simulate",
           "predicted_bubble", "timeline"]

KINDS = ("F", "B", "BI", "BW", "SEND_F", "RECV_F", "SEND_B", "RECV_B")
COMPUTE_KINDS = ("F", "B", "BI", "BW")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class Action:
    """One compute or communication step of ``stage`` on micro-batch ``micro`` (see the module docstring)."""
    kind: str
    stage: int
    micro: int

    def __str__(self) -> str:
        return f"{self.kind}(stage {self.stage}, micro {self.micro})"


@dataclass(frozen=True)
class CommBatch:
    """Sends and receives posted together; the rank waits for all of them before its next item."""
    actions: tuple[Action, ...]

    def __str__(self) -> str:
        return "[" + ", ".join(map(str, self.actions)) + "]"


Item = Union[Action, CommBatch]


@dataclass(frozen=True)
class Schedule:
    """Every rank's program over ``micro_batches`` micro-batches, in execution order."""
    name: str
    ranks: int
    stages: int
    micro_batches: int
    stage_rank: tuple[int, ...]
    program: tuple[tuple[Item, ...], ...]
    split_backward: bool

    @property
    def virtual(self) -> int:
        """Stages per rank."""
        return self.stages // self.ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages rank ``rank`` runs, in stage order."""
        return tuple(s for s, r in enumerate(self.stage_rank) if r == rank)

    def peer(self, action: Action) -> int:
        """The rank at the other end of communication action ``action``."""
        return self.stage_rank[_partner(action).stage]

    def __str__(self) -> str:
        def short(a: Action) -> str:
            return f"{a.kind}{a.stage}.{a.micro}"
        lines = [f"{self.name}: {self.ranks} ranks, {self.stages} stages, {self.micro_batches} micro-batches "
                 "(KIND<stage>.<micro>; [ ] a communication batch)"]
        for rank, items in enumerate(self.program):
            text = " ".join(short(i) if isinstance(i, Action) else "[" + " ".join(map(short, i.actions)) + "]"
                            for i in items)
            lines.append(f"rank {rank}: {text}")
        return "\n".join(lines)


class ScheduleError(ValueError):
    """A schedule that would compute the wrong thing, mismatch NCCL's point-to-point order, or deadlock."""


# --- what each action needs and what it talks to (one place: generators and validate both use it) ---

def _remote(stage_rank: tuple[int, ...], a: int, b: int) -> bool:
    return stage_rank[a] != stage_rank[b]


def _receives(a: Action, stage_rank: tuple[int, ...]) -> list[Action]:
    """The receives compute action ``a`` waits for."""
    last = len(stage_rank) - 1
    if a.kind == "F" and a.stage > 0 and _remote(stage_rank, a.stage - 1, a.stage):
        return [Action("RECV_F", a.stage, a.micro)]
    if a.kind in ("B", "BI") and a.stage < last and _remote(stage_rank, a.stage, a.stage + 1):
        return [Action("RECV_B", a.stage, a.micro)]
    return []


def _sends(a: Action, stage_rank: tuple[int, ...]) -> list[Action]:
    """The sends compute action ``a`` feeds."""
    last = len(stage_rank) - 1
    if a.kind == "F" and a.stage < last and _remote(stage_rank, a.stage, a.stage + 1):
        return [Action("SEND_F", a.stage, a.micro)]
    if a.kind in ("B", "BI") and a.stage > 0 and _remote(stage_rank, a.stage - 1, a.stage):
        return [Action("SEND_B", a.stage, a.micro)]
    return []


def _prerequisites(a: Action, stage_rank: tuple[int, ...], split: bool) -> list[Action]:
    """Actions that must sit in an earlier item of the same rank's program than ``a``."""
    last, s, m = len(stage_rank) - 1, a.stage, a.micro
    grad = "BI" if split else "B"
    if a.kind == "F":
        if s > 0 and not _remote(stage_rank, s - 1, s):
            return [Action("F", s - 1, m)]
        return _receives(a, stage_rank)
    if a.kind in ("B", "BI"):
        if s < last and not _remote(stage_rank, s, s + 1):
            return [Action("F", s, m), Action(a.kind, s + 1, m)]
        return [Action("F", s, m)] + _receives(a, stage_rank)
    if a.kind == "BW":
        return [Action("BI", s, m)]
    if a.kind == "SEND_F":
        return [Action("F", s, m)]
    if a.kind == "SEND_B":
        return [Action(grad, s, m)]
    return []


def _needed(a: Action, stage_rank: tuple[int, ...]) -> bool:
    """Whether communication action ``a`` crosses ranks (a schedule has exactly the ones that do)."""
    compute = Action("F" if a.kind.endswith("F") else "B", a.stage, a.micro)
    return a in (_sends(compute, stage_rank) if a.kind.startswith("SEND") else _receives(compute, stage_rank))


def _partner(a: Action) -> Action:
    """The other end of communication action ``a``."""
    kind, step = {"SEND_F": ("RECV_F", 1), "RECV_F": ("SEND_F", -1), "SEND_B": ("RECV_B", -1),
                  "RECV_B": ("SEND_B", 1)}[a.kind]
    return Action(kind, a.stage + step, a.micro)


def _message(a: Action, stage_rank: tuple[int, ...]) -> tuple[int, int, Action]:
    """(source rank, destination rank, the send) of communication action ``a``."""
    send = a if a.kind.startswith("SEND") else _partner(a)
    return stage_rank[send.stage], stage_rank[_partner(send).stage], send


def _actions(item: Item) -> tuple[Action, ...]:
    return item.actions if isinstance(item, CommBatch) else (item,)


# --- generators ---

def _positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _assemble(name: str, ranks: int, virtual: int, micro_batches: int, compute: list[list[Action]],
              split: bool) -> Schedule:
    """Place the communication of each rank's compute order.

    Under rendezvous semantics a message passes only while both its ranks
    sit between two compute items, so this plays the schedule out in time
    (unit costs: F=1, BI=1, BW=1, B=2) and hands a message over at the first
    moment after its producer ends when its sender and its receiver are both
    between items (a receive may so come before the item that needs it).
    Whatever a rank exchanges between two compute items forms one CommBatch,
    in hand-over order (one moment's messages sorted the same way on both
    ranks, as NCCL's pairing needs). The played-out run is an execution of
    the result, so it cannot deadlock, and a rank waits for a busy partner
    only where they had no earlier moment in common. (Placing each receive
    just before its consumer, as a fixed rule, deadlocks or stalls the
    interleaved schedule: its neighbours are not in step.)"""
    stage_rank = tuple(s % ranks for s in range(ranks * virtual))
    costs = StageCosts.uniform(ranks * virtual)
    items: list[list[Item]] = [[] for _ in range(ranks)]
    batch: list[list[Action]] = [[] for _ in range(ranks)]
    nxt = [0] * ranks
    busy_until = [0.0] * ranks  # a rank is between items once time reaches it
    running: list[Action | None] = [None] * ranks
    pending: list[Action] = []  # sends whose producer has ended and whose receive is not posted
    received: set[Action] = set()
    now = 0.0
    while True:
        for r in range(ranks):
            if running[r] is not None and busy_until[r] <= now:
                pending += _sends(running[r], stage_rank)
                running[r] = None
        free = {r for r in range(ranks) if running[r] is None}
        for send in sorted(pending, key=lambda a: (a.kind, a.stage, a.micro)):
            src, dst = stage_rank[send.stage], stage_rank[_partner(send).stage]
            if src in free and dst in free:
                batch[src].append(send)
                batch[dst].append(_partner(send))
                received.add(_partner(send))
                pending.remove(send)
        for r in sorted(free):
            if nxt[r] < len(compute[r]) and all(rv in received for rv in _receives(compute[r][nxt[r]], stage_rank)):
                if batch[r]:
                    items[r].append(CommBatch(tuple(batch[r])))
                    batch[r] = []
                running[r] = compute[r][nxt[r]]
                items[r].append(running[r])
                nxt[r] += 1
                busy_until[r] = now + costs.of(running[r])
        if all(running[r] is None and nxt[r] == len(compute[r]) for r in range(ranks)) and not pending:
            break
        later = [busy_until[r] for r in range(ranks) if running[r] is not None]
        if not later:
            waiting = {r: compute[r][nxt[r]] for r in range(ranks) if nxt[r] < len(compute[r])}
            raise AssertionError(f"{name}: the compute orders wait for each other: {waiting}")
        now = min(later)
    for r in range(ranks):
        if batch[r]:
            items[r].append(CommBatch(tuple(batch[r])))
    return Schedule(name, ranks, ranks * virtual, micro_batches, stage_rank, tuple(map(tuple, items)), split)


def gpipe(ranks: int, micro_batches: int) -> Schedule:
    """Every forward, then every backward (GPipe): each rank holds all micro-batches' activations."""
    _positive(ranks=ranks, micro_batches=micro_batches)
    compute = [[Action("F", r, m) for m in range(micro_batches)] + [Action("B", r, m) for m in range(micro_batches)]
               for r in range(ranks)]
    return _assemble("gpipe", ranks, 1, micro_batches, compute, False)


def _one_f_one_b_order(rank: int, ranks: int, micro_batches: int, deferred_weights: int | None) -> list[Action]:
    """PipeDream-flush: ``ranks-1-rank`` warm-up forwards, then one forward and one backward in turn.

    With ``deferred_weights`` = d the backward is split and each BW waits
    until d later BIs have run (zero bubble H1)."""
    warmup = min(ranks - 1 - rank, micro_batches)
    order = [Action("F", rank, m) for m in range(warmup)]
    waiting: list[int] = []
    for m in range(micro_batches):
        if warmup + m < micro_batches:
            order.append(Action("F", rank, warmup + m))
        if deferred_weights is None:
            order.append(Action("B", rank, m))
            continue
        order.append(Action("BI", rank, m))
        waiting.append(m)
        if len(waiting) > deferred_weights:
            order.append(Action("BW", rank, waiting.pop(0)))
    order += [Action("BW", rank, m) for m in waiting]
    return order


def one_f_one_b(ranks: int, micro_batches: int) -> Schedule:
    """1F1B (PipeDream-flush): GPipe's bubble, at most ``min(ranks - rank, micro_batches)`` micro-batches in flight."""
    _positive(ranks=ranks, micro_batches=micro_batches)
    compute = [_one_f_one_b_order(r, ranks, micro_batches, None) for r in range(ranks)]
    return _assemble("1f1b", ranks, 1, micro_batches, compute, False)


def zero_bubble_h1(ranks: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with the backward split into BI and BW.

    BI alone is on the critical path, so gradients reach rank 0 sooner; rank
    ``r`` defers ``r`` weight gradients, which fill the bubbles of the
    cool-down. Rank r then holds at most ``ranks`` micro-batches (1F1B's
    ``ranks - r`` plus ``r``): 1F1B's peak, which is rank 0's."""
    _positive(ranks=ranks, micro_batches=micro_batches)
    compute = [_one_f_one_b_order(r, ranks, micro_batches, r) for r in range(ranks)]
    return _assemble("zero_bubble", ranks, 1, micro_batches, compute, True)


def interleaved_1f1b(ranks: int, virtual: int, micro_batches: int) -> Schedule:
    """Megatron's interleaved 1F1B: rank r runs stages r, r+ranks, ..., r+(virtual-1)*ranks.

    Micro-batches go through a rank's stages in groups of ``ranks``: forward
    number k of a rank is stage chunk ``(k // ranks) % virtual`` of micro-batch
    ``(k // (ranks*virtual)) * ranks + k % ranks``; backwards run the chunks in
    reverse. So ``micro_batches`` must be a multiple of ``ranks`` (Megatron's
    requirement). The bubble shrinks by ``virtual`` (Megatron: ``(p-1)/(v*m)``
    of the ideal time) for ``virtual`` times the point-to-point messages."""
    _positive(ranks=ranks, virtual=virtual, micro_batches=micro_batches)
    if micro_batches % ranks:
        raise ValueError(f"interleaved_1f1b needs micro_batches to be a multiple of ranks (micro-batches pass "
                         f"through each rank's stages in groups of ranks): micro_batches={micro_batches}, "
                         f"ranks={ranks}")
    total = micro_batches * virtual

    def action(kind: str, rank: int, k: int) -> Action:
        chunk = (k // ranks) % virtual
        if kind == "B":
            chunk = virtual - 1 - chunk
        return Action(kind, chunk * ranks + rank, (k // (ranks * virtual)) * ranks + k % ranks)

    compute = []
    for r in range(ranks):
        warmup = min((ranks - r - 1) * 2 + (virtual - 1) * ranks, total)  # Megatron's warm-up count
        order = [action("F", r, k) for k in range(warmup)]
        for k in range(total):
            if warmup + k < total:
                order.append(action("F", r, warmup + k))
            order.append(action("B", r, k))
        compute.append(order)
    return _assemble("interleaved_1f1b", ranks, virtual, micro_batches, compute, False)


def build(name: str, ranks: int, micro_batches: int, virtual: int = 1) -> Schedule:
    """The validated schedule called ``name`` (one of ``SCHEDULES``)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    if name != "interleaved_1f1b" and virtual != 1:
        raise ValueError(f"virtual={virtual!r}: virtual stages are for 'interleaved_1f1b' only, not {name!r}")
    if name == "gpipe":
        schedule = gpipe(ranks, micro_batches)
    elif name == "1f1b":
        schedule = one_f_one_b(ranks, micro_batches)
    elif name == "zero_bubble":
        schedule = zero_bubble_h1(ranks, micro_batches)
    else:
        schedule = interleaved_1f1b(ranks, virtual, micro_batches)
    validate(schedule)
    return schedule


# --- validation ---

def _where(rank: int, index: int, item: Item) -> str:
    return f"rank {rank}, item {index} {item}"


def _check_shape(schedule: Schedule) -> None:
    """Sizes agree, every item is well formed and every action sits on its stage's rank."""
    p, stages, mbs = schedule.ranks, schedule.stages, schedule.micro_batches
    if len(schedule.stage_rank) != stages or any(not 0 <= r < p for r in schedule.stage_rank):
        raise ScheduleError(f"stage_rank {schedule.stage_rank} must give each of the {stages} stages a rank "
                            f"in 0..{p - 1}")
    if len(schedule.program) != p:
        raise ScheduleError(f"the program has {len(schedule.program)} ranks' items, the schedule {p} ranks")
    for rank, items in enumerate(schedule.program):
        for i, item in enumerate(items):
            where = _where(rank, i, item)
            if isinstance(item, CommBatch):
                if not item.actions:
                    raise ScheduleError(f"{where}: an empty communication batch")
                if any(not isinstance(a, Action) or a.kind in COMPUTE_KINDS for a in item.actions):
                    raise ScheduleError(f"{where}: a communication batch holds only SEND_*/RECV_* actions")
            elif not isinstance(item, Action) or item.kind not in COMPUTE_KINDS:
                raise ScheduleError(f"{where}: an item is a compute Action (F, B, BI, BW) or a CommBatch of "
                                    "SEND_*/RECV_* actions")
            for a in _actions(item):
                if a.kind not in KINDS or not 0 <= a.stage < stages or not 0 <= a.micro < mbs:
                    raise ScheduleError(f"{where}: {a} is not an action of {stages} stages and {mbs} micro-batches")
                if a.kind in (("B",) if schedule.split_backward else ("BI", "BW")):
                    split = "split into BI and BW" if schedule.split_backward else "whole (B)"
                    raise ScheduleError(f"{where}: {a}, but this schedule's backward is {split}")
                if schedule.stage_rank[a.stage] != rank:
                    raise ScheduleError(f"{where}: {a} belongs on rank {schedule.stage_rank[a.stage]}, the rank "
                                        f"of stage {a.stage}")
                if a.kind not in COMPUTE_KINDS and not _needed(a, schedule.stage_rank):
                    raise ScheduleError(f"{where}: {a} crosses no ranks: nothing is sent there")


def _positions(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    seen: dict[Action, tuple[int, int]] = {}
    for rank, items in enumerate(schedule.program):
        for i, item in enumerate(items):
            for a in _actions(item):
                if a in seen:
                    raise ScheduleError(f"{_where(rank, i, item)}: {a} again (first at rank {seen[a][0]}, "
                                        f"item {seen[a][1]})")
                seen[a] = (rank, i)
    return seen


def _check_order(schedule: Schedule, pos: dict[Action, tuple[int, int]]) -> None:
    """Every action's inputs come earlier on its rank, every communication has its partner, nothing is missing."""
    sr = schedule.stage_rank
    for rank, items in enumerate(schedule.program):
        for i, item in enumerate(items):
            for a in _actions(item):
                for need in _prerequisites(a, sr, schedule.split_backward):
                    at = pos.get(need)
                    if at is None or at[1] >= i:
                        found = "there is none" if at is None else f"it is at item {at[1]}"
                        raise ScheduleError(f"{_where(rank, i, item)}: {a} needs {need} in an earlier item of "
                                            f"rank {rank}; {found}")
                if a.kind not in COMPUTE_KINDS and _partner(a) not in pos:
                    raise ScheduleError(f"{_where(rank, i, item)}: {a} has no partner: rank "
                                        f"{sr[_partner(a).stage]} has no {_partner(a)}")
    backward = ("BI", "BW") if schedule.split_backward else ("B",)
    for s in range(schedule.stages):
        for m in range(schedule.micro_batches):
            for kind in ("F",) + backward:
                if Action(kind, s, m) not in pos:
                    raise ScheduleError(f"rank {sr[s]}: {Action(kind, s, m)} is missing (at no item)")


def _check_matching(schedule: Schedule) -> None:
    """NCCL pairs point-to-point operations between two ranks in posting order: a's sends to b, in
    order, must be b's receives from a."""
    sr = schedule.stage_rank
    sends: dict[tuple[int, int], list] = {}
    receives: dict[tuple[int, int], list] = {}
    for rank, items in enumerate(schedule.program):
        for i, item in enumerate(items):
            for a in _actions(item):
                if a.kind in COMPUTE_KINDS:
                    continue
                src, dst, what = _message(a, sr)
                side = sends if a.kind.startswith("SEND") else receives
                side.setdefault((src, dst), []).append((what, rank, i, item, a))
    for (src, dst), sent in sorted(sends.items()):
        for n, (s, r) in enumerate(zip(sent, receives.get((src, dst), []))):
            if s[0] != r[0]:
                raise ScheduleError(f"{_where(*s[1:4])}: {s[4]} is rank {src}'s message {n} to rank {dst}, "
                                    f"but rank {dst}'s receive {n} from rank {src} is {r[4]} "
                                    f"({_where(*r[1:4])}): NCCL would pair them")


def _wait_graph(schedule: Schedule, pos: dict[Action, tuple[int, int]]) -> nx.DiGraph:
    """Nodes are items (rank, index); an edge u -> v says v cannot end before u has.

    An item is posted when the one before it on its rank has ended; a
    CommBatch ends when every item holding a partner has been posted. So a
    batch at (r, i) waits for (r, i-1) and, for a partner at (q, j), for
    (q, j-1). This is exact for rendezvous semantics (a send and its receive
    complete together once both are posted), which contracting partners
    would not be for batches with partners on two ranks."""
    graph = nx.DiGraph()
    for rank, items in enumerate(schedule.program):
        for i, item in enumerate(items):
            graph.add_node((rank, i))
            if i:
                graph.add_edge((rank, i - 1), (rank, i))
            for a in _actions(item):
                if a.kind not in COMPUTE_KINDS:
                    q, j = pos[_partner(a)]
                    if j:
                        graph.add_edge((q, j - 1), (rank, i))
    return graph


def _check_deadlock(schedule: Schedule, graph: nx.DiGraph) -> None:
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return
    program = schedule.program
    waits = [f"{_where(*v, program[v[0]][v[1]])} waits for rank {u[0]} to post item {u[1] + 1} "
             f"{program[u[0]][u[1] + 1]}, which comes after its item {u[1]}"
             for u, v in cycle if u[0] != v[0]]
    ranks = sorted({node[0] for edge in cycle for node in edge})
    raise ScheduleError(f"deadlock under rendezvous semantics: ranks {ranks} wait for each other in a cycle: "
                        + "; ".join(waits))


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless ``schedule`` computes every micro-batch correctly and finishes.

    Checks, in order: shape (every item well formed, on its stage's rank,
    no communication that crosses no ranks); each action once; exactly one F
    and one B (or BI then BW) per stage and micro-batch; every action after
    its inputs on its rank (F after its RECV_F, SEND_F after F, B/BI after F
    and RECV_B, SEND_B after B/BI, BW after BI) and every send with its
    receive; NCCL's pairing order between each two ranks; no deadlock under
    rendezvous semantics (a cycle in ``_wait_graph``). The message names the
    rank, the item index and the action."""
    _check_shape(schedule)
    pos = _positions(schedule)
    _check_order(schedule, pos)
    _check_matching(schedule)
    _check_deadlock(schedule, _wait_graph(schedule, pos))


# --- timing ---

@dataclass(frozen=True)
class StageCosts:
    """Time of each stage's forward, backward for inputs (BI) and weights (BW); a B costs BI + BW.
    ``comm`` is the time of one communication batch once its partners are posted."""
    forward: tuple[float, ...]
    backward_input: tuple[float, ...]
    backward_weight: tuple[float, ...]
    comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight"):
            object.__setattr__(self, name, tuple(float(x) for x in getattr(self, name)))
        if not len(self.forward) == len(self.backward_input) == len(self.backward_weight):
            raise ValueError(f"StageCosts: forward, backward_input and backward_weight need one value per stage, "
                             f"got {len(self.forward)}, {len(self.backward_input)}, {len(self.backward_weight)}")
        if any(x < 0 or not math.isfinite(x) for x in self.forward + self.backward_input + self.backward_weight
               + (self.comm,)):
            raise ValueError("StageCosts: times must be finite and non-negative")

    @classmethod
    def uniform(cls, stages: int, forward: float = 1.0, backward_input: float = 1.0, backward_weight: float = 1.0,
                comm: float = 0.0) -> StageCosts:
        """The same costs for every stage (the default: F=1, BI=1, BW=1, so B=2)."""
        return cls((forward,) * stages, (backward_input,) * stages, (backward_weight,) * stages, comm)

    def of(self, item: Item) -> float:
        """The time ``item`` takes once it can run."""
        if isinstance(item, CommBatch):
            return self.comm
        s = item.stage
        return {"F": self.forward[s], "BI": self.backward_input[s], "BW": self.backward_weight[s],
                "B": self.backward_input[s] + self.backward_weight[s]}[item.kind]


@dataclass(frozen=True)
class Simulation:
    """When each item of each rank runs, and what that makes of the schedule."""
    schedule: Schedule
    costs: StageCosts
    start: tuple[tuple[float, ...], ...]  # per rank, per item
    end: tuple[tuple[float, ...], ...]
    makespan: float
    busy: tuple[float, ...]  # per rank: time spent computing
    bubble: float  # 1 - total busy / (ranks * makespan)
    peak_in_flight: tuple[int, ...]  # per rank: most (stage, micro-batch) pairs with F done, B (or BW) not


def _peak_in_flight(items: tuple[Item, ...], split: bool) -> int:
    live = peak = 0
    for item in items:
        if isinstance(item, Action):
            live += 1 if item.kind == "F" else -1 if item.kind == ("BW" if split else "B") else 0
            peak = max(peak, live)
    return peak


def simulate(schedule: Schedule, costs: StageCosts | None = None) -> Simulation:
    """Time ``schedule`` (validated first): an item starts when the rank's previous item has ended; a
    compute item takes its stage's cost; a CommBatch ends ``costs.comm`` after its last partner is posted."""
    validate(schedule)
    costs = costs or StageCosts.uniform(schedule.stages)
    if len(costs.forward) != schedule.stages:
        raise ValueError(f"StageCosts has {len(costs.forward)} stages, the schedule {schedule.stages}")
    pos = _positions(schedule)
    start = [[0.0] * len(items) for items in schedule.program]
    end = [[0.0] * len(items) for items in schedule.program]
    for rank, i in nx.topological_sort(_wait_graph(schedule, pos)):
        item = schedule.program[rank][i]
        start[rank][i] = end[rank][i - 1] if i else 0.0
        ready = start[rank][i]
        if isinstance(item, CommBatch):
            for a in item.actions:
                q, j = pos[_partner(a)]
                ready = max(ready, end[q][j - 1] if j else 0.0)
        end[rank][i] = ready + costs.of(item)
    makespan = max((row[-1] for row in end if row), default=0.0)
    busy = tuple(sum(costs.of(item) for item in items if isinstance(item, Action)) for items in schedule.program)
    bubble = 1.0 - sum(busy) / (schedule.ranks * makespan) if makespan > 0 else 0.0
    peaks = tuple(_peak_in_flight(items, schedule.split_backward) for items in schedule.program)
    return Simulation(schedule, costs, tuple(map(tuple, start)), tuple(map(tuple, end)), makespan, busy, bubble,
                      peaks)


def predicted_bubble(schedule: Schedule, costs: StageCosts | None = None) -> float:
    """The fraction of rank-time spent not computing (``simulate(...).bubble``)."""
    return simulate(schedule, costs).bubble


_LETTER = {"F": "F", "B": "B", "BI": "I", "BW": "W"}


def _row(sim: Simulation, rank: int, columns: range, scale: float) -> str:
    """One rank's compute items in ``columns`` (column c covers time [c*scale, (c+1)*scale)).

    A column shows the item running at its midpoint (its kind letter, '.'
    when idle); an item covering at least as many columns as its label has
    characters shows the whole label there."""
    schedule = sim.schedule
    spans = [(sim.start[rank][i], sim.end[rank][i], item) for i, item in enumerate(schedule.program[rank])
             if isinstance(item, Action) and sim.end[rank][i] > sim.start[rank][i]]
    starts = [s for s, _, _ in spans]
    cells = {}
    for c in columns:
        t = (c + 0.5) * scale
        k = bisect.bisect_right(starts, t) - 1
        cells[c] = _LETTER[spans[k][2].kind] if k >= 0 and t < spans[k][1] else "."
    for s, e, a in spans:
        first, stop = math.ceil(s / scale - 0.5), math.ceil(e / scale - 0.5)
        label = _LETTER[a.kind] + str(a.micro)
        if schedule.virtual > 1:
            label += "abcdefghijklmnopqrstuvwxyz"[a.stage // schedule.ranks % 26]
        if stop - first >= len(label):
            for c, char in zip(range(first, stop), label.ljust(stop - first)):
                if c in cells:
                    cells[c] = char
    return "".join(cells[c] for c in columns)


_CUT = " ~~ "  # stands for the middle of a timeline too long for its width


def _scale_lines(parts: list[range], scale: float, makespan: float) -> tuple[str, str]:
    """A ruler under the rows and its times: its first character (under the rows' opening '|') is time
    0, the one under a column that column's right edge; '+' at round times at least 8 columns apart."""
    step = 10 ** math.floor(math.log10(8 * scale))
    step *= next(k for k in (1, 2, 5, 10) if k * step >= 8 * scale)
    ruler, marks = ["+"], [(0, "0")]
    for part in parts:
        if len(ruler) > 1:
            ruler += list(_CUT)
        ticks = {}
        t = math.floor(part[0] * scale / step) * step
        while round(t / scale) <= part[-1] + 1:
            ticks.setdefault(round(t / scale), f"{t:g}")
            t += step
        for c in part:
            if c + 1 in ticks:
                marks.append((len(ruler), ticks[c + 1]))
            ruler.append("+" if c + 1 in ticks else "-")
    ruler[-1] = "+"
    end = len(ruler) - 1
    text = [" "] * (end + 12)
    free = 0
    for at, label in marks + [(end, f"{makespan:g}")]:
        if at >= free and (at == end or at + len(label) < end):
            text[at:at + len(label)] = label
            free = at + len(label) + 1
    return "".join(ruler), "".join(text).rstrip()


def timeline(schedule: Schedule, costs: StageCosts | None = None, width: int = 100) -> str:
    """A text picture of ``simulate(schedule, costs)``: one row per rank, time left to right.

    The scale gives a typical (the median) compute item a whole number of
    columns (as many as ``width`` allows, at least one); when the makespan does not
    fit even then, the middle of the run (the steady state, which repeats)
    is cut out and marked ``~~``, so the warm-up and cool-down bubbles stay
    visible. An item wide enough shows its label (``F3``, ``B3``, ``I3``/``W3``
    for BI/BW; with virtual stages a letter for the rank's chunk: ``F3a``,
    ``F3b``), a narrower one its kind letter; idle time is dots. Each row
    ends with the rank's peak of micro-batches in flight; the last line is
    the predicted bubble."""
    if width < 20:
        raise ValueError(f"timeline width must be at least 20 columns, got {width}")
    sim = simulate(schedule, costs)
    c = sim.costs
    durations = [c.of(item) for items in schedule.program for item in items if isinstance(item, Action)]
    typical = statistics.median_low([d for d in durations if d > 0] or [1.0])
    scale = typical / max(1, math.floor(width * typical / sim.makespan)) if sim.makespan > 0 else 1.0
    total = max(1, math.ceil(sim.makespan / scale - 1e-9))
    if total <= width:
        parts = [range(total)]
    else:
        head = (width - len(_CUT)) // 2
        parts = [range(head), range(total - (width - len(_CUT) - head), total)]
    uniform = all(len(set(x)) <= 1 for x in (c.forward, c.backward_input, c.backward_weight))
    cost_text = (f"F={c.forward[0]:g} BI={c.backward_input[0]:g} BW={c.backward_weight[0]:g} comm={c.comm:g}"
                 if uniform else f"costs per stage, comm={c.comm:g}")
    chunks = ", a/b/...: the rank's first/second/... stage" if schedule.virtual > 1 else ""
    cut = f"; ~~ the middle, {(parts[-1][0] - parts[0][-1] - 1) * scale:g} time, left out" if len(parts) > 1 else ""
    lines = [f"{schedule.name}: {schedule.ranks} ranks, {schedule.stages} stages, {schedule.micro_batches} "
             f"micro-batches; {cost_text}; one column = {scale:.3g} time{cut}",
             f"(F forward, B backward, I/W backward for inputs/weights, then the micro-batch{chunks}; . idle)"]
    pad = len(f"rank {schedule.ranks - 1}")
    for rank in range(schedule.ranks):
        row = _CUT.join(_row(sim, rank, part, scale) for part in parts)
        lines.append(f"{f'rank {rank}':<{pad}} |{row}| peak {sim.peak_in_flight[rank]} in flight")
    lines += [" " * (pad + 1) + line for line in _scale_lines(parts, scale, sim.makespan)]
    lines.append(f"predicted bubble: {sim.bubble:.1%} (busy {sum(sim.busy):g} of {schedule.ranks * sim.makespan:g} "
                 f"rank-time, makespan {sim.makespan:g})")
    return "\n".join(lines)
