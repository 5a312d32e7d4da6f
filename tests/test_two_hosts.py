"""A job across two hosts: two network namespaces joined by a veth pair, one torchrun in each.

Runs where the machine allows network namespaces (root and iproute2), and is
skipped with the reason otherwise. Each "host" runs 2 processes; together they
form 2 replicas x 2 stages (stage mode: each replica's two stages on one host,
the DDP all-reduce of each stage across the hosts). The trained model must equal
single-device training on the global batch, as the single-host run does.
"""

import os
import secrets
import shutil
import subprocess
import sys

import pytest
import torch

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
    procs = []
    for node, (ns, dev, addr) in enumerate(two_hosts):
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=dev, PYTHONUNBUFFERED="1")
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
               "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=2", "--rdzv_backend=c10d",
               f"--rdzv_endpoint={master}:29517", "--rdzv_id=pipeddp-two-hosts", f"--local_addr={addr}",
               f"--rdzv_conf=is_host={1 if node == 0 else 0}",
               str(EXAMPLE), *argv]
        procs.append(subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    logs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=360)
            logs.append(stdout + stderr)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-5000:]
    assert "2 replica(s) x 2 stage(s)" in logs[0]
    got = torch.load(out)
    expected = reference(argv, 2)
    assert list(got) == list(expected)
    assert max((got[k] - expected[k]).abs().max().item() for k in got) < 2e-5
