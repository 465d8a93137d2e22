"""Chapter 4's measurements of one training step of TinyGPT(MEASURED_CONFIG), fp32 AdamW,
as notebook 04 takes them, recorded for the bytes question's grader (``MEASURED_BYTES`` is
re-measured by tests/test_memory.py; the planner's ``dp_bytes_per_step`` predicts ``MEASURED_SENT``
within 1%, tests/test_planner_communication.py).

* ``MEASURED_BYTES``: ``course_lib.memory.model_state_bytes`` on rank 0 after one step,
  (stage, world size) -> (parameters, gradients, optimizer state) bytes. DDP's gradients are
  views of its buckets, which also hold one fp32 "had a gradient" flag per parameter tensor.
* ``MEASURED_SENT``: bytes rank 0 handed to the kernel (Linux /proc/self/io) during one step,
  (impl, stage, world size) -> bytes sent, payload plus a few hundred bytes of transport
  headers per call. "gloo": torch's collectives; "ring": the course's bandwidth-optimal ring
  of chapter 2. FSDP's root unit (embeddings, final norm, head: ``MEASURED_ROOT_PARAMS``)
  stays gathered from forward to backward: it is all-gathered once per step.
"""
MEASURED_CONFIG = dict(vocab_size=256, seq_len=32, n_layers=4, hidden=128, n_heads=4)
MEASURED_PARAMS = 869_504
MEASURED_ROOT_PARAMS = 65_664
MEASURED_BYTES = {
    (0, 2): (3478016, 3478172, 6956188), (1, 2): (3478016, 3478016, 3478096),
    (2, 2): (3478016, 1739008, 3478096), (3, 2): (1739008, 1739008, 3478172),
    (0, 4): (3478016, 3478172, 6956188), (1, 4): (3478016, 3478016, 1739044),
    (2, 4): (3478016, 869504, 1739044), (3, 4): (869504, 869504, 1739164),
}
MEASURED_SENT = {
    ("gloo", 0, 2): 3478748, ("gloo", 0, 4): 5218988, ("gloo", 1, 2): 5218620, ("gloo", 1, 4): 7830092,
    ("gloo", 2, 2): 5218620, ("gloo", 2, 4): 7830092, ("gloo", 3, 2): 6830488, ("gloo", 3, 4): 10254448,
    ("ring", 0, 2): 3478972, ("ring", 0, 4): 5218632, ("ring", 1, 2): 3480284, ("ring", 1, 4): 5220520,
    ("ring", 2, 2): 3480284, ("ring", 2, 4): 5220520, ("ring", 3, 2): 5095036, ("ring", 3, 4): 7642228,
}

__all__ = ["MEASURED_CONFIG", "MEASURED_PARAMS", "MEASURED_ROOT_PARAMS", "MEASURED_BYTES", "MEASURED_SENT"]
