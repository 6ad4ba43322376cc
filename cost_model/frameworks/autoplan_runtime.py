"""autoplan's own runtime: the identity profile (a cluster's calibration describes it)."""

from __future__ import annotations

from cost_model.frameworks.profile import FrameworkProfile

AUTOPLAN = FrameworkProfile(
    name="autoplan",
    version="this project (torch >= 2.13)",
    summary=(
        "autoplan's runtime: SDPA attention, torch's non-reentrant checkpoint, "
        "torch.distributed.pipelining, DDP/FSDP2 overlapped gradient sync"
    ),
    sources=("autoplan passes/ and cost_model/calibration.py (the defaults)",),
)
