"""Models built on the meta device: each process allocates only its own layers, and every layout starts from the
weights ``materialize(model, seed=...)`` gives the plain model, so training equals it (float64, 1e-12)."""

import copy

import pytest
import torch
from torch import nn

import pipeddp
from conftest import max_diff

LOSS = nn.functional.mse_loss


def build(tied: bool = False) -> nn.Sequential:
    """Built under the meta device: no memory until materialized. ``tied``: an embedding and an output head that
    share one weight (one Parameter at two places of the model)."""
    with torch.device("meta"):
        if tied:
            embed = nn.Embedding(10, 12, dtype=torch.float64)
            head = nn.Linear(12, 10, bias=False, dtype=torch.float64)
            head.weight = embed.weight
            return nn.Sequential(embed, nn.Linear(12, 12, dtype=torch.float64), nn.Tanh(),
                                 nn.LayerNorm(12, dtype=torch.float64), nn.Linear(12, 12, dtype=torch.float64), head)
        return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.LayerNorm(16),
                             nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def batches(steps=3, n=10, tied=False):
    g = torch.Generator().manual_seed(5)
    if tied:
        return [(torch.randint(0, 10, (n, 3), generator=g), torch.randn(n, 3, 10, generator=g, dtype=torch.float64))
                for _ in range(steps)]
    return [(torch.randn(n, 12, generator=g, dtype=torch.float64), torch.randn(n, 4, generator=g, dtype=torch.float64))
            for _ in range(steps)]


def plain(seed, steps, tied=False):
    model = pipeddp.materialize(build(tied), seed=seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in steps:
        opt.zero_grad()
        LOSS(model(x), y).backward()
        opt.step()
    return model.state_dict()


def test_a_tied_weight_stays_one_parameter_with_its_first_places_values():
    model = pipeddp.materialize(build(tied=True), seed=7)
    assert model[0].weight is model[5].weight and len(list(model.parameters())) == 7
    again = pipeddp.materialize(build(tied=True), seed=7)
    assert torch.equal(again[0].weight, model[0].weight)


def test_materialize_is_seeded_by_name_and_leaves_nothing_on_meta():
    a, b, c = (pipeddp.materialize(build(), seed=s) for s in (3, 3, 4))
    assert not any(t.is_meta for t in a.state_dict().values())
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())  # the same seed: the same
    assert not torch.equal(a[0].weight, c[0].weight)  # another seed: other weights
    assert not torch.equal(a[2].weight, a[5].weight)  # two layers of one shape: each its own numbers
    assert torch.equal(a[4].weight, torch.ones(16, dtype=torch.float64))  # LayerNorm's own initialisation


@pytest.mark.parametrize("devices,virtual,tied,placement", [(2, 1, False, "loop"), (3, 1, False, "loop"),
                                                            (2, 2, False, "loop"), (2, 1, True, "loop"),
                                                            (3, 1, True, "loop"), (2, 2, True, "v")])
def test_a_pipeline_of_a_meta_model_trains_the_materialized_model(devices, virtual, tied, placement):
    steps = batches(tied=tied)
    expect = plain(7, steps, tied)
    model = build(tied)
    schedule = "interleaved" if virtual > 1 else "1f1b"
    with pipeddp.Pipeline(model, ["cpu"] * devices, chunks=3, seed=7, schedule=schedule,
                          virtual_stages=virtual, placement=placement) as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for x, y in steps:
            opt.zero_grad()
            pipe.train_step(x, y, LOSS)
            opt.step()
        got = pipe.state_dict()
    assert list(got) == list(expect)
    assert max_diff([got[k] for k in expect], expect.values()) < 1e-12


def stage_job(seed, steps, tied, stages=2, mode="stage", shard="none"):
    """Every process gets the whole model on meta and allocates only its own layers (stage mode: its stage)."""
    model = build(tied)
    engine = pipeddp.HybridParallel(model, stages=stages, mode=mode, chunks=3, seed=seed, shard=shard)
    mine = {id(p) for p in engine.parameters()}
    others_on_meta = all(p.is_meta for p in model.parameters() if id(p) not in mine)
    held = sum(p.numel() for p in engine.parameters())
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    r, replicas = engine.topology.replica, engine.topology.replicas
    for x, y in steps:
        local = x.shape[0] // replicas
        opt.zero_grad()
        engine.train_step(x[r * local:(r + 1) * local] if engine.is_first else None,
                          y[r * local:(r + 1) * local] if engine.is_last else None, LOSS)
        opt.step()
    state = engine.state_dict()
    engine.close()
    return {"state": state, "others_on_meta": others_on_meta, "held": held}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nprocs,stages,tied", [(2, 2, False), (4, 2, False), (4, 4, False), (2, 2, True)])
