"""`UnitCost`: what one pipeline unit costs on one device under fixed outer choices, the record
`cost_model.estimate.CostModel.unit_costs` composes from the parts (`cost_model.parts`) and
the stage, rank and memory assembly reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitCost:
    """Costs of one pipeline unit on one device under fixed outer choices and recompute mode.

    Times are per micro-batch unless they say per step; bytes are per device. `unit_costs`
    returns one per unit, in unit order; identical units share one object.
    """

    kind: str
    recompute: str
    # --- per micro-batch
    forward_compute_s: float
    backward_compute_s: float
    recompute_s: float  # forward compute re-run in the backward
    tp_forward_s: float  # TP collectives of the forward
    tp_backward_s: float  # TP collectives of the backward (incl. re-run forward ones)
    zero3_forward_s: float  # ZeRO-3 parameter all-gather before the forward
    zero3_backward_s: float  # ZeRO-3 all-gather + gradient reduce-scatter of the backward
    zero3_exposed_s: float  # the part of both not hidden behind this unit's compute
    forward_s: float  # critical path of the forward
    backward_s: float  # critical path of the backward (incl. recompute)
    weight_s: float  # of backward_s, the weight gradient a split backward runs later
    # --- per step
    dp_sync_s: float  # gradient sync that may overlap the last backward (ZeRO 0-2)
    post_sync_s: float  # communication that cannot overlap (ZeRO 1/2 param all-gather, tied grads)
    optimizer_s: float
    # --- bytes
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    local_params: float  # parameters this device stores before data-parallel sharding
    activation_bytes: float  # held per in-flight micro-batch (the loss's included)
    loss_bytes: float  # of those, the loss's (and again as working set: extra_bytes)
    # held per micro-batch between a split backward's input and weight halves: the recompute
    # (if any) has run and torch's stage_backward_input retains the whole graph until then,
    # with the gradients the weight half needs (not in the first stage, which defers it all)
    retained_bytes: float
    working_bytes: float  # transient bytes while its backward runs (one micro-batch)
    extra_bytes: float  # the working set counted with this unit (embedding and head only)
    output_bytes: float  # the tensor sent to the next stage per micro-batch, per device
    forward_flops: float  # per micro-batch on this device (model work, no recompute)
    # --- of forward_s / backward_s: context parallel's ring exchanges not hidden behind the
    # attention (`parts.context_parallel`), expert parallel's all-to-alls (`parts.expert_parallel`)
    cp_forward_s: float = 0.0
    cp_backward_s: float = 0.0
    ep_forward_s: float = 0.0
    ep_backward_s: float = 0.0
    # of forward_s + backward_s: the host's, its wrappers' time (`Calibration.tp_module_overhead_s`
    # and the like) and the device's wait for the host (`Calibration.tp_block_host_floor_s`)
    host_s: float = 0.0
    # of local_params, those in linears an fp8 recipe converts (`cost_model.parts.fp8`)
    fp8_params: float = 0.0
    # activation offload (`cost_model.parts.offload.offloaded_unit_cost`): of forward_s +
    # backward_s, the host-link copies not hidden behind compute; and the saved activations
    # of one micro-batch held on the host instead of the device
    host_link_s: float = 0.0
    host_activation_bytes: float = 0.0

    @property
    def time_s(self) -> float:
        """Forward + backward per micro-batch: the unit's share of its stage's time."""
        return self.forward_s + self.backward_s

    @property
    def static_bytes(self) -> float:
        """Bytes held for the whole step (weights, grads, optimizer state, fixed transients)."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.extra_bytes

    @property
    def tp_comm_s(self) -> float:
        return self.tp_forward_s + self.tp_backward_s

    @property
    def compute_s(self) -> float:
        """Forward + backward + recompute compute per micro-batch."""
        return self.forward_compute_s + self.backward_compute_s + self.recompute_s
