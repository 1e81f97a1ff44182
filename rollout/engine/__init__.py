"""rollout/engine"""
