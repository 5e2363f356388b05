"""Models from local checkpoints, never a hub: one loading path (load.py) for the policy, reference and
critic, whole (pretrained.py, critic.py) or as a rank's shards (shards.py); safetensors reading
(checkpoint.py); hot reload's stage and apply (staging.py)."""
