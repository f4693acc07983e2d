"""The training core: log-probs, objectives, batching, engine, optimizer, checkpoints."""
