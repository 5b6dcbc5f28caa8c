"""The one place stepfx touches private torch APIs.

stepfx runs on torch 2.11 (GPU machines) and 2.13 (CI). Every private or
moving torch API it needs is wrapped here, so a torch upgrade changes this
file and nothing else. Each wrapper says what it wraps and why the public
API does not do the job.
"""
from __future__ import annotations


# --------------------------------------------------------------------------
# Threaded process group (stepfx.testing.run_threaded)
#
# torch's in-process "threaded" backend runs each rank in a thread of one
# process, so unit tests of collective code cost milliseconds instead of
# seconds of process start-up. It lives in torch.testing._internal and has no
# public equivalent. Importing multi_threaded_pg registers the "threaded"
# backend; it does not need `expecttest` (common_distributed, which we avoid,
# does). Imports are inside the functions so that importing stepfx.compat
# does not import torch's testing internals.


def install_threaded_pg() -> None:
    """Make torch.distributed's world state thread-local, so each thread is one rank.

    Wraps multi_threaded_pg._install_threaded_pg (also registers the
    "threaded" backend on import) and turns on c10d's thread isolation, which
    makes the C++ group-name registry (used by _c10d_functional ops to find a
    group) per thread. Undo with uninstall_threaded_pg.
    """
    import torch
    from torch.testing._internal.distributed import multi_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = multi_threaded_pg._install_threaded_pg()
    if not hasattr(world, "comms"):
        # torch 2.11's ThreadLocalWorld lacks the `comms` list that its
        # destroy_process_group reads (2.13 has it). Threaded groups have no
        # torchcomms communicators, so an empty list is exact.
        world.comms = []


def uninstall_threaded_pg() -> None:
    """Restore the process-wide torch.distributed world and clear the threaded backend's state.

    Wraps ProcessLocalGroup.reset (forgets pending collectives and the abort
    flag), multi_threaded_pg._uninstall_threaded_pg and c10d's thread isolation.
    """
    import torch
    from torch.testing._internal.distributed import multi_threaded_pg

    multi_threaded_pg.ProcessLocalGroup.reset()
    multi_threaded_pg._uninstall_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)


def threaded_pg_installed() -> bool:
    """Whether install_threaded_pg is in effect (it is not reentrant).

    Checks torch.distributed.distributed_c10d._world, the private global the
    threaded backend swaps out.
    """
    import torch
    from torch.testing._internal.distributed import multi_threaded_pg

    return isinstance(torch.distributed.distributed_c10d._world, multi_threaded_pg.ThreadLocalWorld)


def abort_threaded_collectives(exc: BaseException) -> None:
    """Wake every thread waiting in a threaded-backend collective; they raise SystemExit.

    Wraps ProcessLocalGroup.exception_handle: without it, ranks waiting for a
    rank that failed would wait forever.
    """
    from torch.testing._internal.distributed import multi_threaded_pg

    multi_threaded_pg.ProcessLocalGroup.exception_handle(exc)
