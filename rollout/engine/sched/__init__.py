"""rollout/engine/sched"""
