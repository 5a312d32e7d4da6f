"""Tools built on the engine: the runtime never imports them.

::

    costs      what a step is made of: per-stage costs, links, the ring all-reduce (plain numbers)
    contention ``play_shared``: a schedule played on shared cores (processor sharing)
    simulate   predict a step from per-stage costs, links and the all-reduce (costs -> contention -> here)
    plan       rank stages x replicas x micro-batches by simulation
    timeline   draw a recorded trace, measure its bubble
    models     the models of the demo, the command line and the benchmarks
    flatten    ``flatten_sequential``: a model as a fine nn.Sequential (chains; transformers/timm block stacks)
    transformer  opening nn.TransformerEncoder into its layers (masks kept exact)
    demo       ``pipeddp demo``
    cli        the ``pipeddp`` command
"""
