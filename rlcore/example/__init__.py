"""The built-in tiny example: a synthetic arithmetic task and an SFT-warmed tiny Llama, built
deterministically from a seed with no downloads, so RL can be demonstrated anywhere."""

from rlcore.example.build import BUILDER_VERSION, Recipe, TinyExample, build_tiny_example, default_example_dir, load_tiny_example
from rlcore.example.evaluate import evaluate_accuracy, extract_answer

__all__ = ["BUILDER_VERSION", "Recipe", "TinyExample", "build_tiny_example", "default_example_dir",
           "evaluate_accuracy", "extract_answer", "load_tiny_example"]
