"""Llama 3 405B's Table 4 rows on the dry run: where each row's peak memory goes.

    python benchmarks/llama3_memory.py                       # the three rows (a minute of CPU each)
    python benchmarks/llama3_memory.py --gpus 8192           # the 8k row on 8,192 GPUs

Prints, per row (course_lib.lab.llama3_memory): the peak stage's model states and activations,
the activations as the layers in flight (counted on the schedule the ranks run) times one
layer's saved bytes at the row's shape (and in s b h / t), what a layer could save and fit the
80 GiB, what the accounting leaves out, every stage; then what Dubey et al. 2024 say about
memory (Sec. 3.3.2), quoted.
"""
import argparse

from course_lib.lab.llama3_memory import PAPER, breakdown_rows, format_breakdown, llama_rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, action="append", help="rows on so many GPUs (repeat; default: all)")
    ap.add_argument("--seq", action="append", choices=("8k", "128k"), help="rows of this sequence (repeat)")
    args = ap.parse_args(argv)
    names = [(run[1], run[4].n_gpus) for run in llama_rows()
             if (not args.gpus or run[4].n_gpus in args.gpus) and (not args.seq or run[1].endswith(tuple(args.seq)))]
    print(format_breakdown(breakdown_rows(names)))
    print()
    for key, text in PAPER.items():
        print(f"{key}: \"{text}\"")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
