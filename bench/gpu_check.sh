#!/usr/bin/env bash
# GPU check (issue 4): on a machine with CUDA, run the GPU tests (the model on CUDA against transformers and
# against the CPU path), then a tp=1 engine on CUDA with the KV cache in GPU memory, printing tokens/s; with
# two or more GPUs also a tp=2 engine over NCCL; and a cost profile of this GPU for the simulated ranks.
# Run from the repo root: bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
make venv >/dev/null
PY=.venv/bin/python
$PY - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count(),
      torch.cuda.get_device_name(0))
print("nccl", torch.cuda.nccl.version())
PY
echo "== GPU tests (model on CUDA vs transformers / CPU)"
$PY -m pytest -q -m gpu tests/ -p no:cacheprovider
echo "== tp=1 engine on CUDA (bf16, KV cache in GPU memory)"
$PY bench/engine_bench.py --device cuda --rounds 1 --requests 64 --gen 128
echo "== a cost profile for the simulated ranks, measured on this GPU (docs/simulation.md)"
PYTHONPATH=. $PY bench/gpu_profile.py --model smollm2-135m-instruct --device cuda --dtype bfloat16 \
  --name "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-')-smollm2-135m" --out gpu_profile.json
if [ "$($PY -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  echo "== tp=2 engine over NCCL"
  $PY - <<'PY'
import asyncio, time, ray
from deployment.settings import Settings
from engine.core import Engine
from workers.sampling_params import SamplingParams

async def main():
    eng = Engine(Settings(model="random", engine_id="gpu-tp2", dp=1, tp=2, device="cuda",
                          host_cache_bytes=0).engine_config())
    await eng.start()
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    async def one(i):
        return sum([1 async for _ in eng.generate(None, eng.tokenizer.encode(f"tp2 request {i}"), params)])
    t0 = time.perf_counter()
    n = sum(await asyncio.gather(*[one(i) for i in range(64)]))
    print(f"tp=2 NCCL decode: {n / (time.perf_counter() - t0):.0f} tok/s")
    await eng.shutdown()

ray.init(include_dashboard=False)
asyncio.run(main())
PY
fi
