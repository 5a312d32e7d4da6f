"""Tools built on the engine: the runtime never imports them.

::

    simulate   predict a step from per-stage costs, links and the all-reduce
    plan       rank stages x replicas x micro-batches by simulation
    timeline   draw a recorded trace, measure its bubble
    models     the models of the demo, the command line and the benchmarks
    flatten    ``flatten_sequential``: a model as a fine nn.Sequential (chains; transformers/timm block stacks)
    transformer  opening nn.TransformerEncoder into its layers (masks kept exact)
    demo       ``pipeddp demo``
    cli        the ``pipeddp`` command
"""
