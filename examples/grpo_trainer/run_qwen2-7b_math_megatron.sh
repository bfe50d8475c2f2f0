#!/usr/bin/env bash
# GRPO on math with Qwen2-7B, launched on a cluster through Ray or Slurm (the seed article's command):
#
#   examples/grpo_trainer/run_qwen2-7b_math_megatron.sh --distributed_backend ray|slurm \
#       --num_nodes N --gpus_per_node G --batch_size B --gradient_compression True \
#       [--gradient_accumulation_steps K] [--fp16 True] [--model_path DIR] [--train_files F] [--val_files F]
#       [--print] [-- key=value ...]
#
# With --model_path, Qwen2-7B (or any Qwen2/Llama directory) trains on --train_files (GSM8K/MATH-style rows);
# without it the built-in tiny model and arithmetic task stand in, so the command runs on a CPU machine.
# Every flag maps onto scalerl config keys (printed before launch); an unknown flag is an error.
# --gradient_compression True turns on layer-adaptive top-k gradient compression with error feedback
# (comm.gradient_compression=topk; budget comm.compression_budget, 0.1 of dense fp32 bytes by default);
# pass other comm.* keys after `--`, e.g. `-- comm.gradient_compression=powersgd comm.allreduce=hierarchical`.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3}"   # the interpreter that has scalerl installed
backend="" nodes=1 gpus=0 batch=64 compression=False accum=1 fp16=False model="" train="" val="" print=""
extra=()
need() { [ $# -ge 2 ] || { echo "error: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --distributed_backend) need "$@"; backend=$2; shift 2 ;;
    --num_nodes) need "$@"; nodes=$2; shift 2 ;;
    --gpus_per_node) need "$@"; gpus=$2; shift 2 ;;
    --batch_size) need "$@"; batch=$2; shift 2 ;;
    --gradient_compression) need "$@"; compression=$2; shift 2 ;;
    --gradient_accumulation_steps) need "$@"; accum=$2; shift 2 ;;
    --fp16) need "$@"; fp16=$2; shift 2 ;;
    --model_path) need "$@"; model=$2; shift 2 ;;
    --train_files) need "$@"; train=$2; shift 2 ;;
    --val_files) need "$@"; val=$2; shift 2 ;;
    --print) print="--print"; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "error: unknown flag '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done
case "$backend" in ray|slurm) ;; *) echo "error: --distributed_backend must be ray or slurm, got '$backend'" >&2; exit 2 ;; esac
# Numbers are checked before any arithmetic: bash reads "abc" as a variable (0) and "08" as bad octal.
whole() {  # flag value minimum
  if ! [[ "$2" =~ ^(0|[1-9][0-9]{0,8})$ ]] || [ "$2" -lt "$3" ]; then
    echo "error: $1 must be a whole number >= $3, got '$2'" >&2; exit 2
  fi
}
whole --num_nodes "$nodes" 1; whole --gpus_per_node "$gpus" 0; whole --batch_size "$batch" 1
whole --gradient_accumulation_steps "$accum" 1
is_true() { case "${1,,}" in true|1|yes) return 0 ;; false|0|no) return 1 ;; *) echo "error: expected True or False, got '$1'" >&2; exit 2 ;; esac; }
ranks_per_node=$(( gpus > 0 ? gpus : 1 ))
world=$(( nodes * ranks_per_node ))
rollouts=$(( batch * 8 ))
if [ $(( rollouts % accum )) -ne 0 ]; then
  echo "error: --gradient_accumulation_steps $accum must divide batch_size * rollout.n = $rollouts" >&2; exit 2
fi
overrides=("trainer.batch_size=$batch" "rollout.n=8" "actor.ppo_mini_batch_size=$rollouts"
           "actor.ppo_micro_batch_size=$(( rollouts / world / accum > 0 ? rollouts / world / accum : 1 ))"
           "parallel.dp_replicate=$world")
if is_true "$fp16"; then overrides+=("trainer.precision=fp16"); fi
if is_true "$compression"; then overrides+=("comm.gradient_compression=topk" "comm.layer_adaptive=true"); fi
if [ -n "$model" ]; then
  config="$here/qwen2-7b_math.yaml"
  overrides+=("model.path=$model")
  [ -n "$train" ] && overrides+=("data.train_files=[$train]")
  [ -n "$val" ] && overrides+=("data.val_files=[$val]")
else
  config="$here/tiny_arithmetic.yaml"
fi
overrides+=("${extra[@]}")
echo "scalerl overrides: ${overrides[*]}"
if [ "$backend" = slurm ]; then
  exec "$python" -m scalerl launch slurm "$config" "${overrides[@]}" --nodes "$nodes" --gpus-per-node "$gpus" $print
else
  exec "$python" -m scalerl launch ray "$config" "${overrides[@]}" --num-nodes "$nodes" --gpus-per-node "$gpus"
fi