def test_stage_mode_processes_hold_only_their_layers_and_train_the_materialized_model(nprocs, stages, tied):
    """1 x 2, 2 x 2 (replicas x stages) and 1 x 4, a tie across processes too."""
    steps = batches(n=12, tied=tied)
    expect = plain(11, steps, tied)
    total = sum(p.numel() for p in pipeddp.materialize(build(tied), seed=0).parameters())
    results = pipeddp.spawn(stage_job, nprocs, args=(11, steps, tied, stages), timeout=150)
    for res in results:
        assert res["others_on_meta"]  # the layers of other stages were never allocated here
        assert res["held"] < total
        assert max_diff([res["state"][k] for k in expect], expect.values()) < 1e-12


@pytest.mark.timeout(180)
def test_a_meta_model_sharded_over_replicas_trains_the_materialized_model():
    steps = batches(n=12)
    expect = plain(11, steps)
    for res in pipeddp.spawn(stage_job, 2, args=(11, steps, False, 2, "replica", "optimizer"), timeout=150):
        assert max_diff([res["state"][k] for k in expect], expect.values()) < 1e-12


class Probe(nn.Linear):
    """A Linear that notes, at each forward, how many Probes hold real (not meta) weights at that moment."""

    alive: "weakref.WeakSet" = None  # set per test
    seen: list = []

    def forward(self, x):
        import gc

        Probe.alive.add(self)  # the profile's working copies are made by deepcopy: each announces itself here
        gc.collect()
        Probe.seen.append(sum(1 for p in Probe.alive if not p.weight.is_meta))
        return super().forward(x)


def test_balance_time_profiles_a_meta_model_one_layer_at_a_time():
    import weakref

    Probe.alive, Probe.seen = weakref.WeakSet(), []
    with torch.device("meta"):
        model = nn.Sequential(*[Probe(12, 12, dtype=torch.float64) for _ in range(6)])
    x = torch.randn(8, 12, dtype=torch.float64)
    plan = pipeddp.partition(model, 3, method="time", sample=x, chunks=2)
    assert Probe.seen and max(Probe.seen) == 1  # never two layers' weights at once
    assert all(p.weight.is_meta for p in model)  # the model itself still holds nothing
    assert sum(plan.balance) == 6 and all(c.forward > 0 for c in plan.layers)


def test_what_a_meta_model_cannot_do_is_refused_naming_the_way_out():

    class Scale(nn.Module):  # owns a parameter, no reset_parameters
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x * self.s

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(ValueError, match=r"cannot materialize 1 \(Scale\) from the meta device: it has no "
                                         r"reset_parameters\(\)"):
        pipeddp.materialize(model)
    assert pipeddp.materialize(model, init=small_init)[1].s.abs().max() < 0.2  # an init= of one's own does it
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        pipeddp.Pipeline(build(), ["cpu", "cpu"], seed=-1)


def small_init(module: nn.Module) -> None:
    """An initialisation of one's own: every tensor a module owns drawn from N(0, 0.02)."""
    for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
        t.normal_(0.0, 0.02)


def test_init_of_ones_own_replaces_reset_parameters_in_every_layout():
    expect = pipeddp.materialize(build(), seed=5, init=small_init).state_dict()
    assert all(v.std() < 0.05 for k, v in expect.items() if k.endswith("weight"))  # small_init's, not Linear's
    with pipeddp.Pipeline(build(), ["cpu"] * 3, chunks=2, seed=5, init=small_init) as pipe:
        got = pipe.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expect.items())
    with pytest.raises(ValueError, match="init must be a callable"):
        pipeddp.Pipeline(build(), ["cpu", "cpu"], init="normal")


