"""rollout/manager"""
