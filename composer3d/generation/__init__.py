"""Text generation for ``composer3d-generate``: prefill and cached decode of a batch of prompts, and
the rules that pick each next token.

- ``sampling``: greedy, temperature, top-k and top-p (nucleus) draws from a seeded generator;
- ``decoding``: the loop — prompts left-padded into one batch, the model's cached forward
  (``model.decoder``: a static KV cache for the native model, transformers' cache classes for
  Hugging Face models) or the whole sequence recomputed each step, stopped per row at its eos, a
  stop string or the token limit.
"""

from composer3d.generation.decoding import Generation, Recompute, generate
from composer3d.generation.sampling import next_tokens

__all__ = ["Generation", "Recompute", "generate", "next_tokens"]
