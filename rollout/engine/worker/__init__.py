"""rollout/engine/worker"""
