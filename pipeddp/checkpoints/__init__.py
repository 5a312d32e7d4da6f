"""Checkpoints of both engines: writing, reading, and the files themselves.

::

    checkpointable save, save_checkpoint, wait_for_save, load, resume: one implementation for both public classes
    saving         writing checkpoints: one file gathered on rank 0, or sharded, in the background if asked
    state          the whole model's state dict across processes, and loading checkpoints (all or nothing)
    checkpoint     the checkpoint file: plain values, atomic writes, safe loading
    sharded        the sharded checkpoint: a DCP directory every process writes its share of, read safely
    catalog        a directory of checkpoints: step names, the newest complete one, pruning
    optim_state    an optimizer's state by parameter name, and its class
    pretrained     a Hugging Face directory (safetensors, sharded with an index), read per stage
    export         save_pretrained: a Hugging Face directory written by every process, each its own tensors
    peers          everyone a checkpoint involves: the job, and with tensor parallelism its tp peers' jobs
    slices         the block of a tensor a process holds: read alone, written in place into safetensors

It sits above the parallel engine (``distributed``): a checkpoint is made of the engine's shares, gathered or
written by its ranks through the engine's agreement.
"""
