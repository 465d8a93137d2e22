"""Every rank's flight-recorder records merged into one explanation of a hang or a crash.

    text = diagnose({rank: [Record, ...]}, outcomes={2: "raised ValueError"})

Three kinds of finding, in this order (each line names ranks, calls and groups):

1. **Disagreements**: the members of a group reached the same position (the same sequence
   number on that group) with different calls: "different ops at the same position",
   "shapes differ at all_reduce #4 on dp [0, 1]: (8, 64) on rank 0 vs (8, 32) on rank 1";
   a message whose send and receive disagree in shape.
2. **Who waits for whom**: each rank blocked in a call (state "waiting"), grouped by call,
   and for each member that never reached it, where that member is instead: in another
   group's call, in a send with no matching receive ("both ranks send first"), returned,
   raised, dead, or not in any communication call.
3. Nothing recorded: the run never went through the communication layer.

It reads records only -- never the ranks -- so it cannot hang, and it depends on what each
rank had called, not on timing: a rank blocked in a call stays there. :func:`stuck` says which
ranks will not move again (the launcher waits for all of them before it diagnoses).
"""
from __future__ import annotations

import textwrap

from course_lib.debug.flight_recorder import Record, shape_text

WIDTH = 76   # the book's output column at 1280 px
NOTHING = "no rank is blocked in a communication call and every position recorded agrees"


def ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


def _by_group(records: dict) -> dict:
    """{(dim, ranks): {seq: {rank: Record}}} of the collectives."""
    out = {}
    for rank, recs in records.items():
        for r in recs:
            if not r.p2p:
                out.setdefault((r.dim, r.ranks), {}).setdefault(r.seq, {})[rank] = r
    return out


def _p2p_key(r: Record, direction: str, peer: int):
    return (r.dim, r.ranks, direction, peer, r.tag)


def _by_p2p(records: dict) -> dict:
    """{(rank, (dim, ranks, op, peer, tag)): {seq: Record}} of the messages."""
    out = {}
    for rank, recs in records.items():
        for r in recs:
            if r.p2p:
                out.setdefault((rank, _p2p_key(r, r.op, r.peer)), {})[r.seq] = r
    return out


def _variants(members: dict, field) -> list:
    """[(value, [ranks])] for the distinct values of ``field(record)``, by first rank."""
    seen = {}
    for rank in sorted(members):
        seen.setdefault(field(members[rank]), []).append(rank)
    return list(seen.items())


def _sites(members: dict, variants) -> str:
    parts = []
    for _, ranks in variants:
        sites = sorted({members[r].site for r in ranks if members[r].site})
        if sites:
            parts.append(f"{ranks_text(ranks)} from {' / '.join(sites)}")
    return " (" + "; ".join(parts) + ")" if parts else ""


