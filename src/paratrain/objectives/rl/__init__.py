"""Reinforcement learning with generation (``loss.name = 'grpo'``, docs/grpo.md): the generation
phase of a round (rollout.py) and the reward functions (rewards.py). The loss itself is an
objective (objectives/policy_gradient.py)."""
