"""Training-loop state across ranks with its one-device meaning: names and state dicts (state_dict), gradient clipping
(clip), checkpoints (checkpoint)."""
