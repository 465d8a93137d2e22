"""Lower precision: mixed bf16 / fp32 training in every dimension (``mixed``); fp16 loss
scaling and FP8 are added next to it."""
from course_lib.precision.mixed import PRECISIONS, MasterWeights, check_precision, train_mixed

__all__ = ["PRECISIONS", "MasterWeights", "check_precision", "train_mixed"]
