"""The planner's view of a course model, and a Hardware for this machine from measurements.

``model_spec`` turns a ``course_lib.models.GPTConfig`` into the planner's ``ModelSpec`` (the
same shapes); ``machine_hardware`` builds a :class:`Hardware` for "this machine" from what
``course_lib.lab.calibration.calibrate`` measured (the matmul rate, the bandwidth of small
elementwise kernels, alpha and beta fitted to all-reduce times), so ``estimate`` can
predict a real data-parallel run on it.
"""
from __future__ import annotations

from course_lib.planner.presets import Hardware, ModelSpec


def model_spec(cfg) -> ModelSpec:
    """A planner ModelSpec for a course_lib.models.GPTConfig (same shapes)."""
    gpt2 = cfg.block == "gpt2"
    return ModelSpec("tiny GPT", cfg.n_layers, cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden,
                     cfg.vocab_size, cfg.seq_len, mlp="gelu" if gpt2 else "swiglu",
                     tied=cfg.tie_embeddings, bias=gpt2, norm="layernorm" if gpt2 else "rmsnorm",
                     learned_pos=cfg.seq_len if gpt2 else 0)


def machine_hardware(measured: dict, world_size: int) -> Hardware:
    """A Hardware for this machine from the measurements (the slowest rank, median over rounds).
    Activations and gradients are fp32 here: the planner's bf16 byte counts are
    doubled through the bandwidths (half the bandwidth, the same seconds)."""
    fit = measured["fit"]
    return Hardware(
        name="this CPU", peak_flops=measured["matmul_flops"], hbm_bytes=64 * 2**30,
        hbm_bandwidth=measured["copy_bandwidth"] / 2, nvlink_bandwidth=fit.bandwidth / 2,
        network_bandwidth=fit.bandwidth / 2, gpus_per_node=world_size, matmul_efficiency=1.0,
        nvlink_efficiency=1.0, network_efficiency=1.0, nvlink_latency=fit.alpha, network_latency=fit.alpha,
        fused_attention=False)          # the tiny GPT writes attention out: its scores go through memory


__all__ = ["model_spec", "machine_hardware"]
