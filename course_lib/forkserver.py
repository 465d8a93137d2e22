"""Where launch's ranks start from: a forkserver that has imported torch but never run a torch op.

Plain ``fork`` of a process that has run a matmul hangs in OpenMP (not fork-safe); ``spawn``
imports torch again in every rank (seconds). A forkserver imports :data:`FORKSERVER_PRELOAD`
once, and every rank is a cheap fork of it. One server can serve several processes
(:data:`SHARED_FORKSERVER`: the test session's, shared by every notebook kernel it runs).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import threading

# What the forkserver imports once, so that every rank (a fork of it) starts with it instead of
# importing it again: torch; torch._dynamo (the first optimizer a rank builds imports it, ~10 s for
# 4 ranks on 2 cores); course_lib.rank_imports, the course_lib modules ranks use (~0.1 s of CPU per
# rank per launch). Append names before the first launch to add more (tests/conftest.py adds pytest:
# a rank running a test's function imports its test module). Nothing here may run a torch op at
# import: a fork of a process that has run one hangs in OpenMP. Ranks see these modules as they were
# at the first launch of this process: an edit to course_lib reaches them after a kernel restart,
# as it reaches the kernel's own imports.
FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "cloudpickle", "course_lib.launch",
                      "course_lib.rank_imports"]


# A forkserver that another process started and keeps (tests/conftest.py: one for the whole test
# session), named by the address of its socket in this variable: ranks are forked from it instead
# of from a server of this process's own, which would import FORKSERVER_PRELOAD again (~2.8 s of
# CPU in every notebook kernel). Each rank still runs in the launcher's environment, cwd and sys.path.
SHARED_FORKSERVER = "COURSE_LIB_FORKSERVER"

_CONTEXTS: dict = {}
_STARTING = threading.local()


def _install_no_main_reimport():
    """Ranks get fn by value, so they never need to re-import the caller's __main__.

    multiprocessing's spawn/forkserver children normally re-run the main script
    (hence the ``if __name__ == "__main__"`` idiom); a launch from an unguarded
    script or ``python -m`` module would then recurse. While *we* start ranks,
    drop the main-module entries from the preparation data.
    """
    import multiprocessing.spawn as mp_spawn

    if getattr(mp_spawn.get_preparation_data, "_course_lib", False):
        return
    original = mp_spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        if getattr(_STARTING, "active", False):
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
        return data

    get_preparation_data._course_lib = True
    mp_spawn.get_preparation_data = get_preparation_data


def can_share_forkserver() -> bool:
    """Whether this Python's forkserver client can be pointed at a server it did not start
    (3.8-3.13; 3.14's client authenticates to the server it started itself)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return (sys.platform == "linux" and hasattr(server, "_forkserver_address")
            and hasattr(server, "_forkserver_alive_fd") and not hasattr(server, "_forkserver_authkey"))


def start_shared_forkserver():
    """Start a forkserver with FORKSERVER_PRELOAD imported, for other processes to fork their
    ranks from (pass its address in SHARED_FORKSERVER); it lives as long as this process."""
    from multiprocessing import forkserver

    server = forkserver.ForkServer()
    server.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    server.ensure_running()
    return server


def _use_shared_forkserver(address) -> bool:
    """Point this process's forkserver client at the running server at ``address``."""
    from multiprocessing import forkserver, resource_tracker

    server = forkserver._forkserver
    if not (address and os.path.exists(address) and can_share_forkserver()):
        return False
    if server._forkserver_address is None:
        read, write = os.pipe()   # the server hands ``write`` to each rank as its own "alive" end
        os.close(read)
        server._forkserver_address, server._forkserver_alive_fd = address, write
        server.ensure_running = resource_tracker.ensure_running   # not ours to (re)start
    return True


def rank_context(start_method):
    """The multiprocessing context launch starts ranks with: "forkserver" (default where
    available; the shared server if :data:`SHARED_FORKSERVER` names one) or "spawn"."""
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method == "fork":
        raise ValueError(
            "start_method='fork' is unsafe once torch has run an op in this process "
            "(forked ranks hang in OpenMP); use 'forkserver' (default) or 'spawn'")
    if start_method not in ("forkserver", "spawn"):
        raise ValueError(f"start_method must be 'forkserver' or 'spawn', got {start_method!r}")
    _install_no_main_reimport()
    if start_method not in _CONTEXTS:
        ctx = mp.get_context(start_method)
        if start_method == "forkserver" and not _use_shared_forkserver(os.environ.get(SHARED_FORKSERVER)):
            # Import torch once in the server; every rank is then a cheap fork of it.
            ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        _CONTEXTS[start_method] = ctx
    return _CONTEXTS[start_method]


@contextlib.contextmanager
def starting_ranks():
    """While launch starts its ranks: the caller's __main__ is left out of what they are sent."""
    _STARTING.active = True
    try:
        yield
    finally:
        _STARTING.active = False


__all__ = ["FORKSERVER_PRELOAD", "SHARED_FORKSERVER", "can_share_forkserver", "start_shared_forkserver",
           "rank_context", "starting_ranks"]
