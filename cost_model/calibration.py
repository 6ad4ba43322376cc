"""Efficiency constants that turn datasheet peaks into achievable speeds.

A `Calibration` belongs to a Cluster: presets ship defaults fitted to published measurements
(each constant cites its source in the preset file), and `autoplan calibrate` measures them
on the machine at hand. All values are dimensionless fractions of the datasheet peak unless
the name carries a unit.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_model.schema import unit_field


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    """Achievable fractions of peak compute, memory bandwidth and link bandwidth."""

    # Fraction of the dtype's peak FLOP/s that a large, well-shaped GEMM sustains.
    gemm_efficiency: float = 0.75
    # GEMM work (FLOPs) at which efficiency reaches half of `gemm_efficiency`: small GEMMs
    # cannot fill the device (wave quantisation, launch cost).
    gemm_half_efficiency_flops: float = unit_field("flops", default=2e9)
    # Fraction of peak memory bandwidth that element-wise and reduction kernels sustain.
    memory_efficiency: float = 0.7
    # Fraction of the link bandwidth that collectives reach (NCCL bus bandwidth / link peak).
    intra_node_comm_efficiency: float = 0.8
    inter_node_comm_efficiency: float = 0.8
    # Fixed cost of one kernel launch or framework dispatch.
    kernel_overhead_s: float = unit_field("time", default=5e-6)

    def __post_init__(self) -> None:
        for name in (
            "gemm_efficiency",
            "memory_efficiency",
            "intra_node_comm_efficiency",
            "inter_node_comm_efficiency",
        ):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(
                    f"calibration.{name} = {value!r} must be a fraction in (0, 1]; "
                    "it is the achievable share of the datasheet peak"
                )
        if self.gemm_half_efficiency_flops < 0:
            raise ValueError(
                f"calibration.gemm_half_efficiency_flops = {self.gemm_half_efficiency_flops!r} "
                "must be >= 0"
            )
        if self.kernel_overhead_s < 0:
            raise ValueError(
                f"calibration.kernel_overhead_s = {self.kernel_overhead_s!r} must be >= 0"
            )
