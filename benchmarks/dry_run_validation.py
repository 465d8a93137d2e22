"""The planner's validation rows run by the course's own program on the virtual clock.

    python benchmarks/dry_run_validation.py                      # every row (tens of minutes)
    python benchmarks/dry_run_validation.py --source "Korthikanti 2022 T5" --model "GPT 175B"

Prints, row by row as they finish: the published step time, the planner's, the dry run's
(course_lib.virtual.dry_run, with each source's software, dropout and rank order: lab.dry_runs.SOFTWARE,
DROPOUT, ORDER),
their errors, the memory per GPU of both and the wall time; then the mean and worst |error| of the dry run and of the planner over the rows that ran.
"""
import argparse
import json
import sys

from course_lib.lab.dry_runs import DROPOUT, ORDER, SOFTWARE, SOURCES, format_table, summary, validation_rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", action="append", choices=SOURCES, help="a source (repeat; default: all)")
    ap.add_argument("--model", action="append", help="a row's model name (repeat; default: all)")
    ap.add_argument("--progress", type=float, default=60.0, help="seconds between progress lines")
    ap.add_argument("--json", help="also write the rows to this JSON file (course_lib.lab.dry_run_table "
                                   "records them for chapter 10)")
    args = ap.parse_args(argv)
    rows = validation_rows(tuple(args.source or SOURCES), models=args.model, progress=args.progress)
    print()
    print(format_table(rows))
    for source in dict.fromkeys(r["source"] for r in rows):
        print(f"  {source}: software as stated: {', '.join(SOFTWARE[source]) or 'the course as it is'}; "
              f"dropout {DROPOUT[source]:g}; ranks " + (" > ".join(ORDER[source]) if ORDER[source] else "the course's"))
    for r in rows:
        if r["note"]:
            print(f"  {r['model']}: {r['note']}")
    print(summary(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
