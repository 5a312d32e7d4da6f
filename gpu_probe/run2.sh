#!/bin/bash
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
cd "$(dirname "$0")/.."
echo "== dropout"; timeout 90 python3 gpu_probe/dropout.py 2>&1 | tail -30 | tee $OUT/dropout.log
echo "== syncs"; timeout 60 python3 gpu_probe/syncs2.py 2>&1 | tail -80 | tee $OUT/syncs2.log
echo "== tf32 off"; timeout 90 python3 -c "
import runpy, sys, torch
torch.backends.cudnn.allow_tf32 = False; torch.backends.cuda.matmul.allow_tf32 = False
sys.argv = ['pipeline_cpu.py', '--device', 'cuda', '--models', 'resnet50', '--ms', '4', '8', '--rounds', '2', '--out', '$OUT/tf32off.json']
runpy.run_path('benchmarks/pipeline_cpu.py', run_name='__main__')" 2>&1 | grep -i "warning\|differ\|error\|Trace" | tee $OUT/tf32.log
echo done
