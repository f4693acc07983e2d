"""The rollout side: sampling masks now; the engine, codec and session server follow."""
