"""rollout/engine/sample"""
