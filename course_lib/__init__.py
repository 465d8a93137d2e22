"""course_lib: the small library behind the N-D parallelism course.

Three wings, by who reads them:

* the library a learner reads, one room per idea: ``launch`` (run ranks from a notebook),
  ``trace`` (per-rank spans), ``collectives`` (from send/recv), ``parallel`` (DP, ZeRO,
  FSDP, TP, PP, CP, EP and their composition), ``models``, ``planner`` (cluster-scale
  estimates), ``virtual`` (a modelled GPU clock), ``debug``, ``checkpoint``, ``precision``,
  ``viz`` (static figures). It builds what runs; it never starts ranks itself.
* ``lab``: the chapters' experiments and measurements (``nd_runs``, ``recompute_runs``,
  ``precision_runs``, ``virtual_runs``, ``benchmarks``, ``measure``, ``calibration``), each
  starting its own ranks.
* ``grading``: the graders that check a learner's answers.

Only ``lab`` and ``grading`` call ``launch`` (``examples`` are scripts for torchrun).
"""
from course_lib.launch import LaunchResult, LaunchTimeout, RankError, launch
from course_lib.trace import Span, span

__all__ = ["launch", "LaunchResult", "LaunchTimeout", "RankError", "span", "Span"]
__version__ = "0.1.0"
