"""Demonstrations on this machine: a GPT that only ZeRO-3 or ZeRO-Infinity can hold, and the pieces of
the fine-tuning job (``launch/finetune_job.sh``)."""
