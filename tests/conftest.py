"""Shared paths and helpers for the tests of the book, the notebooks and the exercises."""
from __future__ import annotations

import glob
import importlib
import os
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

import pytest

# OpenMP's idle threads spin before they sleep (libgomp: ~300,000 turns at every barrier of a
# torch op). On 2 cores shared by two notebook kernels, their ranks and this process, a spinning
# thread waits for one that is not running, and burns the core it needs: a 30-step TinyGPT run
# on 2 threads took 27.8 s of CPU among other work, 1.9 s with PASSIVE (its idle threads sleep
# at once), 1.5 s on one thread. Set before torch is loaded here, and inherited by every notebook
# run, kernel and rank: the same threads split the same work, so every result is the same.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")
if SCRIPTS not in sys.path:  # generate_exercises, grade, colab_cell are plain scripts
    sys.path.insert(0, SCRIPTS)

# A rank that runs a test's function imports its test module, and so pytest (~0.1 s of CPU per rank,
# about what a small launch costs): the forkserver imports it once instead (before the first launch).
LAUNCH = importlib.import_module("course_lib.launch")
LAUNCH.FORKSERVER_PRELOAD.append("pytest")

SANITIZE = os.path.join(ROOT, "tests", "nbval_sanitize.cfg")
# The environment the session started with: a notebook run in the background must not inherit
# what a test sets meanwhile (test_examples_train sets RANK and WORLD_SIZE, as torchrun does).
SESSION_ENV = dict(os.environ)
CELL_TIMEOUT = 300      # seconds per cell: a cell may start several multi-process launches
NOTEBOOK_TIMEOUT = 900  # seconds per notebook, so a hang cannot stall the suite


def notebooks_in(folder: str) -> list[str]:
    """Repository-relative paths of the notebooks directly in ``folder`` (sorted)."""
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, folder, "*.ipynb")))


@dataclass
class NbvalRun:
    returncode: int
    log: str
    cells: dict = field(default_factory=dict)  # nbval's "Cell N" (N counts code cells) -> outcome

    def outcome(self, code_cell: int) -> str:
        return self.cells.get(code_cell, "not run")


# jsonschema imports the optional IRI checker rfc3987_syntax when it is installed, and that
# import compiles a grammar: 2.7 s of CPU in every process that imports nbformat (each nbval
# and grading subprocess), for a format no notebook schema uses. The test harness's
# subprocesses run Python with it marked absent (jsonschema then skips that checker).
WITHOUT_IRI = "import sys; sys.modules['rfc3987_syntax'] = None; "


# What a notebook run costs in CPU: its process and every process under it (a forkserver of its
# kernel's own and the ranks it forked included; see shared_forkserver). On Linux the run's process adopts its
# orphans (PR_SET_CHILD_SUBREAPER) and, at exit, reaps them (10 s at most), so its rusage counts
# them; it writes its CPU seconds to COURSE_TEST_CPU_FILE. The session prints every run's wall and
# CPU time at the end (pytest_terminal_summary): where the suite's time goes.
COUNT_CPU = ("import os, atexit\nif sys.platform == 'linux' and os.environ.get('COURSE_TEST_CPU_FILE'):\n"
             "    import ctypes, resource, time\n"
             "    ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER\n"
             "    def _reap(path=os.environ.pop('COURSE_TEST_CPU_FILE'), end=time.monotonic):\n"
             "        deadline = end() + 10\n"
             "        while end() < deadline:\n"
             "            try:\n"
             "                if os.waitpid(-1, os.WNOHANG)[0] == 0:\n"
             "                    time.sleep(0.02)\n"
             "            except ChildProcessError:\n"
             "                break\n"
             "        cpu = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF,\n"
             "                  resource.RUSAGE_CHILDREN) for f in ('ru_utime', 'ru_stime'))\n"
             "        open(path, 'w').write(repr(cpu))\n"
             "    atexit.register(_reap)\n")


