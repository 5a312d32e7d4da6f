"""Can two processes share one GPU over nccl? (NCCL refuses duplicate GPUs in a communicator in many versions.)"""
import os, torch, torch.distributed as dist
dist.init_process_group("nccl")
r = dist.get_rank()
torch.cuda.set_device(0)
t = torch.full((4,), float(r), device="cuda:0")
if r == 0:
    dist.send(t + 10, 1)
else:
    dist.recv(t, 0)
torch.cuda.synchronize()
print("rank", r, "got", t.tolist(), "nccl", torch.cuda.nccl.version(), flush=True)
dist.destroy_process_group()
