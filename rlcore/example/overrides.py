"""Config overrides that point a run at the built-in tiny example."""

from __future__ import annotations

from rlcore.example.build import TinyExample, build_tiny_example


def tiny_example_overrides(example: TinyExample, output_dir: str | None = None) -> list[str]:
    """Model and data paths of `example` (and `trainer.output_dir` when given)."""
    out = [
        f"model.path={example.model_dir}",
        f"data.train_files=[{example.train_file}]",
        f"data.val_files=[{example.val_file}]",
    ]
    return out + ([f"trainer.output_dir={output_dir}"] if output_dir is not None else [])


def example_overrides(seed: int = 0) -> list[str]:
    """Overrides for the tiny example of `seed`, built on first use (the pipeline's `example=True`)."""
    return tiny_example_overrides(build_tiny_example(seed=seed))


def example_rm_overrides(seed: int = 0) -> list[str]:
    """A reward model's config (`rlcore/configs/tiny_rm.yaml`) pointed at the tiny example's
    preference set (built on first use): the SFT model as backbone, pairs to train and hold out."""
    from rlcore.example.preference import build_preference_set

    example = build_tiny_example(seed=seed)
    files = build_preference_set(example)
    return [f"model.path={example.model_dir}", f"data.train_files=[{files.dpo_train}]", f"data.val_files=[{files.dpo_val}]"]


__all__ = ["example_overrides", "example_rm_overrides", "tiny_example_overrides"]
