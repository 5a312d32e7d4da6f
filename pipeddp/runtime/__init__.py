"""The one-process runtime: everything that runs a step, and nothing that knows about other processes.

::

    microbatch   split a batch into micro-batches, merge outputs back
    schedule/    schedules as data: actions -> replay (``play``) -> checks -> builders (GPipe, 1F1B, ...) -> costed
                 (``"auto"``: the order built from measured F / I / W costs) -> registry (by name)
    refine       re-costs ``"auto"`` from the first steps' action times, the same on every rank
    prefetch     batches prepared ahead of the step on a thread (pinned, copied on a side stream on CUDA)
    stage        one slice of the model on one device: forward / backward / recompute of a micro-batch
    spec         ``StepSpec``: what a step asks of every stage, and what a stage keeps per micro-batch
    compiled     a stage's layers under ``torch.compile``, one compiled function per mode
    channels     the ``Channel`` interface; ``LocalChannel`` moves tensors between stage threads
    executor     ``run_actions`` walks a stage's action list; ``ThreadRunner`` runs every stage on a thread
    workers      the persistent worker threads (one per device) that ``ThreadRunner`` hands its jobs to
    step         one step, built once: split, seed, spec, schedule -> a runner (threads or a process)
    streams      CUDA compute / copy streams of a stage (no-ops on CPU)
    rng          per-micro-batch seeds so that every random op replays under recompute
    batchnorm    no statistics update from a recompute; deferred (once per batch) statistics
    tied         weights several stages use: a copy per stage, kept one weight
    amp          the caller's autocast, re-entered on the stage threads
    trace        spans of every action, for timelines; peak activations and memory per stage
    devices      checking the device names users give
    clip         the plain model's gradient norm over the stages (a tied weight counted once)
    split        a backward in two halves: input gradient (I) and weight gradient (W), for zero-bubble
    names        the original model's keys for a flattened model's layers (state dicts, optimizer state)
    warn         warnings attributed to the user's line, however deep in pipeddp they are raised

The distributed layer (``pipeddp.distributed``) adds a second runner, the
process that owns one stage, and DDP; it uses this package, never the reverse.
"""
