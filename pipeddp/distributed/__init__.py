"""The distributed layer: replicas of the pipeline in several processes.

::

    build          ``build_replica``: the wiring behind ``HybridParallel(...)``, in the order every rank runs it
    replica        ``Replica``: this process's wired parts; a step, a forward, an evaluation the ranks agree on
    topology       the replicas x stages grid and this process's place in it (pure data)
    groups         devices and backend for this process, the process group, stage / pipeline groups
    p2p            ``P2PChannel``: activations and gradients between stage processes (send/recv)
    stage_runner   ``ProcessRunner``: the process that owns one stage runs its action list
    ddp            DDP per stage, armed for the stage's last backward of the step
    ties           tied weights whose uses sit in different processes: all-reduce, broadcast
    agreement      what the ranks must agree on: batch sizes, the loss, non-finite steps, identical replicas
    data           DataLoaders sharded by replica; the elastic sampler that resumes an epoch in any layout
    elastic        a fixed global batch over any replica count (accumulation passes), the data position
    launch         ``spawn``: a local multi-process job with torchrun's environment
    checkpointable save, save_checkpoint, wait_for_save, load, resume: one implementation for both public classes
    saving         writing checkpoints: one file gathered on rank 0, or sharded, in the background if asked
    state          the whole model's state dict across processes, and loading checkpoints (all or nothing)
    checkpoint     the checkpoint file: plain values, atomic writes, safe loading
    sharded        the sharded checkpoint: a DCP directory every process writes its share of, read safely
    catalog        a directory of checkpoints: step names, the newest complete one, pruning
    optim_state    an optimizer's state by parameter name, and its class
"""
