"""rollout/agents"""
