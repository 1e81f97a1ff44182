"""rollout/weights"""