def python_m(module: str, *args: str) -> list[str]:
    """``python -m module args`` with jsonschema's IRI checker marked absent (WITHOUT_IRI)."""
    return [sys.executable, "-c", WITHOUT_IRI + COUNT_CPU + f"import runpy; sys.argv[0] = {module!r}; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)", *args]


# jupyter_client's words when a kernel process exits before it answers: seen once in a full run
# (both runs of one notebook), an infrastructure failure, not the notebook's
KERNEL_NEVER_STARTED = "Kernel died before replying to kernel_info"


def run_nbval(path: str, mode: str = "strict", timeout: int = NOTEBOOK_TIMEOUT, env: dict | None = None) -> NbvalRun:
    """``pytest --nbval`` (strict: every output compared, sanitized) or ``--nbval-lax``
    (only check cells compared) on one notebook, in a subprocess: a fresh kernel of this
    Python environment whose cwd is the notebook's folder. ``env``: variables added to the
    session's starting environment (SESSION_ENV) for the run (the kernel and the ranks it
    launches inherit them)."""
    env = {**shared_forkserver(), **(env or {})}
    options = ["--nbval", f"--nbval-sanitize-with={SANITIZE}"] if mode == "strict" else ["--nbval-lax"]
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "junit.xml")
        cmd = [*python_m("pytest"), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               "--nbval-current-env", f"--nbval-cell-timeout={CELL_TIMEOUT}", f"--junitxml={report}",
               *options, path]
        for _ in range(2):   # a kernel that never started (no code of the notebook ran) gets one more try
            result = _subprocess(cmd, timeout, env={**SESSION_ENV, **env}, text=True,
                                 label=f"nbval {mode} {path}")
            if result.returncode == 0 or KERNEL_NEVER_STARTED not in result.stdout + result.stderr:
                break
        cells = {}
        if os.path.exists(report):
            for case in ET.parse(report).iter("testcase"):
                name = case.get("name", "")
                if name.startswith("Cell "):
                    tags = {child.tag for child in case}
                    cells[int(name.split()[1])] = ("failed" if tags & {"failure", "error"} else
                                                   "skipped" if "skipped" in tags else "passed")
    return NbvalRun(result.returncode, result.stdout + result.stderr, cells)


# Notebooks whose strict run uses other CPU kernels than this machine's own (ATen's portable
# "default" kernels instead of AVX2/AVX-512), as a learner's CPU would: a checked output that
# depends on the CPU fails here (tests/test_portability.py), at no extra cost to the suite.
# Each of them runs once: that one strict run serves tests/test_notebooks.py and this check alike.
# The portable kernels cost CPU (a TinyGPT training step ~1.2-1.4x AVX-512's, measured here); AVX2
# would cost no more than native on an AVX-512 machine, but it is the native kernel set of most
# x86 machines (there, no other kernels run at all), so "default" stays: no check is dropped.
# The one list: README.md, book/how_to_run.md and CONTRIBUTING.md name the same chapters
# (test_portability.test_the_docs_name_the_notebooks_run_on_other_kernels checks them).
OTHER_KERNELS = {f"notebooks/{name}.ipynb": {"ATEN_CPU_CAPABILITY": "default"} for name in (
    "00_single_device", "03_data_parallel", "04_zero_fsdp", "05_tensor_parallel", "06_pipeline_parallel",
    "07_context_parallel", "08_expert_parallel", "09_nd_parallelism", "09b_memory_and_precision",
    "09c_low_precision", "11_debugging", "12_checkpointing")}  # every notebook that trains or compares floats