def disagreements(records: dict) -> list:
    """The first position on each group where its members' calls differ."""
    lines = []
    for (dim, ranks), by_seq in sorted(_by_group(records).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for seq in sorted(by_seq):
            members = by_seq[seq]
            if len(members) < 2 or len({m.fingerprint() for m in members.values()}) == 1:
                continue
            first = members[min(members)]
            where = f"#{seq} on {first.group}"
            ops = _variants(members, lambda m: m.name.split(" #")[0])
            if len(ops) > 1:
                what = " vs ".join(f"{op} on {ranks_text(rs)}" for op, rs in ops)
                lines.append(f"different ops at the same position, {where}: {what}{_sites(members, ops)}")
            else:
                show = {"shapes": shape_text, "dtypes": ", ".join, "reduce ops / roots": str}
                for label, field in (("shapes", lambda m: m.fingerprint()[1]), ("dtypes", lambda m: m.dtypes),
                                     ("reduce ops / roots", lambda m: m.extra)):
                    vs = _variants(members, field)
                    if len(vs) > 1:
                        text = " vs ".join(f"{show[label](v)} on {ranks_text(rs)}" for v, rs in vs)
                        lines.append(f"{label} differ at {ops[0][0]} {where}: {text}{_sites(members, vs)}")
                        break
            break  # later positions on this group follow from this one
    return lines


def message_mismatches(records: dict) -> list:
    """Sends whose matching receive (same pair, group, tag and number) has another shape or dtype."""
    msgs, lines = _by_p2p(records), []
    for (rank, (dim, ranks, op, peer, tag)), by_seq in sorted(msgs.items()):
        if op != "send":
            continue
        recvs = msgs.get((peer, (dim, ranks, "recv", rank, tag)), {})
        for seq in sorted(by_seq):
            s, r = by_seq[seq], recvs.get(seq)
            if r is not None and (s.shapes, s.dtypes) != (r.shapes, r.dtypes):
                lines.append(f"shapes differ at send #{seq} rank {rank} -> rank {peer}: {shape_text(s.shapes)} "
                             f"{', '.join(s.dtypes)} sent vs {shape_text(r.shapes)} {', '.join(r.dtypes)} "
                             f"received ({s.site} / {r.site})")
                break
    return lines


def _blocking(recs: list):
    """The call a rank is blocked in: its latest record in state waiting; else, under NCCL,
    the first one enqueued on the GPU and not completed (a stream runs its kernels in
    order, and the CPU may have enqueued many more behind it); None: not blocked."""
    waiting = [r for r in recs if r.state == "waiting"]
    if waiting:
        return waiting[-1]
    return next((r for r in recs if r.state == "enqueued"), None)


def _reached(records, member, key, seq) -> bool:
    on_group = [r.seq for r in records.get(member, ()) if not r.p2p and (r.dim, r.ranks) == key]
    return bool(on_group) and max(on_group) >= seq


def _messages(records, rank, key) -> int:
    return max([r.seq for r in records.get(rank, ()) if r.p2p and _p2p_key(r, r.op, r.peer) == key] or [0])


def _where(records, outcomes, member) -> str:
    """Where a member is instead: the call it blocks in (also if a peer's failure then ended it:
    the same words whatever the timing), or how it ended."""
    recs = records.get(member, [])
    b = _blocking(recs)
    if b is not None:
        return f"it is in {b.name}"
    last = f" after {recs[-1].name}" if recs else " before any communication call"
    outcome = outcomes.get(member, "running")
    if outcome != "running":
        return f"it {outcome}{last}"
    return f"it is not in a communication call (computing, or waiting elsewhere){last}"


def waits(records: dict, outcomes: dict) -> list:
    """Who waits in which call, and where each member that never reached it is."""
    groups = {}   # the call -> (blocked ranks, its record on the first of them)
    for rank in sorted(records):
        b = _blocking(records[rank])   # (a rank a peer's failure then ended still shows its call)
        if b is not None:
            key = (b.op, b.dim, b.ranks, b.seq, b.peer, b.tag) if b.p2p else (b.op, b.dim, b.ranks, b.seq)
            groups.setdefault(key, ([], b))[0].append(rank)
    lines = []
    for key, (ranks, b) in sorted(groups.items(), key=lambda kv: kv[1][0]):
        head = f"{ranks_text(ranks)} wait{'s' if len(ranks) == 1 else ''} in {b.name}"
        if b.p2p:
            lines.append(head + _message_partner(records, outcomes, ranks[0], b))
            continue
        missing = [m for m in b.ranks if m not in ranks and not _reached(records, m, (b.dim, b.ranks), b.seq)]
        parts = []
        for m in missing:
            where = _where(records, outcomes, m)
            other = _blocking(records.get(m, []))
            note = ""
            if other is not None and other.index == b.index:   # the same position in each rank's calls
                note = (": different ops at the same position" if other.fingerprint() != b.fingerprint()
                        else ": the same call at the same position, on another group")
                note += f" (call {b.index} of each rank)"
            parts.append(f"{ranks_text([m])} never reached #{b.seq}: {where}{note}")
        lines.append(head + ("; " + "; ".join(parts) if parts else ""))
    return lines


def _message_partner(records, outcomes, rank, b) -> str:
    """Why a send or receive does not complete: its partner's count of the matching calls."""
    mirror = "recv" if b.op == "send" else "send"
    matched = _messages(records, b.peer, (b.dim, b.ranks, mirror, rank, b.tag))
    if matched >= b.seq:
        return f" (matched by rank {b.peer}'s {mirror} #{b.seq})"
    other = _blocking(records.get(b.peer, []))
    if b.op == "send":
        text = f": send to rank {b.peer} with no matching receive"
        if other is not None and other.op == "send" and other.peer == rank:
            return text + " (both ranks send first)"
        cycle = _send_cycle(records, rank)
        if cycle:
            return text + f" ({ranks_text(cycle)} all send first: a cycle)"
    else:
        text = f": receive from rank {b.peer} with no matching send"
    return f"{text}; rank {b.peer}: {_where(records, outcomes, b.peer)}"


def _send_cycle(records, rank) -> list:
    """The ranks of a cycle of blocked sends through ``rank`` (each sends to the next), or []."""
    seen, r = [], rank
    while r not in seen:
        seen.append(r)
        b = _blocking(records.get(r, []))
        if b is None or b.op != "send":
            return []
        r = b.peer
    return seen if r == rank else []


def stuck(recs: dict, ended: dict) -> set:
    """Ranks that will not move again: ended, never used the communication layer, or blocked
    in a call whose missing member is itself stuck (a fixpoint)."""
    out = {r for r in recs if r in ended or not recs[r]}
    changed = True
    while changed:
        changed = False
        for r in recs:
            if r in out:
                continue
            b = _blocking(recs[r])
            if b is None:
                continue
            if _waits_on_stuck(recs, r, b, out):
                out.add(r)
                changed = True
    return out


def _waits_on_stuck(recs, r, b, out) -> bool:
    """Does rank r's blocking call ``b`` need a rank in ``out`` that will never join it, or
    a member that joined with another call (a mismatch never completes)?"""
    if b.p2p:
        mirror = "recv" if b.op == "send" else "send"
        return b.peer in out and _messages(recs, b.peer, (b.dim, b.ranks, mirror, r, b.tag)) < b.seq
    for m in b.ranks:
        if m == r:
            continue
        theirs = next((x for x in recs.get(m, ()) if not x.p2p and (x.dim, x.ranks, x.seq) == (b.dim, b.ranks, b.seq)),
                      None)
        if theirs is not None and theirs.fingerprint() != b.fingerprint():
            return True
        if m in out and (theirs is None or theirs.state != "completed"):
            return True
    return False


def diagnose(records: dict, outcomes: dict | None = None) -> str:
    """The explanation, one finding per (wrapped) line; ``outcomes``: {rank: "returned from fn",
    "raised ValueError", "was killed by SIGKILL", ...} for the ranks no longer running."""
    outcomes = outcomes or {}
    if not any(records.values()):
        return "no communication call was recorded (the flight recorder sees calls through course_lib's Comm)"
    lines = disagreements(records) + message_mismatches(records) + waits(records, outcomes)
    if not lines:
        lines = [NOTHING]
    return "\n".join(textwrap.fill(line, WIDTH, subsequent_indent="    ", break_on_hyphens=False)
                     for line in lines)


__all__ = ["diagnose", "disagreements", "message_mismatches", "waits", "stuck", "ranks_text"]