def test_balance_time_on_a_meta_model_profiles_with_the_engines_init():
    class Scale(nn.Module):  # owns a parameter, no reset_parameters: only init= can initialise it
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(12, dtype=torch.float64))

        def forward(self, x):
            return x * self.s

    def meta():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(12, 12, dtype=torch.float64), Scale(), nn.Tanh(),
                                 nn.Linear(12, 12, dtype=torch.float64), Scale())

    x = torch.randn(8, 12, dtype=torch.float64)
    with pipeddp.Pipeline(meta(), ["cpu", "cpu"], chunks=2, balance="time", sample=x, seed=3,
                          init=small_init) as pipe:
        pipe.eval()
        with torch.no_grad():
            got = pipe(x)
    want = pipeddp.materialize(meta(), seed=3, init=small_init).eval()(x)
    assert (got - want).abs().max().item() < 1e-12


def test_plan_measures_a_meta_model_too():
    from pipeddp.tools.plan import fit_layers

    model = build()
    layers = fit_layers(model, lambda b: torch.randn(b, 12, dtype=torch.float64), sizes=(2, 4), repeat=1)
    assert len(layers) == len(model) and layers[0].param_bytes == (12 * 16 + 16) * 8
    assert all(p.is_meta for p in model.parameters())  # measured one layer at a time, the model still holds nothing


class Masked(nn.Module):
    """Attention-like: a causal mask (bool) and an 8-bit table computed in ``__init__``; ``reset`` says whether
    ``reset_parameters`` computes them again (all-False and all-255 ones among them, values no fill can tell)."""

    def __init__(self, n: int = 16, reset: bool = False) -> None:
        super().__init__()
        self.n, self.reset = n, reset
        self.lin = nn.Linear(n, n, dtype=torch.float64)
        self.register_buffer("causal", torch.ones(n, n, dtype=torch.bool).tril(), persistent=False)
        self.register_buffer("none_masked", torch.zeros(n, dtype=torch.bool))
        self.register_buffer("codes", torch.arange(n, dtype=torch.int8))
        self.register_buffer("levels", torch.full((n,), 255, dtype=torch.uint8))

    def reset_parameters(self) -> None:
        if self.reset:
            self.causal.copy_(torch.ones(self.n, self.n, dtype=torch.bool).tril())
            self.none_masked.zero_()
            self.codes.copy_(torch.arange(self.n, dtype=torch.int8))
            self.levels.fill_(255)

    def forward(self, x):
        scores = (x @ x.transpose(-1, -2)).masked_fill(~self.causal[:x.size(1), :x.size(1)], float("-inf"))
        return self.lin(scores.softmax(-1) @ x) + self.codes.double() + self.levels.double()


def test_a_bool_or_8_bit_buffer_the_initialisation_never_sets_is_refused_by_name():
    """Fresh memory of a bool or 8-bit type has no value to mark it with (every value may be meant): a buffer no
    write reached is found by watching the initialisation's writes, named with how to fix it; set in
    reset_parameters (all False and all 255 included) it is the model's own, as built on the CPU."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16, dtype=torch.float64), Masked())
    with pytest.raises(ValueError, match=r"cannot materialize 1 \(Masked\) .*left causal, none_masked, codes, "
                                         r"levels without values \(torch.bool, torch.bool, torch.int8, torch.uint8"
                                         r".*compute it in the module's reset_parameters\(\)"):
        pipeddp.materialize(model, seed=0)
    assert all(b.is_meta for b in model[1].buffers())  # the layer went back to meta
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16, dtype=torch.float64), Masked())
    with pytest.raises(ValueError, match=r"left causal, none_masked, codes, levels without values"):
        pipeddp.Pipeline(model, ["cpu", "cpu"], balance=[1, 1], seed=0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16, dtype=torch.float64), Masked())
    with pytest.raises(ValueError, match=r"init\(module\).*left causal, none_masked, codes, levels without"):
        pipeddp.materialize(model, seed=0, init=lambda m: m.reset_parameters() if isinstance(m, nn.Linear) else None)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(16, 16, dtype=torch.float64), Masked(reset=True))
    got = pipeddp.materialize(model, seed=0)[1]
    want = Masked()  # built on the CPU: what __init__ computed
    for name, buffer in want.named_buffers():
        assert torch.equal(getattr(got, name), buffer), name
