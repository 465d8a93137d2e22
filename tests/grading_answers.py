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
