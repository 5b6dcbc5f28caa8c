"""shard_parameters: ZeRO-3 — parameters live as pieces; whole values exist
only while forward or backward needs them.

Requires: ``shard_optimizer_update`` ran (the optimizer already works on
pieces, cut from the whole parameter by nodes marked ``zero_piece_of``).

Ensures, for every bucket sharding "parameters", on rank r:

- the whole-parameter inputs are replaced by rank r's pieces (slots with
  storage "rank" and a piece range); the optimizer reads the piece directly;
- before the first forward use of any of the bucket's parameters, the
  bucket's pieces are packed and all-gathered, and forward reads views of
  the gathered buffer; after its last forward use nothing refers to it, so
  the runtime frees it;
- before the first backward use, the bucket is gathered again and
  backward reads views of that copy; forward values that are pure
  functions of a parameter (its transpose, a cast) and that backward reads
  are recomputed from the second gather instead of being kept alive —
  unless the bucket is reused soon (``stage3_max_reuse_distance``, as in
  DeepSpeed: when the parameters other buckets touch between this bucket's
  last forward use and its first backward use add up to no more than that
  many elements, the forward copy is kept for backward instead).

Under bf16/fp16, when every forward and backward read of a bucket's
parameters is the cast to the compute dtype, the rank casts its packed
shard and the all-gather moves 16-bit values: half the bytes, and the same
values (the cast is elementwise, so casting the pieces before the gather
equals casting the whole after it). The gathered views replace the casts.

Before / after (one bucket, rank 0 of 2)::

    t = aten.t(p_fc_weight)            ->   bucket = aten.cat([p_fc_weight_piece, pad])
                                            all_gather = _c10d_functional.all_gather_into_tensor(bucket, 2, '0')
                                            wait = _c10d_functional.wait_tensor(all_gather)
                                            unpack = aten.view(aten.slice(wait, 0, 0, 128), [16, 8])
                                            t = aten.t(unpack)
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ...errors import CaptureError
from ...graph import META_PARAM, META_PHASE, META_SOURCE, Phase, Role, Slot, StepGraph, Storage
from ...graph.build import bind_placeholders, clone_step_graph
from ...graph.layout import LAYOUT_KEY, Bucket, Sharding
from ...graph.ops import has_side_effect
from ..manager import PassOptions, PassResult
from .collectives import all_gather, cast, fake_like, pack_flat, unpack_view
from .shard_optimizer_update import META_PIECE_OF

__all__ = ["shard_parameters"]

aten = torch.ops.aten


def shard_parameters(graph: StepGraph, options: PassOptions) -> PassResult:
    layout = graph.signature.extra.get(LAYOUT_KEY)
    buckets = [b for b in (layout.buckets if layout else ()) if b.sharding is Sharding.PARAMETERS]
    if not buckets:
        return PassResult(graph, False)
    graph = clone_step_graph(graph)
    g = graph.gm.graph
    sig = graph.signature
    rank, n = options.rank, options.world_size
    placeholders = {node.meta["slot"].ident: node for node in g.nodes if node.op == "placeholder"}
    # by name: under tensor parallelism a split parameter is already the rank's Megatron shard (a rank-held
    # slot with its ``split``); its ZeRO-3 piece is cut from that shard and gathered over the data-parallel group
    params = {node.meta["slot"].name: node for node in g.nodes if node.op == "placeholder"
              and node.meta["slot"].role is Role.PARAM and node.meta["slot"].piece is None}
    inputs = list(sig.inputs)
    replaced: list[tuple[str, fx.Node]] = []

    reuse = _reused_buckets(g, buckets, placeholders, _max_reuse_distance(options))
    regathered = 0
    for bucket in buckets:
        whole = {p.name: params[p.name] for p in bucket.params}
        pieces: dict[str, fx.Node] = {}
        for p in bucket.params:
            a, b, _ = bucket.piece(p, rank)
            old = whole[p.name]
            old_slot = old.meta["slot"]
            if b > a:
                slot = Slot(Role.PARAM, p.name, storage=Storage.RANK, piece=(a, b), split=old_slot.split)
                with g.inserting_before(old.next):
                    ph = g.placeholder(f"{old.name}_piece")
                ph.meta.update(slot=slot, val=fake_like(old.meta["val"], (b - a,)))
                pieces[p.name] = ph
                inputs[inputs.index(old_slot)] = slot
            else:
                inputs.remove(old_slot)
        regathered += _rewire_bucket(g, bucket, whole, pieces, n, options.group_name, rank, bucket.index in reuse)
        replaced.extend(whole.items())

    g.eliminate_dead_code(is_impure_node=has_side_effect)
    for name, old in replaced:
        if old.users:
            user = next(iter(old.users))
            raise CaptureError(
                f"under ZeRO-3, {name} is read where stepfx does not gather it ({user.target})",
                source=user.meta.get(META_SOURCE),
                hint="parameters may be read in forward, backward and by the optimizer only",
            )
        g.erase_node(old)

    bind_placeholders(graph.gm, inputs)
    graph = graph.replace(signature=sig.with_inputs(tuple(inputs)))
    graph.gm.recompile()
    total = sum(len(b.params) for b in buckets)
    return PassResult(
        graph, True,
        f"{total} parameters in {len(buckets)} buckets held as pieces; gathered before forward, "
        f"{regathered} buckets again before backward ({len(reuse)} kept: reused within max_reuse_distance)",
    )


def _max_reuse_distance(options: PassOptions) -> int:
    zero = getattr(options.config, "zero_optimization", None)
    value = getattr(zero, "max_reuse_distance", 1_000_000_000)
    return value if isinstance(value, int) else 1_000_000_000


def _reused_buckets(g: fx.Graph, buckets, placeholders, limit: int) -> set[int]:
    """Buckets whose forward copy backward may keep: the elements of other
    buckets' parameters read between this bucket's last forward read and
    its first backward read total at most ``limit``."""
    order = {node: i for i, node in enumerate(g.nodes)}
    owner = {}
    for b in buckets:
        for p in b.params:
            owner[p.name] = b
    reads: dict[int, list[tuple[int, Phase]]] = {b.index: [] for b in buckets}
    for node in g.nodes:
        if node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            name = arg.meta.get(META_PARAM)
            derived = arg.op == "placeholder" or (arg.op == "call_function" and arg.meta.get(META_PHASE) is Phase.FORWARD)
            if name in owner and derived and node.meta.get(META_PHASE) in (Phase.FORWARD, Phase.BACKWARD):
                reads[owner[name].index].append((order[node], node.meta[META_PHASE]))
    reuse = set()
    for b in buckets:
        fwd = [pos for pos, phase in reads[b.index] if phase is Phase.FORWARD]
        bwd = [pos for pos, phase in reads[b.index] if phase is Phase.BACKWARD]
        if not fwd or not bwd:
            continue
        lo, hi = max(fwd), min(bwd)
        between = sum(
            other.numel for other in buckets
            if other is not b and any(lo < pos < hi for pos, _ in reads[other.index])
        )
        if between <= limit:
            reuse.add(b.index)
    return reuse


def _rewire_bucket(g: fx.Graph, bucket: Bucket, whole: dict, pieces: dict, n: int, group_name: str, rank: int, reuse: bool) -> bool:
    """Rewire one bucket; True when backward gathers it again."""
    order = {node: i for i, node in enumerate(g.nodes)}
    example = next(iter(whole.values())).meta["val"]
    names = {node: name for name, node in whole.items()}

    # 1. the optimizer's piece cuts become the piece inputs
    for name, old in whole.items():
        for user in list(old.users):
            for cut in _piece_cuts(user, name):
                cut.replace_all_uses_with(pieces[name])
                _erase_dead(g, cut)

    # 2. forward reads a gathered copy (and backward too, when it is reused soon)
    _merge_repeated_casts(g, whole, order)
    casts, low = _compute_casts(whole)
    if low is not None:  # the 16-bit casts stand in for the parameters from here on
        names = {casts[name]: name for name in whole}
        whole = {name: casts[name] for name in whole}
    phases = (Phase.FORWARD, Phase.BACKWARD) if reuse else (Phase.FORWARD,)
    fwd_users = [(u, name) for name, old in whole.items() for u in old.users if u.meta.get(META_PHASE) in phases]
    if fwd_users:
        first = min((u for u, _ in fwd_users), key=order.__getitem__)
        views = _gather_before(g, first, bucket, pieces, example, n, group_name, Phase.FORWARD, rank, low)
        for user, name in fwd_users:
            user.replace_input_with(whole[name], views[name])
    if reuse:
        return False

    # 3. backward reads a second gathered copy; forward values that are pure
    # functions of a parameter are recomputed from it
    bwd_reads: list[tuple[fx.Node, fx.Node]] = []  # (backward user, what it reads)
    for node in list(g.nodes):
        if node.meta.get(META_PHASE) is not Phase.BACKWARD or node.op != "call_function":
            continue
        for arg in node.all_input_nodes:
            if arg in names or (arg.meta.get(META_PHASE) is Phase.FORWARD and arg.meta.get(META_PARAM) in whole and arg.op == "call_function"):
                bwd_reads.append((node, arg))
    if not bwd_reads:
        return False
    first = min((u for u, _ in bwd_reads), key=order.__getitem__)
    views = _gather_before(g, first, bucket, pieces, example, n, group_name, Phase.BACKWARD, rank, low)
    memo: dict[fx.Node, fx.Node] = {}

    def recompute(value: fx.Node) -> fx.Node:
        if value in names:
            return views[names[value]]
        if value in memo:
            return memo[value]
        args = tuple(recompute(a) if _derived(a, whole, names) else a for a in value.args)
        kwargs = {k: (recompute(v) if _derived(v, whole, names) else v) for k, v in value.kwargs.items()}
        with g.inserting_before(first):
            node = g.create_node("call_function", value.target, args, kwargs, name=value.name)
        node.meta.update(value.meta)
        node.meta[META_PHASE] = Phase.BACKWARD
        memo[value] = node
        return node

    for user, arg in bwd_reads:
        user.replace_input_with(arg, recompute(arg))
    return True


def _derived(value, whole, names) -> bool:
    return isinstance(value, fx.Node) and (
        value in names or (value.op == "call_function" and value.meta.get(META_PARAM) in whole and value.meta.get(META_PHASE) is Phase.FORWARD)
    )


def _piece_cuts(user: fx.Node, name: str) -> list[fx.Node]:
    """The node(s) marked as cutting ``name``'s piece, at or below ``user``."""
    if user.meta.get(META_PIECE_OF) == name:
        return [user]
    return [u for u in user.users if u.meta.get(META_PIECE_OF) == name]


