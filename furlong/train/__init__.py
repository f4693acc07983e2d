"""The training core: log-probs, objectives, batching, the TrainingEngine, optimizers, checkpoints."""
