#!/usr/bin/env bash
# One real GRPO step on ONE GPU with each scheduler, then the two RLHFless step reports side by side.
#   bash examples/openrlhf/one_gpu_step.sh            (MODEL defaults to Qwen2.5-0.5B-Instruct)
#   SCHEDULER=rlhfless-fast bash examples/openrlhf/one_gpu_step.sh   (another RLHFless preset beside OpenRLHF)
# Needs a CUDA GPU, OpenRLHF's full install and the model in the local HuggingFace cache.
# Not run by this project yet: the development machines have no GPU and this task was not lent one.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${DATA:-$HERE/../../../shared/data/gsm8k/test.jsonl}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
export SCHEDULER=${SCHEDULER:-rlhfless}
for RUN in openrlhf-logged "$SCHEDULER"; do
  OUT=./runs/one-gpu-$RUN
  NAME=$RUN; [ "$RUN" = openrlhf-logged ] && NAME=openrlhf
  # OpenRLHF's behaviour, but through the adapter's generator so it writes the same step report:
  CONFIG=(); [ "$RUN" = openrlhf-logged ] && CONFIG=(--scheduler.config "$HERE/openrlhf_logged.yaml")
  # partial rollouts (rlhfless-fast) train carried tokens one weight update stale: importance-sampling correction
  CORRECTION=(); [ "$RUN" = rlhfless-fast ] && CORRECTION=(--algo.advantage.is_correction_level token)
  python -m rlhfless_openrlhf.train_ppo_ray --scheduler "$NAME" "${CONFIG[@]}" "${CORRECTION[@]}" \
    --scheduler.profile qwen2.5-3b-h100 --scheduler.report "$OUT/steps.jsonl" \
    --actor.model_name_or_path "$MODEL" --actor.num_nodes 1 --actor.num_gpus_per_node 1 \
    --ref.num_nodes 1 --ref.num_gpus_per_node 1 --train.colocate_all \
    --vllm.num_engines 1 --vllm.gpu_memory_utilization 0.4 --vllm.enable_sleep --ds.enable_sleep \
    --vllm.enable_prefix_caching \
    --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 4 \
    --data.prompt_dataset "$DATA" --data.input_key question --data.label_key answer --data.apply_chat_template \
    --data.max_samples 16 --reward.remote_url "$HERE/reward_gsm8k.py" \
    --rollout.batch_size 16 --train.batch_size 64 --rollout.micro_batch_size 4 --train.micro_batch_size 2 \
    --rollout.max_new_tokens 512 --data.max_len 1024 --train.num_episodes 1 --ds.zero_stage 2 \
    --ds.param_dtype bf16 --ckpt.output_dir "$OUT"
done
python - <<'PY'
import json
import os
runs = ("openrlhf-logged", os.environ["SCHEDULER"])
rows = [json.loads(open(f"./runs/one-gpu-{s}/steps.jsonl").readline()) for s in runs]
for key in ("scheduler", "generation_s", "gpu_seconds", "idle_fraction", "migrations", "prefill_tokens_saved",
            "num_actors", "prediction_mae"):
    print(f"{key:<22}{rows[0][key]!s:>20}{rows[1][key]!s:>20}")
PY
