"""The dry run's memory of a running rank against a real launch(..., clock=...) of it.

States, saved activations and the count at moments ("moments") are the same program's, to
the byte. The peak over the step of every tensor ("peak") follows every tensor the program holds (course_lib.virtual.live_memory);
on a real launch a collective's tensors are let go of by gloo's own thread when its work ends,
at a moment that thread's timing picks, so the real peak is certain only to within the bytes
freed that way (``late_frees``, counted by the real rank; 0 on the dry run, which has no such
thread)."""


def assert_same_memory(dry: dict, real: dict, where="") -> None:
    for k in ("states", "activations", "moments"):
        assert dry[k] == real[k], (where, k, dry[k], real[k])
    assert abs(dry["peak"] - real["peak"]) <= real["late_frees"], (where, dry["peak"], real["peak"],
                                                                   real["late_frees"])
