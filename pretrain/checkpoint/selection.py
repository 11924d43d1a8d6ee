"""Which checkpoint a run loads (--load, else --pretrained-checkpoint), which iteration of it, and
whether it takes the weights alone (fine-tuning) or resumes it whole."""

from __future__ import annotations


from pretrain.checkpoint.catalog import exists, read_manifest, run_states
from pretrain.config.schema import Config


def checkpoint_to_load(config: Config) -> str | None:
    """The checkpoint directory whose weights the run starts from, if any."""
    ckpt = config.checkpoint
    if ckpt.load and exists(ckpt.load, ckpt.ckpt_step):
        return ckpt.load
    return (ckpt.pretrained_checkpoint if ckpt.pretrained_checkpoint and exists(ckpt.pretrained_checkpoint)
            else None)


def loads_weights_only(config: Config, directory: str) -> bool:
    """Whether the run takes only the weights of ``directory`` (fine-tuning: --finetune, a
    --pretrained-checkpoint, or --no-load-optim) rather than resuming it whole."""
    ckpt = config.checkpoint
    return directory != ckpt.load or ckpt.finetune or ckpt.no_load_optim


def step_to_load(config: Config, directory: str) -> int | None:
    """The iteration to load under ``directory`` (--ckpt-step applies to --load), or None for the newest."""
    return config.checkpoint.ckpt_step if directory == config.checkpoint.load else None


def resumed_manifest(config: Config) -> dict | None:
    """The manifest of the checkpoint the run resumes whole, or None when it starts at iteration 0
    (nothing to load, fine-tuning, a weights-only import)."""
    directory = checkpoint_to_load(config)
    if directory is None or directory != config.checkpoint.load or config.checkpoint.finetune:
        return None
    _, manifest = read_manifest(directory, step_to_load(config, directory))
    return None if manifest.get("kind") == "weights" else manifest


def resumed_state(config: Config, name: str) -> dict | None:
    """The run state ``name`` (a manifest entry: "progress", "opt_param_scheduler") of the checkpoint the
    run resumes whole, or None when it starts at iteration 0 or the checkpoint has none. Reads its
    manifest alone."""
    manifest = resumed_manifest(config)
    return None if manifest is None else run_states(manifest).get(name)


def resume_point(config: Config) -> tuple[int, int] | None:
    """(iteration, consumed samples) of the checkpoint the run resumes whole, or None when it starts at
    iteration 0."""
    progress = resumed_state(config, "progress")
    return None if not progress else (int(progress["iteration"]), int(progress["consumed_samples"]))
