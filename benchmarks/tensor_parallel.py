"""Our tensor (+ sequence) parallelism next to torch's DTensor version, on the same tiny GPT.

    python benchmarks/tensor_parallel.py                  # TP = 2 and 4, gloo on this machine
    python benchmarks/tensor_parallel.py --tp 2 --rounds 6 --hidden 256

For each TP size one launch builds four models from the same single-device weights:
ours (``course_lib.parallel.tp_plan.parallelize``) and torch's
(``torch.distributed.tensor.parallel.parallelize_module`` with ColwiseParallel /
RowwiseParallel / SequenceParallel / PrepareModuleInput and ``loss_parallel``: torchtitan's
Llama plan), each without and with sequence parallelism. A step is forward + backward
(+ our SP norm-gradient all-reduce) + AdamW. The implementations run in alternating rounds
(ours, torch's, torch's, ours, ...) so machine noise hits both alike; reported: the median
step time (slowest rank), the ratio ours / torch's (goal: <= 1.3 at TP = 2 and 4), and the
bytes one rank handed to the kernel in one step (``/proc/self/io``: every gloo message,
headers included), next to ``planner.formulas.tp_bytes_per_layer`` x layers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from course_lib.lab.benchmarks import tensor_parallel_step_times  # noqa: E402
from course_lib.launch import launch  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args(argv)
    import torch

    from course_lib.models import GPTConfig, TinyGPT, n_params
    from course_lib.planner.formulas import tp_bytes_per_layer

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                    n_heads=max(4, args.hidden // 64))
    print(f"TinyGPT (Llama block): {n_params(TinyGPT(cfg)) / 1e6:.2f} M parameters, h={cfg.hidden}, "
          f"a={cfg.n_heads}, f={cfg.ffn_hidden}, L={cfg.n_layers}, s={cfg.seq_len}, batch {args.batch}, "
          f"AdamW fp32; torch {torch.__version__}, {os.cpu_count()} cores; median of {args.rounds} x "
          f"{args.steps} interleaved steps\n")
    print(f"{'tp':>3}  {'implementation':<13}{'median step':>12}{'ours/torch':>11}{'bytes/rank/step':>17}"
          f"{'formula (layers)':>18}")
    goals = []
    for t in args.tp:
        res = launch(tensor_parallel_step_times, t, cfg, args.steps, args.rounds, args.batch, timeout=1800)
        for mode in ("TP", "TP+SP"):
            formula = cfg.n_layers * tp_bytes_per_layer(cfg.seq_len, args.batch, cfg.hidden, t,
                                                        sp=mode == "TP+SP", dtype_bytes=4)
            ours, theirs = f"ours {mode}", f"torch {mode}"
            for k in (ours, theirs):
                step_t = statistics.median(r[k][0] for r in res)
                sent = res[0][k][1]
                ratio = step_t / statistics.median(r[theirs][0] for r in res)
                print(f"{t:>3}  {k:<13}{step_t * 1e3:>10.1f}ms{ratio:>10.2f}x"
                      f"{'n/a' if sent is None else f'{sent:,}':>17}{formula:>18,.0f}")
            goals.append((t, mode, statistics.median(r[ours][0] for r in res) /
                          statistics.median(r[theirs][0] for r in res)))
    print("\ngoal (ours <= 1.3x torch's step time): " +
          "; ".join(f"TP={t} {m}: {ratio:.2f}x {'met' if ratio <= 1.3 else 'NOT met'}" for t, m, ratio in goals))


if __name__ == "__main__":
    main()
