#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
cd "$(dirname "$0")/.."
echo "== test_cuda"; s=$SECONDS
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_cuda.py 2>&1 | tee $OUT/test_cuda.log | tail -30; echo "test_cuda $((SECONDS-s))s"
echo "== meta/families on gpu"; timeout 120 python3 gpu_probe/meta_gpu.py 2>&1 | grep -v Warn | tail -20 | tee $OUT/meta_gpu.log
