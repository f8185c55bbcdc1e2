"""rlcore: reinforcement-learning post-training for LLMs.

Three layers (see DESIGN.md): Prefect flows orchestrate model lifecycles, a single-controller
trainer runs the algorithm as a readable loop, and role workers (actor, rollout, reference,
critic, reward) do the computation on Ray or in-process.
"""

__version__ = "0.1.0"
