"""The RL loop and its parts: configuration, tasks, rewards, advantages, the colocated
train/rollout hand-off, and the loop itself (generate → reward → train → publish)."""
