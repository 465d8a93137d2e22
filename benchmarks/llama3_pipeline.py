"""Where Llama 3 405B's 8k-token step goes on 8,192 and on 16,384 H100s (Table 4), by pipeline.

    python benchmarks/llama3_pipeline.py                 # the paper's v = 8 chunks, then v = 2 and 7
    python benchmarks/llama3_pipeline.py --variants paper

The two rows differ only in DP (64 -> 128) at the same 16M tokens a step, so each replica runs
half the micro-batches (32 -> 16) of the same work. Each dry run (course_lib.virtual.dry_run,
Llama 3's software: lab.dry_runs.SOFTWARE) splits into the time a middle pipeline rank spends in
its forward and backward actions (B: the work, proportional to m) and the rest of the step (O:
bubble, exposed sends, the DP sum, the optimizer). The paper's two throughputs give the same
split by solving T8k = B + O, T16k = B / 2 + O (same O in both rows: (p - 1) chunk passes of
the same chunks). Variants: "paper" (v = 8, the embedding and the output alone in their chunks,
planner.validation.llama3_layout), "v2" (the course's rule before it could cut them), "v7" (the
most chunks without them: first chunks of two layers).
"""
import argparse
import re
import sys

from course_lib.lab.dry_runs import SOFTWARE
from course_lib.planner import estimate
from course_lib.planner.validation import LLAMA3_TABLE4, llama3_layout
from course_lib.virtual import dry_run

ACTION = re.compile(r"[FBWI]\d+(?:@\d+)?$")
VARIANTS = {"paper": {}, "v2": dict(v=2, stage_layers=()), "v7": dict(v=7, stage_layers=())}


def split_step(r) -> tuple:
    """(B, O) of a dry run: a middle pipeline rank's seconds inside its F/B actions, the rest."""
    busy = {}
    for sp in r.spans:
        if sp.dim == "pp" and sp.kind == "compute" and ACTION.match(sp.name):
            busy[sp.rank] = busy.get(sp.rank, 0.0) + sp.end - sp.start
    ranks = sorted(busy)
    b = busy[ranks[len(ranks) // 2]]
    return b, r.step_time - b


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args(argv)
    published = []
    for gpus, tp, cp, pp, dp, s, tflops in LLAMA3_TABLE4[:2]:
        est = estimate("llama3-405b", "h100-sxm", llama3_layout(tp, cp, pp, dp, s))
        published.append(est.model_flops / (tflops * 1e12 * gpus))
    o = 2 * published[1] - published[0]
    print(f"paper: {published[0]:.3f} s and {published[1]:.3f} s -> B {published[0] - o:.3f} s, O {o:.3f} s")
    print(f"{'variant':<8}{'GPUs':>6}{'m':>4}{'dry s':>8}{'err':>7}{'B s':>8}{'O s':>7}{'plan s':>8}{'err':>7}")
    for name in args.variants:
        for (gpus, tp, cp, pp, dp, s, _), pub in zip(LLAMA3_TABLE4[:2], published):
            layout = llama3_layout(tp, cp, pp, dp, s).with_(**VARIANTS[name])
            est = estimate("llama3-405b", "h100-sxm", layout)
            r = dry_run("llama3-405b", "h100-sxm", layout, progress=None,       # ZeRO-2, as stated
                        fusions=SOFTWARE["Llama 3 T4"])
            b, rest = split_step(r)
            print(f"{name:<8}{gpus:>6}{layout.microbatches:>4}{r.step_time:8.3f}{r.step_time / pub - 1:+7.1%}"
                  f"{b:8.3f}{rest:7.3f}{est.step_time:8.3f}{est.step_time / pub - 1:+7.1%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
