"""The dry run's memory next to published figures and the planner's (issue #36).

    python benchmarks/dry_run_memory.py                  # everything (about a minute of CPU)
    python benchmarks/dry_run_memory.py --quick          # first stage on 16 layers, not 96

1. ZeRO's Table 1 (Rajbhandari et al. 2020): model-state GB per GPU of a 7.5B model (K = 12)
   at 1 to 1024 devices, stages 1-3: the paper, the formula at the paper's 7.5e9 parameters,
   and for the course's 7.47B GPT (Narayanan et al. 2021's 7.5B shape) the formula, the
   planner and the dry run (its "states" category: no activation counted). Then the bytes per
   parameter in the dry run's two precisions, and ZeRO-1/2 as chapter 4's ShardedOptimizer
   measured them on real ranks (the dry run runs them too: parallelize_nd's zero_nd).
2. Korthikanti et al. 2022: one layer's activation bytes per micro-batch (Table 2) at GPT 22B
   and 175B, TP 8, with and without SP, each recomputation: the paper's formula, the planner,
   the course's terms and the dry run (two layers' peak minus one's), in units of s b h. Then
   the first stage's peak under 1F1B and interleaving (v = 2) at the paper's 175B layout next
   to L x one layer x (1 + (p - 1) / (p v)).
3. FSDP: the dry run's activation category under DDP and FSDP for the same step.
"""
import argparse
import time

from course_lib.lab import dry_run_memory as M
from course_lib.planner import formulas as F
from course_lib.planner.validation import MEGATRON_2022

GB = 1e9


def zero_section():
    began = time.process_time()
    rows = M.zero_table1_rows(dry_stages=(1, 2, 3))
    print(f"ZeRO Table 1, model states GB/GPU; P = {M.ZERO_MODEL.name}'s "
          f"{F.param_count(M.ZERO_MODEL):,} parameters; formula(7.5e9) is planner.validation.zero_table1's")
    print(M.format_rows(rows, M.ZERO_COLUMNS))
    exact = all(r["dry_bytes"] == r["P_formula_bytes"] for r in rows if r["dry_bytes"] is not None)
    print(f"dry run (stages 1-3) == the formula to the byte at every N: {exact}")
    over = {r["N"]: r["planner_GB"] / r["P_formula_GB"] - 1 for r in rows if r["stage"] == 1}
    print("planner over formula(P): " + ", ".join(f"N={n} {d:+.1%}" for n, d in over.items())
          + "  (it counts a tied LM head a second time at pp = 1)")
    print(f"  [{time.process_time() - began:.1f} s CPU]\n")
    print("bytes per parameter, dry run (dp 1, DDP) against the formula for the same training:")
    for r in M.precision_rows():
        print(f"  cluster dtype {r['dtype']:9s} {r['training']:17s} dry run {r['dry_per_param']:5.2f}"
              f"   formula {r['formula_per_param']:5.2f}")
    print("  (the dry run always adds an fp32 master copy, 4 bytes: right for mixed precision,\n"
          "   one copy too many for fp32 training, which updates its parameters in place)\n")
    print("ZeRO-1/2 as the course runs them: chapter 4's ShardedOptimizer on real ranks (fp32 AdamW, K = 8):")
    for r in M.sharded_optimizer_rows():
        print(f"  stage {r['stage']} N={r['N']}: measured {r['measured']:,} B, formula {r['formula']:,} B, "
              f"extra {r['extra']} B (AdamW's fp32 step count per tensor)")
    print()


def activation_section(quick):
    began = time.process_time()
    rows = M.activation_rows()
    print("one layer, one micro-batch (b = 1, s = 2048), TP 8, in units of s*b*h bytes:")
    print("model    | SP | recompute | paper   | planner | course terms | dry run | dropout")
    for r in rows:
        u = r["sbh"]
        print(f"{r['model']:8s} | {'y' if r['sp'] else 'n':2s} | {r['recompute']:9s} | {r['paper'] / u:7.4f} | "
              f"{r['planner'] / u:7.4f} | {r['course_terms'] / u:12.4f} | {r['dry'] / u:7.4f} | {r['dropout'] / u:.4f}")
    same = all(r["dry"] == r["course_terms"] for r in rows)
    print(f"dry run == course terms (paper - dropout + LayerNorm statistics) to the byte: {same}")
    print("  dropout: the paper's masks (2 sbh, /t with SP) and attention dropout (3 a s^2 b / t); the dry run's\n"
          "  model has dropout 0. LayerNorm's fp32 mean and rstd: 8 B/token as the dry run counts them\n"
          "  (every saved tensor scaled to 2 bytes), 16 in a bf16 run.")
    print(f"  [{time.process_time() - began:.1f} s CPU]\n")
    began = time.process_time()
    first = M.first_stage_rows(n_layers=16 if quick else None)
    print(f"first stage's activation peak, {first[0]['model']}, TP 8 + SP, selective, PP 8, m = 16, GB:")
    print("schedule    | factor | in flight | paper  | planner | rule x dry layer | dry run | rest (B)")
    for r in first:
        print(f"{r['schedule']:11s} | {r['factor']:6.4f} | {r['in_flight']:9.2f} | {r['paper'] / GB:6.3f} | "
              f"{r['planner'] / GB:7.3f} | {r['rule_dry_layer'] / GB:16.3f} | {r['dry'] / GB:7.3f} | {r['rest']}")
    print("  rule: L x one layer x factor; rest: the embeddings' saved token and position ids (int64) and\n"
          "  vocab-parallel mask (bool), per first-chunk forward in flight, counted at half (2-byte scaling)")
    print(f"  [{time.process_time() - began:.1f} s CPU]\n")


def fsdp_section():
    spec = M.with_layers("megatron-22b", 2)
    got = M.fsdp_activations(spec, MEGATRON_2022, dp=4, tp=8, sp=True, recompute="selective")
    print(f"{spec.name}, DP4 x TP8 + SP, selective: dry run's activation category, DDP {got['ddp'] / GB:.3f} GB, "
          f"FSDP {got['fsdp'] / GB:.3f} GB")
    print("  FSDP's own saved_tensors_hooks (torch calls only the innermost pair) hand every saved\n"
          "  tensor but its gathered parameters on to the runner's count: the same bytes as DDP.")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first stage on a 16-layer cut of 175B")
    args = ap.parse_args(argv)
    zero_section()
    activation_section(args.quick)
    fsdp_section()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
