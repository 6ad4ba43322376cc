"""The columns of the CLI's tables, each with what it holds: the tables are built from them
(`autoplan._format.fitted_table`) and each command's ``--help`` explains them from the same
text (`autoplan._format.columns_help`). ``drop`` orders what a narrow terminal leaves out."""

from __future__ import annotations

from autoplan._format import Column

# The per-rank table's columns (`stage_table`); cp, ep and host only where the plan has them.
STAGE_COLUMNS = (
    Column(header="rank", meaning="pipeline rank (ranks whose cells agree share a row: 1-6)"),
    Column(
        header="units",
        meaning="the pipeline units it runs (embedding 0, a unit per block, the head last); "
        "interleaved: units (model chunks)",
        justify="left",
    ),
    Column(
        header="recompute",
        meaning="activation recompute of its stages: none, selective or full ('none+sel' when "
        "two differ, 'mixed' when all three appear)",
        justify="left",
    ),
    Column(
        header="compute",
        meaning="forward and backward of every micro-batch of the step, recompute included",
    ),
    Column(
        header="TP comm",
        meaning="tensor-parallel collectives of the step (with --tp-comm-overlap, the part the "
        "GEMMs leave exposed)",
        drop=1,
    ),
    Column(
        header="CP comm",
        meaning="context parallelism's ring exchanges of keys and values, the part not hidden "
        "under the attention compute (0: all hidden)",
        drop=1,
    ),
    Column(header="EP comm", meaning="expert parallelism's token all-to-alls", drop=1),
    Column(
        header="PP comm",
        meaning="host time posting the rank's pipeline sends and receives, which is all a "
        "rank spends on them itself: the link time delays the receiving rank and shows in "
        "its bubble, so it is often 0",
        drop=3,
    ),
    Column(
        header="DP comm",
        meaning="gradient reduction and ZeRO gathers, all of it, overlapped or not (the "
        "exposed part is in the step's tail)",
        drop=1,
    ),
    Column(
        header="host",
        meaning="the host's share of forward and backward that the device waits for (the "
        "stack's wrappers)",
        drop=2,
    ),
    Column(
        header="offload",
        meaning="activation offload's copies over the host link that compute does not hide "
        "(shown with --activation-offload)",
        drop=2,
    ),
    Column(
        header="bubble",
        meaning="the rank's idle time in the pipeline schedule (shown with pipeline ranks)",
    ),
    Column(header="state", meaning="weights + gradients + optimizer state per device"),
    Column(
        header="activations",
        meaning="activations held at the peak per device (in-flight micro-batches included)",
    ),
)
STAGE_TABLE = ("the per pipeline rank table", STAGE_COLUMNS)


# `autoplan plan`'s ranked plans (`plan_cmd.ranked_table`); cp, ep, layout and dtype only where
# the plans have or differ in them.
RANKED_COLUMNS = (
    Column(header="#", meaning="the plan's rank (1 is chosen: the best by the search's objective)"),
    Column(header="tp", meaning="tensor-parallel degree"),
    Column(header="pp", meaning="pipeline-parallel degree (pipeline ranks)"),
    Column(header="dp", meaning="data-parallel degree"),
    Column(header="cp", meaning="context-parallel degree"),
    Column(header="ep", meaning="expert-parallel degree (within dp)"),
    Column(header="mb x n", meaning="micro-batch size x micro-batches per step", drop=1),
    Column(
        header="schedule",
        meaning="pipeline schedule ('intl-' is 'interleaved-')",
        justify="left",
    ),
    Column(header="v", meaning="virtual stages (model chunks) per pipeline rank", drop=2),
    Column(
        header="ZeRO",
        meaning="ZeRO level named by the plan (plus the HSDP shard group's size); the lines "
        "under the tables say when it runs as another",
    ),
    Column(header="SP", meaning="sequence parallelism", drop=3),
    Column(header="recompute", meaning=STAGE_COLUMNS[2].meaning, justify="left"),
    Column(
        header="layout",
        meaning="rank layout, outermost axis first (shown when the plans differ in it)",
        justify="left",
        drop=4,
    ),
    Column(header="dtype", meaning="training dtype or fp8 recipe", justify="left"),
    Column(header="step", meaning="predicted time of one optimizer step"),
    Column(header="range", meaning="the step's 80% range around it, in percent", drop=5),
    Column(header="MFU", meaning="model FLOPs utilisation: model FLOP/s over the peak"),
    Column(
        header="memory",
        meaning="the peak device's predicted tensors + framework reserve and allocator margin "
        "(G = GiB, M = MiB; the device's capacity is in the caption)",
    ),
)
RANKED_TABLE = ("the best plans table", RANKED_COLUMNS)


