"""course_lib.launch: every failure mode a learner hits, as a real multi-process run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from course_lib import launch
from course_lib.launch import LaunchTimeout, RankError, cpu_count
from course_lib.trace import span

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- helpers run in ranks

def rank_sum(scale):
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return t * scale


def raise_on(bad_rank, sleep=30.0):
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom on {bad_rank}")
    time.sleep(sleep)


def die_on(bad_rank, how):
    if dist.get_rank() == bad_rank:
        if how == "exit":
            os._exit(7)
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "segfault":
            import ctypes

            ctypes.string_at(0)
    time.sleep(30)


def hang_in_recv():
    if dist.get_rank() == 1:
        with span("waiting for a message that never comes", kind="comm"):
            dist.recv(torch.zeros(1), src=0)
    return dist.get_rank()


def pid_and_threads():
    return os.getpid(), torch.get_num_threads()


def listening_sockets(pids):
    """(address, port) of every TCP socket in LISTEN state owned by ``pids`` (Linux /proc)."""
    inodes = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in inodes:  # 0A = LISTEN
                    addr_hex, port_hex = local.split(":")
                    found.append((_decode_addr(addr_hex), int(port_hex, 16)))
    return found


def _decode_addr(hex_addr):
    import ipaddress

    raw = bytes.fromhex(hex_addr)
    # /proc stores each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def _is_loopback(addr):
    import ipaddress

    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def report_listeners():
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    dist.barrier()  # every rank's gloo pairs are connected now
    found = listening_sockets(pids) if dist.get_rank() == 0 else None
    dist.barrier()
    return found


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------- results

def test_results_in_rank_order_and_world_size_one():
    out = launch(rank_sum, 3, 2.0)
    assert [t.tolist() for t in out] == [[12.0] * 4] * 3
    assert launch(rank_sum, 1, 1.0)[0].tolist() == [1.0] * 4


def test_closure_and_lambda_and_kwargs():
    offset = 10

    def with_closure(x, *, y):
        return dist.get_rank() + x + y + offset

    assert launch(with_closure, 2, 1, y=100) == [111, 112]
    assert launch(lambda: dist.get_world_size(), 2) == [2, 2]


def test_threads_per_rank_default_and_override():
    out = launch(pid_and_threads, 2)
    assert [t for _, t in out] == [max(1, cpu_count() // 2)] * 2
    assert [t for _, t in launch(pid_and_threads, 2, threads=1)] == [1, 1]


def test_rank_output_tagged_in_rank_order(capsys):
    def talk():
        rank = dist.get_rank()
        time.sleep(0.05 * (3 - rank))  # rank 2 prints first in wall time
        print(f"line one from {rank}")
        print(f"line two from {rank}")
        print(f"to stderr from {rank}", file=sys.stderr)

    launch(talk, 3)
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"[rank {r}] line {n} from {r}" for r in range(3) for n in ("one", "two")]
    assert err.splitlines() == [f"[rank {r}] to stderr from {r}" for r in range(3)]


def test_spans_on_one_clock():
    def traced():
        dist.barrier()
        with span("after barrier", kind="compute"):
            time.sleep(0.05)
        with span("all_reduce", kind="comm"):
            dist.all_reduce(torch.ones(8))
        return None

    out = launch(traced, 3)
    firsts = [next(s for s in out.spans_of(r) if s.name == "after barrier") for r in range(3)]
    starts = [s.start for s in firsts]
    assert max(starts) - min(starts) < 0.05, starts  # same instant on every rank's clock
    assert all(s.duration >= 0.05 for s in firsts)
    assert {s.kind for s in out.spans} == {"compute", "comm"}


def test_spawn_start_method_and_timeout_excludes_start_up():
    # spawn re-imports torch in every rank (seconds): that must not count against fn's timeout
    out = launch(rank_sum, 2, 1.0, start_method="spawn", timeout=1.0)
    assert [t.tolist() for t in out] == [[3.0] * 4] * 2


# ----------------------------------------------------------------------------- failures

def test_exception_raises_fast_names_rank_and_traceback():
    started = time.perf_counter()
    with pytest.raises(RankError) as info:
        launch(raise_on, 4, 2)
    assert time.perf_counter() - started < 2.0 + 1.5  # 2 s budget + process start
    err = info.value
    assert err.rank == 2 and err.exc_type == "ValueError"
    assert "rank 2 raised ValueError: boom on 2" in str(err)
    assert "raise_on" in err.remote_traceback
    assert isinstance(err, ValueError)          # ``except ValueError`` around launch catches it


def raise_type(name):
    if dist.get_rank() == 1:
        raise {"KeyError": KeyError, "custom": type("CustomError", (Exception,), {})}[name]("lost key")


def test_rank_exception_keeps_its_builtin_type():
    """A rank's builtin exception type is also the caller's (a RankError too, with its attributes);
    a type defined elsewhere stays a plain RankError; clock=None is the wall clock."""
    with pytest.raises(KeyError) as info:
        launch(raise_type, 2, "KeyError", clock=None)
    assert isinstance(info.value, RankError) and info.value.rank == 1 and info.value.exc_type == "KeyError"
    assert str(info.value).startswith("rank 1 raised KeyError: 'lost key'")   # not KeyError's repr quoting
    with pytest.raises(RankError) as info:
        launch(raise_type, 2, "custom")
    assert type(info.value) is RankError and info.value.exc_type == "CustomError"


@pytest.mark.parametrize("how, code", [("exit", "exited with code 7"), ("sigkill", "SIGKILL"),
                                       ("segfault", "SIGSEGV")])
def test_rank_death_reported(how, code):
    started = time.perf_counter()
    with pytest.raises(RankError) as info:
        launch(die_on, 3, 1, how)
    assert time.perf_counter() - started < 2.0 + 1.5
    assert info.value.rank == 1
    assert code in str(info.value)


def test_timeout_names_stuck_rank_span_and_operation():
    started = time.perf_counter()
    with pytest.raises(LaunchTimeout) as info:
        launch(hang_in_recv, 3, timeout=2)
    assert time.perf_counter() - started < 2 + 3
    stuck = info.value.stuck
    assert list(stuck) == [1]
    assert "waiting for a message that never comes" in stuck[1]
    assert "torch.distributed.recv" in stuck[1] and "hang_in_recv" in stuck[1]
    assert "ranks [0, 2] returned" in str(info.value)


# The leak checks count this process's file descriptors and temporary files, so
# they run in a fresh interpreter: the pytest process runs notebooks beside the
# tests (COURSE_TEST_JOBS), whose pipes and work files come and go meanwhile.
_LEAK_PROBE = """
import os, sys, tempfile, time
import torch.distributed as dist
from course_lib import launch
from course_lib.launch import RankError

