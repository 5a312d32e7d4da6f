"""The parallel engine: replicas of the pipeline in several processes.

::

    build          ``build_replica``: the wiring behind ``HybridParallel(...)`` (and a ``Pipeline``, a one-process job)
    replica        ``Replica``: this process's wired parts; a step, a forward, an evaluation the ranks agree on
    topology       the replicas x stages grid and this process's place in it (pure data)
    groups         devices and backend for this process, the process group, stage / pipeline groups
    lazy           with PIPEDDP_LAZY_GROUPS=1 those gloo groups connect on first use; the store kept until all leave
    p2p            ``P2PChannel``: activations and gradients between stage processes (send/recv)
    stage_runner   ``ProcessRunner``: the process that owns one stage runs its action list
    ddp            DDP per stage, armed for the stage's last backward of the step
    ties           tied weights whose uses sit in different processes: all-reduce, broadcast
    agreement      what the ranks must agree on: batch sizes, the loss, non-finite steps, identical replicas
    elastic        a fixed global batch over any replica count (accumulation passes), the data position
    launch         ``spawn``: a local multi-process job with torchrun's environment
    mesh           a job placed on the user's DeviceMesh (``mesh=``), beside another parallelism
    shard          FSDP2 over each stage's replicas (``shard=``)

Checkpoints, which are made of this layer's shares, live above it in ``pipeddp.checkpoints``; the data loaders
sharded by replica in ``pipeddp.data``.
"""