def _erase_dead(g: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then its inputs that this leaves unread."""
    if node.users or node.op != "call_function" or has_side_effect(node):
        return
    inputs = node.all_input_nodes
    g.erase_node(node)
    for arg in inputs:
        _erase_dead(g, arg)


def _merge_repeated_casts(g: fx.Graph, whole: dict[str, fx.Node], order: dict) -> None:
    """A parameter cast more than once to the same dtype (recompute_activations recomputes the forward's cast
    for backward) is cast once: the gathers below make backward's copy again anyway, and only a parameter whose
    one reader is its 16-bit cast is gathered in 16 bits (else in fp32, twice the bytes, and the fp32 piece read
    on the device, which host_master_weights cannot allow). ``order``: the nodes' positions."""
    for node in whole.values():
        users = sorted(node.users, key=order.__getitem__)
        if len(users) < 2 or any(u.target is not aten._to_copy.default or u.args != (node,) for u in users):
            continue
        first = users[0]
        for later in users[1:]:
            if later.kwargs == first.kwargs:
                later.replace_all_uses_with(first)
                g.erase_node(later)


def _compute_casts(whole: dict[str, fx.Node]) -> tuple[dict[str, fx.Node], torch.dtype | None]:
    """Parameter name -> its cast to the 16-bit compute dtype, and that
    dtype, when each parameter's only reader (after the optimizer moved to
    pieces) is one such cast; else ({}, None)."""
    casts, dtypes = {}, set()
    for name, node in whole.items():
        users = list(node.users)
        if len(users) != 1:
            return {}, None
        (cast,) = users
        dtype = cast.kwargs.get("dtype")
        if cast.target is not aten._to_copy.default or set(cast.kwargs) != {"dtype"} or dtype not in (torch.bfloat16, torch.float16):
            return {}, None
        casts[name] = cast
        dtypes.add(dtype)
    return (casts, dtypes.pop()) if len(dtypes) == 1 else ({}, None)


def _gather_before(
    g, first: fx.Node, bucket: Bucket, pieces: dict, example, n: int, group_name: str, phase: Phase, rank: int, low=None
) -> dict[str, fx.Node]:
    parts = [(pieces[p.name], at) for p, _, _, at in bucket.shard_parts(rank)]
    meta = dict(like=first, phase=phase)
    with g.inserting_before(first):
        shard = pack_flat(g, parts, bucket.shard, example, **meta)
        if low is not None:
            shard = cast(g, shard, low, name="shard_16bit", **meta)
        full = all_gather(g, shard, n, group_name, **meta)[1] if n > 1 else shard
        views = {}
        for p in bucket.params:
            view = unpack_view(g, full, p.offset, p.shape, **meta)
            view.meta[META_PARAM] = p.name
            views[p.name] = view
    return views
