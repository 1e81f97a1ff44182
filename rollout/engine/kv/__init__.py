"""rollout/engine/kv"""