def pid_and_threads():
    return os.getpid(), 1

def record_then_fail():
    if dist.get_rank() == 0:
        raise RuntimeError("first")
    time.sleep(30)

def fds():
    return len(os.listdir("/proc/self/fd"))

def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie is dead for our purposes
    except OSError:
        return False

launch(pid_and_threads, 2, quiet=True)  # warm the forkserver (its own temp dir)
for phase in sys.argv[1:]:  # "folder:fails:launches:world", each counted on its own
    folder, fails, launches, world = phase.rsplit(":", 3)
    fails, launches, world = int(fails), int(launches), int(world)
    tempfile.tempdir = folder  # this phase's launches' work dirs only
    before = fds()
    for _ in range(fails):
        try:
            launch(record_then_fail, world, quiet=True)
            raise SystemExit("a failing rank did not raise RankError")
        except RankError:
            pass
    seen = []
    for _ in range(launches):
        seen.extend(pid for pid, _ in launch(pid_and_threads, world, quiet=True))
    time.sleep(0.2)
    print(os.listdir(folder), file=sys.stderr)
    print(len(set(seen)), sum(map(alive, seen)), fds() - before, len(os.listdir(folder)), flush=True)
"""
# (fails, launches, world) of each probe: one interpreter runs them all, one after the other
# (a fresh interpreter and its forkserver cost ~7 s of CPU), each phase counted on its own.
LEAK_PHASES = {"failed_runs": (3, 1, 3), "200_launches": (0, 200, 2)}


@pytest.fixture(scope="module")
def leak_probes(tmp_path_factory):
    """{phase: ((distinct rank pids, ranks still alive, new fds, work files left), the probe's stderr)}"""
    folders = {name: tmp_path_factory.mktemp(name) for name in LEAK_PHASES}
    phases = [f"{folders[name]}:{fails}:{launches}:{world}" for name, (fails, launches, world) in LEAK_PHASES.items()]
    out = subprocess.run([sys.executable, "-c", _LEAK_PROBE, *phases], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()[-len(LEAK_PHASES):]
    return {name: (tuple(map(int, line.split())), out.stderr[-2000:]) for name, line in zip(LEAK_PHASES, lines)}


def _leak_probe(leak_probes, phase):
    (distinct, alive, new_fds, left_files), stderr = leak_probes[phase]
    _, launches, world = LEAK_PHASES[phase]
    assert distinct == launches * world  # every launch started fresh ranks
    assert (alive, new_fds, left_files) == (0, 0, 0), ("ranks alive, fds opened, work files left", stderr)


def test_failed_runs_leave_nothing_and_next_launch_works(leak_probes):
    _leak_probe(leak_probes, "failed_runs")


def test_two_launches_at_once():
    results = {}

    def run(name, scale):
        results[name] = launch(rank_sum, 3, scale, quiet=True)

    threads = [threading.Thread(target=run, args=(i, float(i + 1))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [t.tolist() for t in results[0]] == [[6.0] * 4] * 3
    assert [t.tolist() for t in results[1]] == [[12.0] * 4] * 3


_WHO = """import multiprocessing.forkserver as mf, os, sys, time, torch.distributed as d
from course_lib import launch
def who():
    from torch.backends import cpu
    return d.get_rank(), os.getppid(), os.getcwd(), os.environ.get("SEEN"), cpu.get_cpu_capability()
def sleeper(folder):
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(60)
print(repr((list(launch(who, 4, quiet=True)), mf._forkserver._forkserver_pid)), flush=True)
if len(sys.argv) > 1:
    launch(sleeper, 2, sys.argv[1], quiet=True)   # (killed meanwhile: its ranks must end too)
"""


def test_two_processes_launch_at_once(tmp_path):
    """Two processes launch at once: one forks its ranks from a forkserver of its own, the other
    from a server this process started (SHARED_FORKSERVER, as every notebook run of the test
    session does): that server's children, in the launcher's environment (set after the server
    started; ATEN_CPU_CAPABILITY read by torch in the rank) and cwd. Killed while its ranks run,
    that launcher leaves none behind (the shared server lives on: the ranks watch the launcher)."""
    import ast

    launcher = sys.modules["course_lib.launch"]
    if not launcher.can_share_forkserver():
        pytest.skip("this Python's forkserver cannot be shared")
    server = launcher.start_shared_forkserver()
    shared = dict(os.environ, SEEN="yes", ATEN_CPU_CAPABILITY="default",
                  **{launcher.SHARED_FORKSERVER: server._forkserver_address})
    try:
        procs = [subprocess.Popen([sys.executable, "-c", _WHO, *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                  text=True) for env, extra in ((dict(os.environ), ()), (shared, (str(tmp_path),)))]
        own = ast.literal_eval(procs[0].communicate(timeout=120)[0].strip())
        got = ast.literal_eval(procs[1].stdout.readline().strip())
        deadline = time.time() + 60
        while len(os.listdir(tmp_path)) < 2 and time.time() < deadline:
            time.sleep(0.05)
        procs[1].kill()
        procs[1].communicate(timeout=30)
        pids = [int(f) for f in os.listdir(tmp_path)]
        deadline = time.time() + 5   # the watchdog looks every 0.5 s
        while any(map(_alive, pids)) and time.time() < deadline:
            time.sleep(0.05)
    finally:
        os.close(server._forkserver_alive_fd)   # the server ends with its last client
        os.waitpid(server._forkserver_pid, 0)
    assert procs[0].returncode == 0 and [r[0] for r in own[0]] == [0, 1, 2, 3]
    assert own[1] is not None and {r[1] for r in own[0]} == {own[1]} != {server._forkserver_pid}
    native = torch.backends.cpu.get_cpu_capability()
    assert got == ([(r, server._forkserver_pid, ROOT, "yes", "DEFAULT") for r in range(4)], None), (got, native)
    assert len(pids) == 2 and not [p for p in pids if _alive(p)]


def test_200_launches_leak_no_process_or_fd(leak_probes):
    _leak_probe(leak_probes, "200_launches")


def test_listener_scan_sees_a_public_listener():
    import socket

    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    try:
        found = listening_sockets([os.getpid()])
        assert any(not _is_loopback(addr) and port == s.getsockname()[1] for addr, port in found)
    finally:
        s.close()


def test_nothing_listens_beyond_loopback_during_a_run():
    found = launch(report_listeners, 3)[0]
    assert all(_is_loopback(addr) for addr, _ in found), found


def test_interrupt_stops_every_rank(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {ROOT!r})
        from course_lib import launch
        def sleeper(d):
            open(os.path.join(d, str(os.getpid())), "w").close()
            time.sleep(60)
        try:
            launch(sleeper, 3, {str(tmp_path)!r}, timeout=120)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while len([f for f in os.listdir(tmp_path) if f.isdigit()]) < 3 and time.time() < deadline:
        time.sleep(0.05)
    pids = [int(f) for f in os.listdir(tmp_path) if f.isdigit()]
    assert len(pids) == 3
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert "interrupted" in out
    time.sleep(0.3)
    assert not [p for p in pids if _alive(p)]


def test_function_from_a_jupyter_kernel_after_matmuls():
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell("import torch\nx = torch.randn(256, 256)\nfor _ in range(5): x = x @ x.T / 256"),
        nbformat.v4.new_code_cell(textwrap.dedent("""\
            import torch, torch.distributed as dist
            from course_lib import launch
            factor = 3
            def cell_fn():
                y = torch.randn(128, 128) @ torch.randn(128, 128)  # a matmul in each rank
                t = torch.tensor([float(dist.get_rank())])
                dist.all_reduce(t)
                return float(t) * factor
            print(list(launch(cell_fn, 2, timeout=30)))""")),
    ]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "[3.0, 3.0]" in text


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(fn=rank_sum, world_size=0), ValueError, "world_size must be >= 1"),
    (dict(fn=rank_sum, world_size="2"), TypeError, "world_size must be an int"),
    (dict(fn=42, world_size=2), TypeError, "callable"),
    (dict(fn=rank_sum, world_size=2, backend="mpi"), ValueError, "unknown backend"),
    (dict(fn=rank_sum, world_size=2, timeout=0), ValueError, "timeout"),
    (dict(fn=rank_sum, world_size=2, clock="h100"), TypeError, "clock must be None"),
])
def test_bad_input_raises_before_start(kwargs, exc, words):
    fn, ws = kwargs.pop("fn"), kwargs.pop("world_size")
    with pytest.raises(exc, match=words):
        launch(fn, ws, 1.0, **kwargs)


def test_unpicklable_argument_and_result():
    lock = threading.Lock()
    with pytest.raises(TypeError, match="picklable"):
        launch(rank_sum, 2, lock)
    with pytest.raises(RankError, match="cannot be pickled"):
        launch(lambda: threading.Lock(), 2)


@pytest.mark.skipif(torch.cuda.device_count() >= 64, reason="a machine with 64 GPUs")
def test_nccl_without_enough_gpus_is_a_clear_error():
    with pytest.raises(RuntimeError, match="one GPU per rank"):
        launch(rank_sum, 64, 1.0, backend="nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gloo_with_cuda_tensors_and_nccl_world_size_one():
    def on_gpu():
        t = torch.ones(4, device="cuda") * (dist.get_rank() + 1)
        dist.all_reduce(t)
        return t

    assert launch(on_gpu, 2)[0].device.type == "cpu"
    assert launch(on_gpu, 1, backend="nccl")[0].tolist() == [1.0] * 4


def test_torchrun_runs_the_same_call(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "course_lib.examples.hello"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "results in rank order: [3.0, 3.0]" in proc.stdout


def _needs_timeout(x, timeout):
    return x


def _reads_backend(backend="gloo"):
    return backend


def test_a_call_that_cannot_bind_fails_before_any_rank_starts():
    """fn's signature is checked in the parent: one TypeError naming it, and, when the
    missing argument has the name of one of launch's keywords, why it never arrives."""
    started = time.perf_counter()
    with pytest.raises(TypeError, match=r"_needs_timeout\(x, timeout\) cannot be called.*"
                                        r"launch keeps timeout= for itself"):
        launch(_needs_timeout, 2, 1.0, timeout=5)
    with pytest.raises(TypeError, match="unexpected keyword argument 'y'"):
        launch(rank_sum, 2, 1.0, y=2)
    assert time.perf_counter() - started < 1.0        # no rank was started


def test_a_parameter_named_like_a_launch_keyword_is_warned_about():
    """examples/train.py once had ``train(..., backend="gloo")`` launched with
    ``backend="nccl"``: the ranks computed on the CPU. Now launch says so."""
    with pytest.warns(UserWarning, match="_reads_backend has a parameter backend that launch keeps"):
        assert launch(_reads_backend, 1, backend="gloo", quiet=True) == ["gloo"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # passed positionally: bound, no warning
        assert launch(_reads_backend, 1, "nccl-name", quiet=True) == ["nccl-name"]
