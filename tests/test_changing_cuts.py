"""Activations whose structure changes between micro-batches and steps (a mask present or absent, the sequence length
of dynamic padding) cross between processes and train exactly: real gloo jobs under NCCL's rules (``nccl_rules``).

Where the batch has the shapes of the step before, the receiver posts the predicted receives without a header;
a sender whose activation is not the predicted one flags it and sends it after its header (``predicted``).
"""

import pytest
import torch

import pipeddp
from cut_jobs import COMBOS, changing_structure_job, llama_job, llama_reference, reference


def assert_state(got, want):
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-10, msg=key)


@pytest.mark.timeout(240)
def test_a_mask_that_comes_and_goes_trains_the_plain_model_in_every_schedule():
    """2 replicas x 2 stages; 1F1B, ZB, interleaved and ZB-V with 2 virtual stages. Step 1 has step 0's shapes:
    replica 0's micro-batches swap which one has a mask (both flagged, a header each), replica 1's keep theirs (no
    header); step 2 is shorter (a header per activation)."""
    want = reference()
    results = pipeddp.spawn(changing_structure_job, 4, args=(COMBOS,), timeout=200)
    for rank, per_rank in enumerate(results):
        for got in per_rank:
            assert_state(got["state"], want)
            if got["combo"][0] == "1f1b" and got["first"]:
                assert got["headers"] == ([2, 2, 2] if got["replica"] == 0 else [2, 0, 2]), (rank, got["headers"])


@pytest.mark.timeout(240)
def test_a_transformers_llama_with_sdpa_attention_on_padded_and_unpadded_micro_batches():
    """transformers' default attention builds a mask only for a micro-batch with padding (its place crosses empty
    otherwise): 2 stages, the headers in the link's order (gloo) and on a gloo twin (as beside nccl)."""
    pytest.importorskip("transformers")
    want = llama_reference()
    for per_rank in pipeddp.spawn(llama_job, 2, timeout=200):
        assert [got["twin"] for got in per_rank] == [False, True]
        for got in per_rank:
            assert_state(got["state"], want)
