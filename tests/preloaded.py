"""Imported last in the server the in-process workers are forked from (``harness.processes``): what
the preload created moves to the collector's permanent generation. A forked worker's full
collection (the trainer collects when training starts and at shutdown) then scans only what the
worker made itself: otherwise each one walks the server's whole heap of torch, transformers and
lm-eval objects, writing to every page it holds, a copy-on-write fault each (0.4 s a collection
a rank here)."""

import gc

gc.freeze()
