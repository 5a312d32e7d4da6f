"""Jobs of ``test_tp_zb.py``: zero-bubble schedules (backward split into input and weight halves, round robin and
in the V) and ``compile=`` with tensor-parallel stages, one engine after another in the same four processes."""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, List, Tuple

import nccl_rules
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from tp_jobs import MLP_PLAN, SEED, llama, lm_batches, lm_loss, mlp, mlp_batches, mse, train_once

import pipeddp
from pipeddp.tools.models import flatten_sequential

nccl_rules.install()  # point-to-point messages follow NCCL's rules here too (see conftest)

SHAPE = (1, 2, 2)  # dp, pp, tp
LOCAL = 4  # samples a batch
V = {"schedule": "zb", "virtual_stages": 2, "placement": "v"}  # the V: stages 0 and 3 on the first device
CASES: List[Tuple[str, Dict[str, Any]]] = [
    ("mlp-zb", {"schedule": "zb"}), ("mlp-zb-v", {**V, "balance": "uniform"}),
    ("llama-zb", {"schedule": "zb"}), ("llama-zb-v", V),
]
COLLECTIVES: Counter = Counter()  # all-reduces in the graphs AOT autograd compiled, forward and backward


def _counting(half: str) -> Callable[..., Any]:
    def compiler(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        from functorch.compile import make_boxed_func

        COLLECTIVES[half] += sum("all_reduce" in str(n.target) for n in gm.graph.nodes)
        return make_boxed_func(gm.forward)
    return compiler


def counting_backend() -> Any:
    """AOT autograd running its graphs as traced, counting the collectives in them: the split layers compiled."""
    from torch._dynamo.backends.common import aot_autograd

    return aot_autograd(fw_compiler=_counting("forward"), bw_compiler=_counting("backward"))


def build(kind: str) -> Tuple[nn.Sequential, Any, Tuple[torch.Tensor, torch.Tensor], Any]:
    """The model, its plan, a batch and the loss of ``kind`` ("mlp..." or "llama...")."""
    if kind.startswith("mlp"):
        return mlp(), MLP_PLAN, mlp_batches(LOCAL)[0], mse
    batch = lm_batches(LOCAL)[0]
    return flatten_sequential(llama(), batch[0][:1]), "auto", batch, lm_loss


def refused(mesh: Any, kind: str, **kwargs: Any) -> str:
    model, plan, _, _ = build(kind)
    if kind == "mlp-dropout":
        model.block1.add_module("drop", nn.Dropout(0.1))
    try:
        pipeddp.HybridParallel(model, stages=2, mode="stage", mesh=mesh, tp_plan=plan, **kwargs).close()
    except ValueError as exc:
        return str(exc)
    return "built"


def tp_zb_job() -> Dict[str, Any]:
    """Each case of ``CASES`` and the MLP compiled, meta-built, one step (``tp_jobs.train_once``); what compile=
    with a split embedding and with dropout is told."""
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", SHAPE, mesh_dim_names=("dp", "pp", "tp"))
    out: Dict[str, Any] = {"place": tuple(mesh.get_coordinate() or ())}
    for name, extra in CASES + [("mlp-compiled", {"compile": {"backend": counting_backend()}})]:
        model, plan, batch, loss_fn = build(name)
        kwargs = {"chunks": 4, "balance": "params", **extra}
        with pipeddp.HybridParallel(model, stages=SHAPE[1], mode="stage", seed=SEED, mesh=mesh, tp_plan=plan,
                                    **kwargs) as engine:
            out[name] = train_once(engine, batch, loss_fn, LOCAL)
    out["collectives"] = dict(COLLECTIVES)
    out["refused"] = {kind: refused(mesh, kind, compile=True) for kind in ("llama", "mlp-dropout")}
    return out
