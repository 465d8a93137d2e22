"""The planner against the dry run on random valid layouts (three presets x two GPUs).

    python benchmarks/dry_run_vs_planner.py              # 54 layouts and their CP twins (minutes)
    python benchmarks/dry_run_vs_planner.py -n 6 --seed 1
    python benchmarks/dry_run_vs_planner.py --saved benchmarks/dry_run_vs_planner.json --saved-only

``--saved FILE``: the dry runs already made are read from FILE (JSON) and the new ones
written back (the planner is re-run every time: a changed planner is compared at once).

Prints, row by row as they finish: the layout, the planner's step time (runtime="course")
and the dry run's (course_lib.virtual.dry_run), their ratio, both peak memories and theirs,
and for a row over 10% the part of the step where the two differ most (the cause); then, per
part, the planner's and the dry run's seconds summed over the rows, and the summary.
"""
import argparse
import json
import os

from course_lib.lab.dry_run_sweep import format_rows, stable_keys, sweep_rows, sweep_summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=54, help="layouts (cycling over models x GPUs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--saved", help="JSON file of dry runs already made (read, then updated)")
    ap.add_argument("--saved-only", action="store_true", help="only the layouts --saved holds (instant)")
    ap.add_argument("--no-moe-groups", action="store_true", help="without each drawn MoE layout again beside "
                                                                 "tp 2 + SP and cp 2 (lab.dry_run_sweep.sweep_layouts)")
    ap.add_argument("--no-split", action="store_true", help="without each drawn pipeline layout again under ZB-H1, "
                                                            "ZB-V and DualPipeV (lab.dry_run_sweep.split_twins)")
    ap.add_argument("--no-moe-zero", action="store_true",
                    help="without each drawn MoE layout at dp > 1 again under ZeRO-1, 2 and 3 "
                         "(lab.dry_run_sweep.sweep_layouts)")
    ap.add_argument("--no-moe-etp", action="store_true",
                    help="without each drawn MoE layout again with etp 2, alone and beside tp 2 + SP "
                         "(lab.dry_run_sweep.sweep_layouts)")
    args = ap.parse_args(argv)
    dry = {}
    if args.saved and os.path.exists(args.saved):
        with open(args.saved) as f:
            dry = stable_keys(json.load(f))

    def save(runs):
        with open(args.saved, "w") as f:
            json.dump(runs, f, indent=0, sort_keys=True)
    rows = sweep_rows(args.n, args.seed, progress=True, dry=dry, saved=save if args.saved else None,
                      run_missing=not args.saved_only, moe_groups=not args.no_moe_groups,
                      split=not args.no_split, moe_zero=not args.no_moe_zero, moe_etp=not args.no_moe_etp)
    print()
    print(format_rows(rows))
    for part in rows[0]["dry_parts"]:
        p, d = (sum(r[k][part] for r in rows) for k in ("planner_parts", "dry_parts"))
        print(f"  {part:20s} planner {p:8.3f} s   dry run {d:8.3f} s   (summed over the rows)")
    print(sweep_summary(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