# `autoplan explain`'s memory table (`explain_cmd.memory_table`), in GiB per device
MEMORY_COLUMNS = (
    Column(header="rank", meaning=STAGE_COLUMNS[0].meaning),
    Column(header="weights", meaning="parameters held per device"),
    Column(header="grads", meaning="gradients held per device"),
    Column(header="optimizer", meaning="optimizer state (master weights and moments)"),
    Column(header="activations", meaning="activations of the micro-batches held at the peak"),
    Column(
        header="working",
        meaning="one backward's working set, pipeline send and receive buffers and "
        "data-parallel buckets",
        drop=1,
    ),
    Column(header="loss", meaning="the fp32 log-probabilities of the loss", drop=2),
    Column(header="reserve", meaning="the framework's reserve and the allocator's margin"),
    Column(header="total", meaning="the device's peak: the sum of the columns before"),
    Column(header="capacity", meaning="the device's memory", drop=3),
    Column(header="used", meaning="total as a share of capacity"),
    Column(
        header="fits",
        meaning="whether total is within the capacity less the memory headroom and the "
        "peak's 80% range",
    ),
)
MEMORY_TABLE = ("the memory table", MEMORY_COLUMNS)


# `autoplan whatif`'s table per cluster type (`whatif_cmd.whatif_table`)
WHATIF_COLUMNS = (
    Column(header="devices", meaning="devices in the cluster"),
    Column(
        header="plan",
        meaning="the best plan: t/p/d = tensor/pipeline/data-parallel degrees (c/e: context "
        "and expert parallel, when used), mb = micro-batch size x count, the schedule "
        "(v = virtual stages), Z = ZeRO level, recompute, SP = sequence parallel; or why "
        "there is none",
        justify="left",
        fold=True,
    ),
    Column(header="step", meaning=RANKED_COLUMNS[14].meaning),
    Column(header="range", meaning=RANKED_COLUMNS[15].meaning, drop=2),
    Column(header="tokens/s", meaning="tokens trained per second"),
    Column(header="MFU", meaning=RANKED_COLUMNS[16].meaning),
    Column(
        header="memory",
        meaning="the peak device's predicted tensors, framework reserve and allocator margin, "
        "as a share of its capacity",
    ),
    Column(
        header="scaling",
        meaning="tokens/s per device against the smallest size of the type ('>100%?': above "
        "100% against an unproven baseline)",
        drop=1,
    ),
    Column(
        header="gap",
        meaning="a plan up to this much faster may exist (the search's budget ended before it "
        "proved otherwise)",
    ),
)
WHATIF_TABLE = ("the best plan per size tables", WHATIF_COLUMNS)

# `autoplan whatif --tokens`'s cost table (`whatif_cmd._cost_table`)
COST_COLUMNS = (
    Column(header="cluster", meaning="the cluster type", justify="left"),
    Column(header="devices", meaning="devices in the cluster"),
    Column(header="days", meaning="days to train on the tokens at the row's throughput"),
    Column(header="device-hours", meaning="devices x hours of that training"),
    Column(header="price", meaning="price per device-hour (--price-per-device-hour)"),
    Column(header="cost", meaning="device-hours x price, in the caption's currency"),
    Column(header="per 1M tokens", meaning="the cost of a million tokens at the row's throughput"),
)
COST_TABLE = ("the cost table (with --tokens)", COST_COLUMNS)

# `autoplan trace`'s pipeline units (`trace_cmd.trace_table`)
TRACE_COLUMNS = (
    Column(header="#", meaning="the unit's index (a range for a run of identical blocks)"),
    Column(
        header="unit",
        meaning="the module path of the unit (first .. last (xN) for a run)",
        justify="left",
        fold=True,
    ),
    Column(header="kind", meaning="embedding, block or head", justify="left"),
    Column(header="params", meaning="parameters of one unit (K, M, B: thousands, ...)"),
    Column(header="fwd GFLOP", meaning="forward GFLOP of one unit for the traced batch"),
    Column(
        header="saved act MiB",
        meaning="activations one unit saves for its backward (MiB, traced batch)",
    ),
    Column(
        header="cut MiB",
        meaning="the tensor sent to the next stage when a pipeline cut follows the unit",
    ),
)
TRACE_TABLE = ("the units table", TRACE_COLUMNS)

# `autoplan models`
MODEL_COLUMNS = (
    Column(header="name", meaning="the preset's name (--model NAME)", justify="left"),
    Column(header="params", meaning="parameters, in billions (tied weights counted once)"),
    Column(header="layers", meaning="transformer blocks"),
    Column(header="hidden", meaning="hidden size"),
    Column(header="heads (kv)", meaning="attention heads (key/value heads)"),
    Column(
        header="ffn",
        meaning="feed-forward inner size; a MoE's: experts x top-k x expert size",
    ),
    Column(header="seq", meaning="sequence length", drop=1),
    Column(header="vocab", meaning="vocabulary size", drop=2),
)
MODEL_TABLE = ("the presets table", MODEL_COLUMNS)

# `autoplan cluster list`
CLUSTER_COLUMNS = (
    Column(header="name", meaning="the preset's name (--cluster NAME)", justify="left"),
    Column(header="per node", meaning="devices per node x device", justify="left"),
    Column(header="device memory", meaning="memory of one device"),
    Column(header="description", meaning="what the preset is", justify="left", fold=True),
)
CLUSTER_TABLE = ("the presets table", CLUSTER_COLUMNS)
