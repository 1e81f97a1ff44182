"""rollout/fleet"""
