"""A Hugging Face model's cached decoding for ``composer3d-generate``, in transformers' own cache
classes.

``HFCausalLM.forward`` runs transformers' decoder layers itself (so a pipeline stage can start at
any layer); this runs the same loop with a ``DynamicCache`` (grows a step at a time) or a
``StaticCache`` (preallocated to ``max_len``, written in place) handed to every layer, and with
transformers' masks built from the padding mask and the cache, as transformers' generate does. Both
caches allocate from the first keys they store, so under tensor parallel each rank's holds its share
of the heads.
"""

from __future__ import annotations

import inspect

import torch


class HFDecoder:
    """``decoder(tokens, attention_mask)`` → the logits after each row's last new token, (batch,
    vocab).

    ``tokens`` (batch, new): the tokens after those already cached; ``attention_mask`` (batch,
    cached + new): 1 on real tokens, 0 on left padding. Positions count each row's real tokens, as
    transformers' generate counts them.
    """

    def __init__(self, model, max_len: int, cache: str):
        from transformers import DynamicCache, StaticCache

        self.model = model
        self.cache = (
            StaticCache(config=model.config, max_cache_len=max_len)
            if cache == "static"
            else DynamicCache(config=model.config)
        )
        layer_parameters = inspect.signature(next(iter(model.layers.values())).forward).parameters
        # The layers' keyword for the cache: past_key_values up to transformers 5.2x, cache after
        self._cache_keyword = "cache" if "cache" in layer_parameters else "past_key_values"
        self._takes_cache_position = "cache_position" in layer_parameters
        self.length = 0

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        model, start, end = self.model, self.length, self.length + tokens.shape[1]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, start:end]
        h = model.embed(tokens)
        kinds = {model._layer_type(i) for i in model.layers.keys()}
        masks = model._masks(h, position_ids, kinds, attention_mask, self.cache)
        rotary = model._rotary(h, position_ids, kinds)
        extra = {self._cache_keyword: self.cache, "use_cache": True}
        if self._takes_cache_position:
            extra["cache_position"] = torch.arange(start, end, device=tokens.device)
        for i, layer in model.layers.items():
            kind = model._layer_type(i)
            out = layer(
                h,
                attention_mask=masks[kind],
                position_embeddings=rotary[kind],
                position_ids=position_ids,
                **extra,
            )
            h = out[0] if isinstance(out, tuple) else out
        self.length = end
        return model.logits(h[:, -1:])[:, -1]
