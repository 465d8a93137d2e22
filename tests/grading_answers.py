"""Shared by the grader tests: run a grader on an answer and read its one line."""
from __future__ import annotations


def graded(capsys, checker, *answers, **kw):
    """(passed, the printed line) of ``checker(*answers)``."""
    capsys.readouterr()
    ok = checker(*answers, **kw)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    return ok, lines[0]


def fails_with(capsys, checker, *answers, hint, **kw):
    """The answer fails, and the line contains ``hint`` (a piece of the expected advice)."""
    ok, line = graded(capsys, checker, *answers, **kw)
    assert ok is False and "FAILED" in line, line
    hints = (hint,) if isinstance(hint, str) else hint
    assert any(h in line for h in hints), f"hint {hint!r} missing from: {line}"
    return line


def failed(capsys, name, *hints):
    """The one printed line is ``name``'s FAILED line and contains every hint."""
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"{name}: FAILED"), line
    assert "\n" not in line
    for hint in hints:
        assert hint in line, line
    return line


def refused(capsys, name, outcome, *hints):
    """A check returned False (``outcome``) and printed its FAILED line with every hint."""
    assert outcome is False, outcome
    return failed(capsys, name, *hints)


def passed(capsys, outcome, line):
    """A check returned True (``outcome``) and printed exactly its pass ``line``."""
    assert outcome is True, capsys.readouterr().out
    assert capsys.readouterr().out.strip() == line


def rank_world():
    """(rank, world size) inside a rank of a graded case."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def exchange(send, dst, recv, src):
    """Send ``send`` to ``dst`` while receiving ``recv`` from ``src`` (no deadlock either way)."""
    import torch.distributed as dist

    reqs = [dist.isend(send, dst), dist.irecv(recv, src)]
    for r in reqs:
        r.wait()
