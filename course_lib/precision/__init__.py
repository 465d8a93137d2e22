"""Lower precision: mixed bf16 / fp32 training in every dimension (``mixed``); fp16 loss
scaling and FP8 are added next to it."""
from course_lib.precision.mixed import PRECISIONS, MasterWeights, check_precision, train_mixed
from course_lib.precision.loss_scale import DynamicLossScaler, check_loss_scaler
from course_lib.precision.fp8 import FP8Linear, swap_linear_to_fp8

__all__ = ["PRECISIONS", "MasterWeights", "check_precision", "train_mixed",
           "DynamicLossScaler", "check_loss_scaler", "FP8Linear", "swap_linear_to_fp8"]
