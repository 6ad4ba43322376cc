"""passes: rewrite passes that turn an `autoplan.Plan` into a distributed training module.

Imports only autoplan's plan and graph types (never the search or the cost model).
"""

from __future__ import annotations

__all__: list[str] = []