# ----------------------------------------------------------------------------- notebook runs
# Running a notebook is mostly waiting (a kernel starting, ranks meeting, a grader's launches),
# and so are most other tests here: the session starts every notebook run its tests need as
# soon as they are collected, JOBS at a time, in the background, while the other tests run; a
# test that reads a run waits for it. A test asks for a run with the ``notebook_run`` marker
# ("strict": nbval_strict(path); "untouched": untouched_grade(path)); each runs once.
# COURSE_TEST_JOBS=0: one at a time, when a test asks (nothing runs beside the other tests).
JOBS = int(os.environ.get("COURSE_TEST_JOBS", "-1"))
if JOBS < 0:
    JOBS = max(1, min(4, os.cpu_count() or 1))
_wanted: dict = {}      # (kind, path) -> None, in the order the tests will ask
_forkserver: list = []  # the session's shared forkserver (started with the first notebook run)
_futures: dict = {}     # (kind, path) -> Future of an NbvalRun | scripts/grade.py's NotebookGrade
_pool = None
_live: set = set()      # the subprocesses running now (stopped if the session ends first)
_FORKSERVER_LOCK = threading.Lock()


RUN_TIMES: dict = {}    # a run's label -> (wall seconds, CPU seconds of its processes or None)


def _subprocess(cmd, timeout, env=None, text=False, label=None):
    """subprocess.run(cmd, capture_output=True) from ROOT, stoppable by the session's end; with
    ``label``, its wall and CPU time (COUNT_CPU) go to RUN_TIMES."""
    import time

    with tempfile.TemporaryDirectory() as tmp:
        cpu_file = os.path.join(tmp, "cpu")
        env = {**(os.environ if env is None else env), "COURSE_TEST_CPU_FILE": cpu_file}
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, text=text, start_new_session=True)
        _live.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            proc.communicate()
            raise
        finally:
            _live.discard(proc)
        if label is not None:
            with open(cpu_file) if os.path.exists(cpu_file) else open(os.devnull) as f:
                cpu = f.read()
            RUN_TIMES[label] = (time.perf_counter() - started, float(cpu) if cpu else None)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _stop(proc):
    """Kill ``proc`` and what it started (its kernel, the kernel's ranks): one session."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# Every notebook run's kernel forks its ranks from one forkserver that the session starts and
# keeps (course_lib.launch.SHARED_FORKSERVER), instead of starting its own: a server imports
# torch, torch._dynamo and course_lib, 2.8 s of CPU, once instead of once per kernel (~50 runs).
# Each rank still runs in its kernel's environment, cwd and sys.path (ATEN_CPU_CAPABILITY of
# OTHER_KERNELS included: torch reads it at its first op, in the rank). The server's and its
# ranks' CPU is a line of its own in the summary (a run's own CPU no longer includes its ranks').
def shared_forkserver() -> dict:
    """{SHARED_FORKSERVER: its address} for a notebook run's environment, or {} (not Linux, or a
    Python whose forkserver cannot be shared)."""
    with _FORKSERVER_LOCK:
        if not _forkserver and LAUNCH.can_share_forkserver():
            _forkserver.append(LAUNCH.start_shared_forkserver())
    return {LAUNCH.SHARED_FORKSERVER: _forkserver[0]._forkserver_address} if _forkserver else {}


def pytest_configure(config):
    config.addinivalue_line("markers", 'notebook_run(kind): the test reads the run of its "path" '
                            'parameter ("strict" or "untouched"), made with the session\'s other runs')


def pytest_collection_modifyitems(session, config, items):
    """The tests that read a notebook run go last: the others run while the notebooks do."""
    if JOBS > 0:
        items[:] = sorted(items, key=lambda item: item.get_closest_marker("notebook_run") is not None)


def pytest_collection_finish(session):
    global _pool
    for item in session.items:  # (after -k and deselection: only what will run)
        marker = item.get_closest_marker("notebook_run")
        if marker is not None and hasattr(item, "callspec"):
            _wanted[marker.args[0], item.callspec.params["path"]] = None
    if JOBS > 0 and _wanted:
        import concurrent.futures

        shared_forkserver()   # (it imports torch while the first kernels start)
        _pool = concurrent.futures.ThreadPoolExecutor(JOBS, thread_name_prefix="notebook")
        # the lecture notebooks first (the longest), the untouched exercises last (the shortest)
        for key in sorted(_wanted, key=lambda k: (k[0] == "untouched", not k[1].startswith("notebooks/"))):
            _futures[key] = _pool.submit(_run, *key)


def pytest_sessionfinish(session):
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)
    for proc in list(_live):
        _stop(proc)


_GRADE = WITHOUT_IRI + COUNT_CPU + """import pickle
sys.path.insert(0, sys.argv[3])
import grade
sys.stdout.buffer.write(pickle.dumps(grade.grade_notebook(sys.argv[1], sys.argv[2])))"""


def _untouched(path: str):
    """scripts/grade.py on the untouched exercise of solution ``path``, in a subprocess."""
    import pickle

    exercise = os.path.join(ROOT, "exercises", os.path.basename(path))
    done = _subprocess([sys.executable, "-c", _GRADE, exercise, os.path.join(ROOT, "solutions"), SCRIPTS],
                       NOTEBOOK_TIMEOUT, env={**SESSION_ENV, **shared_forkserver()},
                       label=f"grade untouched {path}")
    if done.returncode:
        raise RuntimeError(f"grading {exercise} failed (exit {done.returncode}):\n"
                           + done.stderr.decode(errors="replace")[-4000:])
    return pickle.loads(done.stdout)


def _run(kind: str, path: str):
    return _untouched(path) if kind == "untouched" else run_nbval(path, "strict", env=OTHER_KERNELS.get(path))


def _result(kind: str, path: str):
    key = (kind, path)
    if key not in _futures:  # not collected with a marker, or COURSE_TEST_JOBS=0: run it now
        import concurrent.futures
        future = _futures[key] = concurrent.futures.Future()
        try:
            future.set_result(_run(kind, path))
        except Exception as exc:  # noqa: BLE001 - raised below, and to any later reader
            future.set_exception(exc)
    return _futures[key].result()


def nbval_strict(path: str) -> NbvalRun:
    """The strict run of a notebook, once per session: tests/test_notebooks.py checks every
    output with it, tests/test_exercises.py reads the solution's check cells from it,
    tests/test_portability.py checks that the OTHER_KERNELS notebooks ran under other kernels."""
    return _result("strict", path)


def untouched_grade(path: str):
    """scripts/grade.py's grade of the exercise generated from solution ``path``, untouched."""
    return _result("untouched", path)


