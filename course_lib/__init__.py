"""course_lib: the small library behind the N-D parallelism course.

One room per idea: ``launch`` (run ranks from a notebook), ``trace`` (per-rank
spans), ``viz`` (static figures), ``collectives`` (from send/recv), ``parallel``
(DP, ZeRO, FSDP, ...), ``planner`` (cluster-scale estimates), ``grading``.
"""
from course_lib.launch import LaunchResult, LaunchTimeout, RankError, launch
from course_lib.trace import Span, span

__all__ = ["launch", "LaunchResult", "LaunchTimeout", "RankError", "span", "Span"]
__version__ = "0.1.0"
