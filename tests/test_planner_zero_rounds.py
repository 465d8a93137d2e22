"""The planner's ZeRO-2 kernels in the schedule (``planner/zero_sync.py``) against the dry run's
own (``parallel/zero_nd.py`` on the virtual clock), stage by stage, on a layout that sends the
sums after each round of backwards (``grad_reduce="round"``: Llama 3's way).

In the schedule the program launches each reduction (its pack: one foreach copy into a buffer
made empty, the padding zeroed, the flags copied in), adds each arrival after a chunk's first
into the sums before it, and after each round makes the chunk's buffers again (zeros, one per
parameter); the planner counts the same kernels on the same buckets (a chunk's each), priced
by the same kernel model, the stage's last launch (its first chunk's, as its last backward
ends) in the tail on both sides. The same kernels at the same prices, summed in another order:
equal to the rounding of a reordered float64 sum (``tolerance``: 2 K u of the sum). A check of which
kernels the planner counts, how many and on how many bytes, not of their prices: both sides
price them with the one kernel model (planner.kernel_cost), which this test does not check."""
import inspect
import threading

import torch

from course_lib import tolerance
from course_lib.layout import Layout
from course_lib.parallel import zero_nd
from course_lib.planner import estimate
from course_lib.planner.presets import get_model
from course_lib.virtual import compute, dry_run

SPEC = get_model("llama3-8b").with_(n_layers=4)
LAYOUT = Layout(dp=2, pp=2, zero=2, schedule="interleaved", v=2, micro_batch=1, microbatches=4, seq_len=512,
                precision="bf16-accumulate-fp32", grad_reduce="round")


def _zero_kernels(monkeypatch):
    """{stage thread: [(outer ZeroSync method, inner one, its gradients_done call's number,
    seconds)]} of every kernel the dry run prices inside ZeroSync's methods (the seconds its
    tape records); inner: "_launch" (a reduction's pack), "_arrive" (an arrival's add), else
    the outer."""
    seen, here = {}, threading.local()
    dispatch = compute.ComputeStream.__torch_dispatch__

    def priced(self, func, types, args=(), kwargs=None):
        if not getattr(here, "tags", None) or self.clock.muted_depth:
            return dispatch(self, func, types, args, kwargs)
        own, self.tape = self.tape is None, [] if self.tape is None else self.tape
        before = len(self.tape)
        out = dispatch(self, func, types, args, kwargs)
        seconds = sum(s for s in self.tape[before:] if s is not None)
        if own:
            self.tape = None
        seen.setdefault(threading.current_thread().name, []).append((here.tags[0], here.tags[-1], here.call, seconds))
        return out

    def tagged(name, method):
        def run(*a, **k):
            if name == "gradients_done":
                here.call = getattr(here, "call", 0) + 1
            here.tags = getattr(here, "tags", []) + [name]
            try:
                return method(*a, **k)
            finally:
                here.tags = here.tags[:-1]
        return staticmethod(run) if isinstance(inspect.getattr_static(zero_nd.ZeroSync, name), staticmethod) else run

    monkeypatch.setattr(compute.ComputeStream, "__torch_dispatch__", priced)
    for name in ("gradients_done", "gradients_starting", "finish", "_launch", "_arrive"):
        monkeypatch.setattr(zero_nd.ZeroSync, name, tagged(name, getattr(zero_nd.ZeroSync, name)))
    return seen


def test_the_kernels_in_the_schedule_are_the_dry_runs(monkeypatch):
    from course_lib.planner import runtime

    planned, zero_sync = [], runtime.zero_sync

    def kept(*a, **k):
        out = zero_sync(*a, **k)
        planned.append(out)
        return out

    monkeypatch.setattr(runtime, "zero_sync", kept)
    estimate(SPEC, "h100-sxm", LAYOUT, runtime="course")
    seen = _zero_kernels(monkeypatch)
    dry_run(SPEC, "h100-sxm", LAYOUT, progress=None, optimizer="foreach")
    assert len(planned) == len(seen) == 2
    for (_, _, _, in_schedule, _), name in zip(planned, sorted(seen)):
        kernels = seen[name]
        last = max(call for outer, _, call, _ in kernels if outer == "gradients_done")
        # in the schedule: every refill, every arrival's add before finish, every pack but the
        # step's last call's (the stage's first chunk's, as its last backward ends: the tail's)
        terms = [s for outer, inner, call, s in kernels if outer == "gradients_starting"
                 or outer == "gradients_done" and (inner != "_launch" or call < last)]
        ran = sum(terms)
        assert ran > 0
        # the same positive seconds summed in another order (float64): 2 K u of their sum
        tolerance.assert_matches(torch.tensor(in_schedule, dtype=torch.float64),
                                 torch.tensor(ran, dtype=torch.float64), what=name, terms=len(terms), scale=ran)
