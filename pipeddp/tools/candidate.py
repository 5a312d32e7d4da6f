"""One configuration ``plan`` ranks, and how to run it: the ``HybridParallel`` call, the mesh, the torchrun command.

A configuration is written replicas x stages (x tp with tensor parallelism),
the mesh's ``(dp, pp, tp)`` order; ``kind`` names it as a user would (the
plain model, data parallelism, a pipeline, tensor parallelism, or several).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

from .simulate import Prediction

__all__ = ["Candidate"]


@dataclass
class Candidate:
    """One configuration and what the simulator says about it.

    ``stages`` devices per replica, each holding ``virtual_stages`` stages
    (``balance`` lists the layers of all ``stages * virtual_stages`` of them).
    """

    stages: int
    replicas: int
    chunks: int
    micro_batch: int
    schedule: str
    balance: List[int]
    prediction: Prediction
    memory: List[float]
    why: str
    virtual_stages: int = 1
    #: how each stage's state is split over its replicas (``HybridParallel(shard=...)``), chosen where memory demands
    shard: str = "none"
    #: seconds the shard setting adds to the simulated step ("full" gathers each stage again per micro-batch)
    shard_time: float = 0.0
    #: with virtual stages, which device holds which: round robin ("loop") or down and back up ("v")
    placement: str = "loop"
    #: devices each stage's layers are split over (tensor parallelism, the mesh's innermost dimension)
    tp: int = 1

    @property
    def step_time(self) -> float:
        return self.prediction.step_time + self.shard_time

    @property
    def kind(self) -> str:
        """What a user would call it: the plain model, plain data parallelism, a pipeline, tensor parallelism."""
        joined = "DDP" if self.shard == "none" else "FSDP2"
        if self.stages == 1 and self.tp == 1:
            return "plain model" if self.replicas == 1 else f"data parallel ({joined})"
        if self.stages == 1 and self.replicas == 1:
            return "tensor parallel"
        parts = ["pipeline"] * (self.stages > 1) + ["TP"] * (self.tp > 1) + [joined] * (self.replicas > 1)
        return " x ".join(parts)

    @property
    def layout(self) -> str:
        """``replicas x stages`` (``x tp`` with tensor parallelism), the order every other part of pipeddp writes a
        layout in and the mesh's ``(dp, pp, tp)``."""
        return f"{self.replicas} x {self.stages}" + (f" x {self.tp}" if self.tp > 1 else "")

    @property
    def grid(self) -> str:
        """``replicas x stages x tp``, all three always (a table that ranks tensor-parallel degrees)."""
        return f"{self.replicas} x {self.stages} x {self.tp}"

    @property
    def schedule_text(self) -> str:
        if self.stages == 1:
            return "-"
        in_v = ", the V" if self.placement == "v" else ""
        return self.schedule + (f" (v={self.virtual_stages}{in_v})" if self.virtual_stages > 1 else "")

    def mesh(self, device: str = "cuda") -> str:
        """The ``DeviceMesh`` a tensor-parallel configuration runs on: tp innermost, so a tp group is one host's."""
        return (f"init_device_mesh({device!r}, ({self.replicas}, {self.stages}, {self.tp}), "
                "mesh_dim_names=('dp', 'pp', 'tp'))")

    def arguments(self, tp_plan: str = "'auto'") -> str:
        """The ``HybridParallel`` call that runs this configuration (``model`` is the user's nn.Sequential; with
        tensor parallelism, one process per device on ``mesh()``, and ``tp_plan`` the plan's text)."""
        args = [f"stages={self.stages}"]
        if self.tp > 1:
            args += ["mode='stage'", "mesh=mesh", f"tp_plan={tp_plan}"]
        args += [f"chunks={self.chunks}"]
        if self.stages > 1:
            args += [f"schedule={self.schedule!r}"]
            if self.virtual_stages > 1:
                args += [f"virtual_stages={self.virtual_stages}"]
            if self.placement != "loop":
                args += [f"placement={self.placement!r}"]
            args += [f"balance={list(self.balance)}"]
        if self.shard != "none":
            args += [f"shard={self.shard!r}"]
        return f"pipeddp.HybridParallel(model, {', '.join(args)})"

    def command(self, devices_per_node: int, script: str = "train.py") -> str:
        """The torchrun command: one process per replica (each drives ``stages`` devices, mode="replica"); with
        tensor parallelism one process per device (mode="stage")."""
        if self.tp > 1:
            per_node = min(devices_per_node, self.replicas * self.stages * self.tp)
            nodes = math.ceil(self.replicas * self.stages * self.tp / per_node)
        else:
            per_node = max(1, devices_per_node // self.stages)
            nodes = math.ceil(self.replicas / per_node)
            per_node = min(per_node, self.replicas)
        if nodes <= 1:
            return f"torchrun --nproc_per_node={per_node} {script}"
        return (f"torchrun --nnodes={nodes} --nproc_per_node={per_node} --rdzv-backend=c10d "
                f"--rdzv-endpoint=HOST:29400 {script}")
