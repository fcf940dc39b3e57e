"""Precision: autocast, parameters cast once a forward, float8 linears, fp16 loss scaling."""
