#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
cd "$(dirname "$0")/.."
(nvidia-smi -L; python3 -c "import torch;print(torch.__version__, torch.cuda.get_device_name(0), torch.cuda.nccl.version())") 2>&1 | tee $OUT/info.log
echo "== test_cuda"; s=$SECONDS
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py 2>&1 | tee $OUT/test_cuda.log; echo "test_cuda $((SECONDS-s))s"
echo "== nccl probe"; timeout 60 torchrun --nproc_per_node=2 gpu_probe/nccl_probe.py 2>&1 | tail -20 | tee $OUT/nccl_probe.log
echo "== stage shared"; s=$SECONDS
timeout 150 python3 gpu_probe/stage_shared.py 2>&1 | tail -30 | tee $OUT/stage_shared.log; echo "stage $((SECONDS-s))s"
echo "== syncs"; timeout 60 python3 gpu_probe/syncs.py 2>&1 | tail -40 | tee $OUT/syncs.log
echo "== bench"; s=$SECONDS
timeout 150 python3 benchmarks/pipeline_cpu.py --device cuda --models mlp resnet50 --ms 1 4 8 --out $OUT/pipeline_cuda.json 2>&1 | tail -60 | tee $OUT/bench.log; echo "bench $((SECONDS-s))s"
