#!/usr/bin/env bash
# Full fine-tuning of a Hugging Face model on this machine's CPU, the whole path: a random model of one
# family made with transformers (python -m launch.examples.finetune_demo make), imported, fine-tuned on a
# small SFT set with ZeRO-3 in bf16 on 2 processes, exported back to Hugging Face, and asked held-out
# prompts through transformers' text-generation pipeline. Creates .venv when missing.
#   bash launch/finetune_job.sh [--family llama3.1|llama3.2|mistral|mistral-nemo|qwen2.5|qwen3|gemma2|gemma3|
#                                phi3|olmo2|gpt2|mixtral|qwen2-moe|qwen3-moe|olmoe|deepseek-v3|gpt-oss] [pretrain flags, e.g.
#                                --train-iters 100]   (the mixtures of experts train at ep2: each rank two experts)
# WORK (default runs/finetune) holds everything it writes.
set -euo pipefail
cd "$(dirname "$0")/.."
FAMILY=llama3.1
if [ "${1:-}" = "--family" ]; then
    FAMILY=${2:?--family needs a name}
    shift 2
fi
EXPERTS=()
case "$FAMILY" in mixtral|qwen2-moe|qwen3-moe|olmoe|deepseek-v3|gpt-oss) EXPERTS=(--expert-model-parallel-size 2) ;; esac
. launch/venv.sh
WORK=${WORK:-runs/finetune}
rm -rf "$WORK"
python -m launch.examples.finetune_demo make "$WORK" --family "$FAMILY"
python -m pretrain.convert --from-hf "$WORK/hf" --output "$WORK/imported"
python -m launch.torchrun --nproc 2 --pretrained-checkpoint "$WORK/imported" --sft --data-path "$WORK/train.jsonl" \
    --split 1,0,0 --seq-length 12 --micro-batch-size 8 --global-batch-size 16 --zero-stage 3 --bf16 \
    --train-iters 300 --lr 3e-3 --min-lr 1e-4 --lr-warmup-iters 10 --lr-decay-style cosine --weight-decay 0 \
    --hidden-dropout 0 --attention-dropout 0 --log-interval 50 --sample-prompt "" --save "$WORK/finetuned" \
    --data-cache-path "$WORK/cache" ${EXPERTS[@]+"${EXPERTS[@]}"} "$@"
python -m pretrain.convert --load "$WORK/finetuned" --to hf --output "$WORK/hf-finetuned"
python -m launch.examples.finetune_demo answer "$WORK/hf-finetuned" "$WORK/heldout.jsonl"
