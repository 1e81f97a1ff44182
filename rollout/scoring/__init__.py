"""rollout/scoring"""
