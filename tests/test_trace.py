"""course_lib.trace: spans, kinds, the status a stuck rank reports."""
import json
import time

import pytest

from course_lib import trace


def test_span_records_interval_and_kind(tmp_path):
    rec = trace.Recorder(rank=3, status_path=str(tmp_path / "status"))
    with rec.span("forward", kind="compute"):
        with rec.span("all_reduce", kind="comm"):
            status = (tmp_path / "status").read_bytes().rstrip(b"\0").decode()
            assert status == "all_reduce [comm]"  # innermost open span
            time.sleep(0.01)
    assert [(s.rank, s.name, s.kind) for s in rec.spans] == [(3, "all_reduce", "comm"), (3, "forward", "compute")]
    inner, outer = rec.spans
    assert outer.start <= inner.start and inner.end <= outer.end and inner.duration >= 0.01
    assert (tmp_path / "status").read_bytes().rstrip(b"\0") == b""
    rec.close()


def test_unknown_kind_is_rejected():
    with pytest.raises(ValueError, match="span kind must be one of"):
        with trace.span("x", kind="network"):
            pass


def test_module_level_span_uses_installed_recorder():
    rec = trace.install(trace.Recorder(rank=1))
    with trace.span("step"):
        pass
    assert [s.name for s in trace.spans()] == ["step"] and trace.spans()[0].rank == 1
    trace.reset()
    assert trace.spans() == []
    rec.add("measured elsewhere", "idle", 0.0, 0.5)
    assert trace.spans()[0].duration == 0.5


def test_chrome_trace_of_wall_clock_spans(tmp_path):
    """Spans without messages (the wall clock): slices only, one lane per kind of lane."""
    spans = [trace.Span(0, "forward", "compute", 0.0, 0.002), trace.Span(0, "all-reduce", "comm", 0.002, 0.003, "dp"),
             trace.Span(1, "forward", "compute", 0.0, 0.0025), trace.Span(1, "all-gather", "comm", 0.001, 0.002, "tp")]
    doc = json.loads(json.dumps(trace.to_chrome_trace(spans, tmp_path / "t.json")))
    assert doc == json.loads((tmp_path / "t.json").read_text())
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in slices] == [
        (0, "forward", 0.0, 2000.0), (0, "all-reduce", 2000.0, 1000.0), (1, "forward", 0.0, 2500.0),
        (1, "all-gather", 1000.0, 1000.0)]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["comm dp", "comm tp", "compute", "compute"]
    assert not [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]


class _FakeStream:
    """A GPU stream in miniature: kernels queue up; the CPU returns at once."""

    def __init__(self):
        self.busy_until = 0.0      # GPU seconds when the queued work ends
        self.synchronized = False

    def kernel(self, seconds):
        self.busy_until += seconds

    def event(self):
        stream = self

        class Event:
            def record(self):
                self.at, self.done = stream.busy_until, False

            def synchronize(self):
                self.done = True

            def elapsed_time(self, other):  # torch's contract: ms, both events completed
                assert self.done and other.done, "elapsed_time read before the GPU passed the events"
                return (other.at - self.at) * 1e3

        return Event()


def test_cuda_event_clock_spans_report_gpu_time_not_issue_time():
    """Under nccl a span's ends are CUDA events on the stream: a kernel queued in 1 us of
    Python that runs 5 ms on the GPU is a 5 ms span, read only once the GPU has passed it."""
    stream = _FakeStream()
    stream.kernel(0.002)                                   # work queued before the origin
    rec = trace.Recorder(rank=2)
    rec.gpu = trace.CudaEventClock(event=stream.event)
    with rec.span("gemm"):
        stream.kernel(0.005)
    start = rec.now()
    stream.kernel(0.001)
    rec.add("all-reduce", "comm", start, rec.now(), "dp")  # the Comm layer's path
    assert not isinstance(rec.spans[0].start, float)       # pending until collected
    spans = rec.resolve()
    assert [(s.name, s.start, s.end) for s in spans] == [("gemm", 0.0, 0.005), ("all-reduce", 0.005, 0.006)]
    assert all(isinstance(t, float) for s in spans for t in (s.start, s.end)) and spans[1].dim == "dp"
    assert json.loads(json.dumps(trace.to_chrome_trace(spans)))["traceEvents"]
    later = rec.now()
    stream.kernel(0.003)
    assert rec.now() - later == pytest.approx(0.003)       # a stamp subtracts as seconds
