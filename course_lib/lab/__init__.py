"""The lab: what runs experiments for the chapters, apart from the library a learner reads.

Each module here starts ranks (``course_lib.launch``) to measure or check something a
chapter prints: ``ddp_buckets`` (chapter 3: the bucket sweep), ``zero_measurements``
(chapter 4: the measured ZeRO tables), ``pipeline_runs`` (chapter 6: equal pipeline chunks
on the virtual clock), ``nd_runs`` (chapter 9: layouts trained on real ranks),
``nd_exercise_runs`` (the real runs behind chapter 9's graders),
``recompute_runs`` and ``precision_runs`` (chapter 9b), ``virtual_runs`` (chapter 10: a
step on the virtual clock beside the planner), ``benchmarks`` (chapter 5's side-by-side
timings), ``measure`` (timing collectives across ranks) and ``calibration`` (the planner's
constants measured on this machine). Only ``lab/`` and ``grading/`` start ranks; the
library's modules build what these runs call.
"""
