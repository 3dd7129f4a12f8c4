#!/usr/bin/env bash
# Every recipe from the front door on a GPU: `fvstep train` for two steps, then `fvstep export`
# in each format (docs/gpu.md). Run from a checkout with fvstep importable; writes under /tmp
# and prints one line per command (tee'd to $OUT/front_door.txt when $OUT is set).
set -u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch; print('torch', torch.__version__)"
{
for r in finetune "finetune --lora.rank 8" dmd2 lora_dmd2 self_forcing streaming diffusion_nft; do
  n=$(echo "$r" | tr -c 'a-z0-9\n' '_'); s=$(date +%s)
  timeout 150 python -m fvstep train $r --run.device cuda --run.num_steps 2 --run.every 2 --run.progress false --run.out /tmp/r_$n > /tmp/log_$n 2>&1
  echo "train $r rc=$? $(( $(date +%s) - s ))s | $(tail -1 /tmp/log_$n | cut -c1-200)"
done
for spec in "finetune student model" "finetune___lora_rank_8 student lora" "finetune___lora_rank_8 student merged" "dmd2 teacher safetensors" "lora_dmd2 critic lora" "self_forcing student safetensors" "streaming student safetensors"; do
  set -- $spec
  timeout 120 python -m fvstep export /tmp/r_$1 --role $2 --format $3 --out /tmp/e_$1_$2_$3 > /tmp/log_e 2>&1
  echo "export $1 --role $2 --format $3 rc=$? | $(tail -1 /tmp/log_e | cut -c1-160) | $(ls /tmp/e_$1_$2_$3 2>/dev/null | head -3 | tr '\n' ' ')"
done
for n in finetune dmd2 self_forcing; do echo "$n samples: $(find /tmp/r_$n -name '*.mp4' -o -name '*.gif' -o -name '*.png' 2>/dev/null | wc -l) files; metrics keys: $(tail -1 /tmp/r_$n/metrics.jsonl 2>/dev/null | cut -c1-200)"; done
} 2>&1 | tee "${OUT:-/tmp}/front_door.txt"
