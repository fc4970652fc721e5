#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-3B-Instruct on one 8-GPU node, OpenRLHF 0.11.2, scheduled by RLHFless or not.
#   SCHEDULER=rlhfless bash examples/openrlhf/grpo_gsm8k_qwen2.5-3b.sh        # never slower than OpenRLHF
#   SCHEDULER=rlhfless-paper bash examples/openrlhf/grpo_gsm8k_qwen2.5-3b.sh  # the paper's exact configuration
#   SCHEDULER=rlhfless-fast bash examples/openrlhf/grpo_gsm8k_qwen2.5-3b.sh   # partial rollouts (1 step stale)
#   SCHEDULER=openrlhf bash examples/openrlhf/grpo_gsm8k_qwen2.5-3b.sh        # OpenRLHF's own behaviour
# Needs a CUDA machine with OpenRLHF's full install (pip install 'openrlhf[vllm]==0.11.2') and rlhfless.
# Not run by this project yet: the development machines have no GPU.
set -euo pipefail
SCHEDULER=${SCHEDULER:-rlhfless}
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${DATA:-$HERE/../../../shared/data/gsm8k/train.jsonl}
MODEL=${MODEL:-Qwen/Qwen2.5-3B-Instruct}
OUT=${OUT:-./runs/grpo-gsm8k-3b-$SCHEDULER}
# Partial rollouts (rlhfless-fast) train carried tokens one weight update stale: OpenRLHF's importance-sampling
# correction (off by default) weights each by its rollout logprob. The launcher turns it on if it is not passed.
CORRECTION=(); [ "$SCHEDULER" = rlhfless-fast ] && CORRECTION=(--algo.advantage.is_correction_level token)

python -m rlhfless_openrlhf.train_ppo_ray \
  --scheduler "$SCHEDULER" \
  --scheduler.profile qwen2.5-3b-h100 \
  --scheduler.report "$OUT/rlhfless_steps.jsonl" \
  --actor.model_name_or_path "$MODEL" \
  --actor.num_nodes 1 --actor.num_gpus_per_node 8 \
  --ref.num_nodes 1 --ref.num_gpus_per_node 8 \
  --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.6 \
  --vllm.enable_sleep --ds.enable_sleep --train.colocate_all --vllm.enable_prefix_caching \
  --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 8 "${CORRECTION[@]}" \
  --algo.kl.init_coef 0.001 --algo.kl.use_loss --algo.kl.estimator k3 \
  --data.prompt_dataset "$DATA" --data.input_key question --data.label_key answer --data.apply_chat_template \
  --reward.remote_url "$HERE/reward_gsm8k.py" \
  --rollout.batch_size 128 --train.batch_size 1024 --rollout.micro_batch_size 8 --train.micro_batch_size 4 \
  --rollout.max_new_tokens 1024 --data.max_len 2048 --rollout.temperature 1.0 \
  --train.num_episodes 1 --train.max_epochs 1 --ds.zero_stage 3 --ds.param_dtype bf16 \
  --actor.gradient_checkpointing_enable \
  --ckpt.output_dir "$OUT" --logger.tensorboard_dir "$OUT/tb"
