"""Jobs across two hosts: two network namespaces joined by a veth pair, one torchrun in each.

Runs where the machine allows network namespaces (root and iproute2), and is
skipped with the reason otherwise.

- Each "host" runs 2 processes; together they form 2 replicas x 2 stages (stage
  mode: each replica's two stages on one host, the DDP all-reduce of each stage
  across the hosts). The trained model must equal single-device training on the
  global batch, as the single-host run does.
- The elastic path, as the README's multi-node recipe runs it: ``--nnodes=1:2``
  with c10d rendezvous, one replica per host and a fixed global batch. The
  second host is lost after step 5 (its agent and worker SIGKILLed); the first
  host's worker fails, its agent restarts it with the one host left, and it
  resumes from the newest checkpoint with one replica and twice the passes.
  The model must equal the plain model trained on the same global batches.
"""

import os
import secrets
import shutil
import subprocess
import sys

import pytest
import torch

import elastic_job
from test_elastic_restart import STEPS, close, plain_training
from test_examples import EXAMPLE, reference

pytestmark = pytest.mark.timeout(420)


def _why_not() -> str:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command)"
    probe = f"pdp-probe-{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


REASON = _why_not()


def run_hosts(hosts, argvs, envs, cwd, timeout: float = 360):
    """One torchrun per host (``ip netns exec``); their return codes and logs."""
    procs = []
    for (ns, dev, addr), argv, extra in zip(hosts, argvs, envs):
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=dev, PYTHONUNBUFFERED="1", **extra)
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                                       *argv], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    logs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            logs.append(stdout + stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [p.returncode for p in procs], logs


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    tag = secrets.token_hex(3)
    hosts = [(f"pdp{tag}a", f"v{tag}a", "10.213.7.1"), (f"pdp{tag}b", f"v{tag}b", "10.213.7.2")]
    try:
        for ns, _, _ in hosts:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for ns, dev, addr in hosts:
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.skipif(bool(REASON), reason=REASON or "runs")
def test_two_host_job_equals_single_device(tmp_path, two_hosts):
    out = tmp_path / "final.pt"
    argv = ["--stages", "2", "--mode", "stage", "--steps", "8", "--out", str(out)]
    master = two_hosts[0][2]
    argvs = [["--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2", "--rdzv_backend=c10d",
              f"--rdzv_endpoint={master}:29517", "--rdzv_id=pipeddp-two-hosts", f"--local_addr={addr}",
              f"--rdzv_conf=is_host={1 if node == 0 else 0}", str(EXAMPLE), *argv]
             for node, (_, _, addr) in enumerate(two_hosts)]
    codes, logs = run_hosts(two_hosts, argvs, [{}, {}], tmp_path)
    for code, log in zip(codes, logs):
        assert code == 0, log[-5000:]
    assert "2 replica(s) x 2 stage(s)" in logs[0]
    got = torch.load(out)
    expected = reference(argv, 2)
    assert list(got) == list(expected)
    assert max((got[k] - expected[k]).abs().max().item() for k in got) < 2e-5


@pytest.mark.skipif(bool(REASON), reason=REASON or "runs")
def test_elastic_job_loses_a_host_and_finishes_on_the_other(tmp_path, two_hosts):
    out, directory = tmp_path / "final.pt", tmp_path / "ckpt"
    master = two_hosts[0][2]
    argvs = []
    for node, (_, _, addr) in enumerate(two_hosts):
        argvs.append(["--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={master}:29518",
                      "--rdzv-id=pipeddp-elastic", f"--local-addr={addr}", "--max-restarts=1", "--monitor-interval=0.5",
                      "--rdzv-conf=" + ",".join([f"is_host={1 if node == 0 else 0}", "last_call_timeout=10",
                                                 "keep_alive_interval=1", "keep_alive_max_attempt=2"]),
                      elastic_job.__file__, str(directory), str(STEPS), "0", str(out), "file"])
    # last_call_timeout: how long the first host waits for the second at the start (and, after the loss, before
    # going on alone); the heartbeat settings drop the lost host from the rendezvous after 2 s
    codes, logs = run_hosts(two_hosts, argvs, [{}, {"LOSE_HOST_AT": "5"}], tmp_path)
    assert codes[0] == 0, logs[0][-5000:]
    assert codes[1] != 0, logs[1][-3000:]  # the lost host: its agent was killed
    assert "replicas 2 accumulation 2: starting at step 0" in logs[0]
    # the newest checkpoint before the loss is step 4's: the survivor trains step 5 again, alone
    assert "replicas 1 accumulation 4: starting at step 4, epoch 0, 32 samples consumed" in logs[0], logs[0][-5000:]
    assert close(torch.load(out), plain_training()) < 1e-10