@pytest.fixture
def one_thread():
    """Tiny matrices: one intra-op thread is as fast, and immune to oversubscribed cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def forkserver_cpu(pid: int) -> float:
    """CPU seconds of a live process and of its children it has waited for (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")   # utime stime cutime cstime


def pytest_terminal_summary(terminalreporter):
    """Every notebook run's wall and CPU seconds (its kernel included; the shared forkserver's
    ranks on a line of their own), the slowest first: where the suite's time goes (README.md)."""
    if not RUN_TIMES:
        return
    write = terminalreporter.write_line
    terminalreporter.section("notebook runs: wall and CPU seconds")
    for label, (wall, cpu) in sorted(RUN_TIMES.items(), key=lambda item: -item[1][0]):
        write(f"{wall:7.1f} s wall {cpu if cpu is not None else float('nan'):7.1f} s CPU  {label}")
    cpus = [cpu for _, cpu in RUN_TIMES.values() if cpu is not None]
    if _forkserver:
        cpus.append(forkserver_cpu(_forkserver[0]._forkserver_pid))
        write(f"{'':7} s wall {cpus[-1]:7.1f} s CPU  the shared forkserver and the ranks it forked (every run's)")
    write(f"{sum(w for w, _ in RUN_TIMES.values()):7.1f} s wall {sum(cpus):7.1f} s CPU  "
          f"all {len(RUN_TIMES)} runs ({JOBS} at a time)")
