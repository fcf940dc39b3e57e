"""Evaluation beyond the loss: lm-evaluation-harness tasks scored in any layout."""
