"""runtime/warn.py: a warning names the user's line, whatever depth of pipeddp raised it."""

import os
import warnings

import pytest
import torch
from torch import nn

import pipeddp
from pipeddp.runtime.warn import warn


def _caught(fn):
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return got


def test_a_warning_raised_directly_names_the_callers_line():
    (w,) = _caught(lambda: warn("pipeddp: a note", RuntimeWarning))
    assert w.filename == __file__ and w.category is RuntimeWarning and str(w.message) == "pipeddp: a note"


@pytest.mark.timeout(120)
def test_heavy_layer_and_resume_warnings_name_the_users_line_through_every_entry_point(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2048), nn.ReLU(), nn.Linear(2048, 8))
    x = torch.randn(4, 8)
    # the same check reached through partition() and through Pipeline's settings: two depths, one line named
    # layer 1 holds 52% of the memory: over the share of each of 3 stages by half (at 2 stages it nearly fits one)
    for build in (lambda: pipeddp.partition(model, 3, method="memory", sample=x),
                  lambda: pipeddp.Pipeline(model, ["cpu"] * 3, balance="memory", sample=x).close()):
        heavy = [w for w in _caught(build) if issubclass(w.category, pipeddp.HeavyLayerWarning)]
        assert heavy and all(w.filename == __file__ for w in heavy), [(w.filename, w.lineno) for w in heavy]

    missing = str(tmp_path / "not-a-run")  # a directory without checkpoints (a first run, with none, is quiet)
    os.makedirs(missing)
    open(os.path.join(missing, "notes.txt"), "w").close()
    with pipeddp.HybridParallel(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), stages=2,
                                chunks=2) as engine:
        opt = torch.optim.SGD(engine.parameters(), lr=0.1)
        for call in (lambda: engine.resume(missing, opt), lambda: pipeddp.resume(engine, missing, opt)):
            said = [w for w in _caught(call) if "no checkpoint to resume from" in str(w.message)]
            assert len(said) == 1 and said[0].filename == __file__, [(w.filename, str(w.message)) for w in said]
