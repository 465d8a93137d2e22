"""The packed-documents grader (course_lib/grading/cp_documents.py) passes the idea only: the
solution and a differently written right answer pass; the classic mistakes, a hard-coded
answer and a call to the library's own layout fail, each with a hint."""
import torch

from course_lib.grading import cp_documents as G


def _solution(lengths, cp, refuse=True):
    out, start = [[] for _ in range(cp)], 0
    for n in lengths:
        if refuse and n % (2 * cp):
            raise ValueError("pad each document to a multiple of 2*cp")
        c = n // (2 * cp)
        for r in range(cp):
            for chunk in (r, 2 * cp - 1 - r):
                out[r] += range(start + chunk * c, start + (chunk + 1) * c)
        start += n
    return out


def _other_right_answer(lengths, cp):
    """Tensor ops, and rank r takes its late chunk first: still a balanced partition."""
    if any(n % (2 * cp) for n in lengths):
        raise ValueError("documents must cut into 2*cp chunks")
    starts = torch.tensor([0] + list(lengths[:-1])).cumsum(0)
    out = []
    for r in range(cp):
        pieces = []
        for s, n in zip(starts.tolist(), lengths):
            c = n // (2 * cp)
            pieces += [torch.arange(s + (2 * cp - 1 - r) * c, s + (2 * cp - r) * c), torch.arange(s + r * c, s + (r + 1) * c)]
        out.append(torch.cat(pieces))
    return out


def _sequence_zigzag(lengths, cp):
    seq, c = sum(lengths), sum(lengths) // (2 * cp)
    if any(n % (2 * cp) for n in lengths):
        raise ValueError("bad")
    return [list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c)) for r in range(cp)]


def _contiguous(lengths, cp):
    if any(n % (2 * cp) for n in lengths):
        raise ValueError("bad")
    c = sum(lengths) // cp
    return [list(range(r * c, (r + 1) * c)) for r in range(cp)]


def _documents_cut_contiguously(lengths, cp):
    if any(n % (2 * cp) for n in lengths):
        raise ValueError("bad")
    out, start = [[] for _ in range(cp)], 0
    for n in lengths:
        c = n // cp
        for r in range(cp):
            out[r] += range(start + r * c, start + (r + 1) * c)
        start += n
    return out


def _whole_documents_round_robin(lengths, cp):
    if any(n % (2 * cp) for n in lengths):
        raise ValueError("bad")
    out, start = [[] for _ in range(cp)], 0
    for i, n in enumerate(lengths):
        out[i % cp] += range(start, start + n)
        start += n
    return out


def _no_refusal(lengths, cp):                     # the solution without its check
    return _solution(lengths, cp, refuse=False)


def _hard_coded(lengths, cp):                      # the notebook's example, whatever is asked
    return [[0, 5, 6, 7, 12, 13, 18, 19], [1, 2, 3, 4, 8, 9, 10, 11, 14, 15, 16, 17, 20, 21, 22, 23]][:cp]


def _library(lengths, cp):
    from course_lib.parallel.cp_layouts import shard_positions

    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return [shard_positions(sum(lengths), cp, r, "documents", doc_ids=docs) for r in range(cp)]


def _patches_the_grader(lengths, cp):             # every rank's work made equal by the answer
    G.visible_pairs = lambda positions, doc_ids=None: 1
    return _contiguous(lengths, cp)


def test_right_answers_pass(capsys):
    assert G.check_document_split(_solution)
    assert G.check_document_split(_other_right_answer)
    assert "6/6 cases passed" in capsys.readouterr().out


def test_wrong_answers_fail_with_a_hint(capsys):
    expected = {_sequence_zigzag: "zigzag every document", _contiguous: "contiguous slices",
                _documents_cut_contiguously: "max/mean", _whole_documents_round_robin: "max/mean",
                _no_refusal: "expected ValueError", _hard_coded: "exactly one rank", _library: "switched off",
                _patches_the_grader: "changed the grader"}
    for wrong, hint in expected.items():
        assert not G.check_document_split(wrong), wrong.__name__
        out = capsys.readouterr().out
        assert "FAILED" in out and hint in out, (wrong.__name__, out)
