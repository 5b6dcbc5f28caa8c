"""What the per-call capture-flag exchange costs (runtime/distributed.py's
``captures_at_call``): every call of a step on more than one rank starts
with one all-reduce of two int64 flags on stepfx's gloo control group, so
that a rank capturing alone never waits in an exchange the others will not
join. This times it alone, between ``--ranks`` local processes (gloo over
loopback; under NCCL the control group is gloo too).

    python3 benchmarks/capture_flags.py [--ranks 2] [--calls 2000]
"""
from __future__ import annotations

import argparse
import time


def _time_exchanges(calls: int) -> float:
    from stepfx.runtime.distributed import captures_at_call, data_parallel

    dp = data_parallel("cpu")
    for _ in range(50):
        captures_at_call(dp, False)
    start = time.perf_counter()
    for _ in range(calls):
        captures_at_call(dp, False)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    from stepfx.testing.ranks import RankPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    with RankPool(args.ranks, timeout=300) as pool:
        per_rank = pool.run(_time_exchanges, args.calls)
    print(f"{args.ranks} ranks, {args.calls} calls: " + ", ".join(f"rank {r} {us:.0f} us" for r, us in enumerate(per_rank))
          + " a call")


if __name__ == "__main__":
    main()
