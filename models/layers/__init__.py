"""The layers a model is built from: the layer registry, the residual layer kinds, the GPT block."""
