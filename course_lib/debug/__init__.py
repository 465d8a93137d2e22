"""When a distributed run goes wrong: the tools of chapter 11.

* :mod:`~course_lib.debug.flight_recorder` -- every rank's last N communication calls, in a
  ring the launcher reads after a hang or a death without the rank's help;
* :mod:`~course_lib.debug.diagnosis` -- all ranks' records merged into one explanation
  (``LaunchTimeout.diagnosis`` / ``RankError.diagnosis``);
* :mod:`~course_lib.debug.desync` -- ``launch(fn, n, debug="desync")``: members compare a
  fingerprint of each collective before running it;
* :mod:`~course_lib.debug.bisect` -- the first step and parameter whose gradient differs from
  one device, and which dimension's reduction is missing, doubled or wrongly scaled;
* :mod:`~course_lib.debug.nonfinite` -- the first op that produced a NaN or an Inf.

This package sits below the communication layer (``Comm`` calls into it): it imports
nothing of course_lib above ``trace`` and ``tolerance``.
"""
from course_lib.debug.diagnosis import diagnose
from course_lib.debug.flight_recorder import Record

__all__ = ["diagnose", "Record"]
