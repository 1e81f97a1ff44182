"""rollout/engine/attention"""
