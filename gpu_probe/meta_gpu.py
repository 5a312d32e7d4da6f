"""A meta-built Llama (tied) and the new families on CUDA stages against the original model on the CPU (float64)."""
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
import pipeddp
from hf_jobs import MODELS, batch, logits, loss_fn, llama
from pipeddp.tools.models import flatten_sequential

dev = ["cuda:0", "cuda:0"]
# meta-built Llama on GPU stages == materialize on the CPU
def meta():
    m = llama(layers=3, meta=True)
    m.lm_head.weight = m.model.embed_tokens.weight
    return m
x, y = batch("llama", 6, 1, True)
ref = meta(); pipeddp.materialize(ref, seed=5, init=ref._init_weights)
want = logits(ref, x); loss = loss_fn(want, y); loss.backward()
flat = flatten_sequential(meta(), batch("llama", 4, 0, True)[0])
with pipeddp.Pipeline(flat, dev, chunks=3, seed=5) as pipe:
    got = pipe.train_step(x, y, loss_fn)
    g = {pipe.key_names.original(n): p.grad.cpu() for n, p in pipe.named_parameters()}
    worst = max((g[n] - p.grad).abs().max().item() for n, p in ref.named_parameters() if n in g)
    print("meta llama on cuda: loss diff", abs(got.item() - loss.item()), "grad diff", worst, flush=True)
    assert abs(got.item() - loss.item()) < 1e-6 and worst < 1e-6  # Llama's RMSNorm computes in float32 inside
for kind in ("gemma2", "albert", "t5"):
    ref = MODELS[kind]()
    if kind == "t5":
        from test_families import seq2seq
        sample, _ = seq2seq(4, 0, True); x, y = seq2seq(6, 1, True)
    else:
        sample, _ = batch(kind, 4, 0, True); x, y = batch(kind, 6, 1, True)
    want = logits(ref, x)
    flat = flatten_sequential(MODELS[kind](), sample)
    with pipeddp.Pipeline(flat, dev, chunks=3) as pipe:
        pipe.eval()
        with torch.no_grad():
            out = pipe(x).cpu()
    d = (out - want).abs().max().item()
    print(kind, "on cuda stages: logits diff", d, flush=True)
    assert d < 1e-6
print("ok meta-gpu")
