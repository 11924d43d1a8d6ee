"""Training a GPT: the run's configuration, the checks before it starts, the training loop, its
checkpoints, Hugging Face interop and what it reports. ``python -m pretrain`` is the entry point.

Sub-packages, each one concern: ``config`` (what a run is: dataclasses = flags = YAML keys),
``startup`` (what is settled and checked before training), ``training`` (the loop and what feeds it),
``checkpoint`` (saving, finding, verifying and re-cutting checkpoints), ``interop`` (Hugging Face and
file conversions), ``observability`` (metrics files, console, wandb, tensorboard).

``pretrain.load_model(path)`` loads a checkpoint of any layout, or a Hugging Face directory, as one
plain module on one process (``pretrain.interop.load_model``).
"""


def load_model(path, dtype=None):
    """A checkpoint of any layout or a Hugging Face directory as one plain ``nn.Module``: ``model(input_ids)``
    gives logits [batch, sequence, vocabulary], ``model.tokenizer`` its tokenizer (see
    ``pretrain.interop.load_model``)."""
    import torch

    from pretrain.interop.load_model import load_model as load

    return load(path, torch.float32 if dtype is None else dtype)
