"""A schedule by name: the course's names and torch's spellings of them
(:func:`schedule_name`), the chunks per rank each runs (:func:`chunks`), and the builder
behind each name (:func:`make_schedule`)."""
from __future__ import annotations

from course_lib.schedules.actions import SCHEDULES, V_SCHEDULES
from course_lib.schedules.classic import gpipe, interleaved_1f1b, one_f_one_b
from course_lib.schedules.zero_bubble import dualpipe_v, zero_bubble_h1, zero_bubble_v

# Other spellings of the same schedules, compared case-insensitively: torch.distributed.pipelining's
# names (``get_schedule_class`` and the class names). Not torch's "InterleavedZeroBubble": with one
# stage per rank it places the W passes differently when m < p, and with v > 1 it is another schedule.
SCHEDULE_ALIASES = {"gpipe": "gpipe", "schedulegpipe": "gpipe", "1f1b": "1f1b", "schedule1f1b": "1f1b",
                    "interleaved": "interleaved", "interleaved1f1b": "interleaved",
                    "scheduleinterleaved1f1b": "interleaved", "zb-h1": "zb-h1", "zero-bubble": "zb-h1",
                    "zb-v": "zb-v", "zbvzerobubble": "zb-v", "schedulezbvzerobubble": "zb-v",
                    "dualpipe-v": "dualpipe-v", "dualpipev": "dualpipe-v", "scheduledualpipev": "dualpipe-v"}


def schedule_name(name, v: int = 1) -> str:
    """The course's name (one of SCHEDULES) for ``name``, in any case or in torch's spelling
    ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"). ValueError for an unknown
    name, and for v > 1 chunks per rank with a schedule that runs one (only "interleaved" takes
    v; the V schedules run two, v = 1 or 2 both meaning their own two)."""
    canon = SCHEDULE_ALIASES.get(name.lower()) if isinstance(name, str) else None
    if canon is None:
        raise ValueError(f"schedule must be one of {SCHEDULES} (or torch's GPipe, 1F1B, Interleaved1F1B, "
                         f"ZBVZeroBubble, DualPipeV), got {name!r}")
    if canon in V_SCHEDULES and v not in (1, 2):
        raise ValueError(f"{name!r} runs two chunks per rank in V order: v must be 2 (or 1, its default), got {v!r}")
    if canon not in V_SCHEDULES and canon != "interleaved" and v != 1:
        raise ValueError(f"v={v!r} chunks per rank needs the interleaved schedule; {name!r} runs one stage per rank")
    return canon


def chunks(schedule, v: int = 1) -> int:
    """Model chunks per rank the schedule runs: 2 for the V schedules, ``v`` otherwise."""
    return 2 if isinstance(schedule, str) and schedule_name(schedule, v) in V_SCHEDULES else v


def make_schedule(name: str, p: int, m: int, v: int = 1):
    """One of SCHEDULES by name (:func:`schedule_name`; ``v`` > 1 only for "interleaved")."""
    name = schedule_name(name, v)
    builders = {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1, "zb-v": zero_bubble_v,
                "dualpipe-v": dualpipe_v}
    return interleaved_1f1b(p, m, v) if name == "interleaved" else builders[name](p, m)


__all__ = ["SCHEDULE_ALIASES", "schedule_name", "chunks", "make_schedule"]
