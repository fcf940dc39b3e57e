"""The global batch order: each data-parallel rank's slice of each global batch, resumable,
prefetched.

The global batch order is a function of the seed alone: step s uses sequences [s·B, (s+1)·B) of an
endless stream of seeded permutations of the packed corpus, and data-parallel rank r takes its
contiguous slice of that global batch. The loader's only state is how many sequences the whole job
has consumed, so it does not depend on the layout and a run can resume under a different number of
data-parallel ranks. Each batch also carries the whole global batch's count of trained targets
(every rank knows all its rows), and :class:`BatchPrefetcher` builds the batches ahead on a
background thread.
"""

from __future__ import annotations

import queue
import threading
import weakref

import torch

from composer3d.data.packing import Batch, PackedSequences
from composer3d.data.shards import PreparedSequences, check_same_corpus
from composer3d.errors import ConfigError


class GlobalBatchLoader:
    """Yields this data-parallel rank's slice of each global batch; resumable from a layout-free
    position."""

    def __init__(
        self,
        sequences: PackedSequences | PreparedSequences | torch.Tensor,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ):
        # bare token windows: no documents known, every target counts
        if isinstance(sequences, torch.Tensor):
            sequences = PackedSequences(sequences)
        self.sequences = sequences
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.seed = seed
        self.consumed = 0  # sequences consumed by the whole job
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def _index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.sequences))
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._order = (
                epoch,
                torch.randperm(len(self.sequences), generator=generator),
            )
        return int(self._order[offset])

    def next_batch(self) -> Batch:
        """This rank's slice of the next global batch, with the global batch's count of trained
        targets.

        Every rank knows the whole global batch's rows, so the count needs no collective (nor a host
        sync).
        """
        rows = [
            self._index(p) for p in range(self.consumed, self.consumed + self.global_batch_size)
        ]
        self.consumed += self.global_batch_size
        start = self.dp_rank * self.local_batch_size
        batch = self.sequences.batch(rows[start : start + self.local_batch_size])
        batch.global_targets = self.sequences.target_count(rows)
        return batch

    def state_dict(self) -> dict:
        state = {
            "consumed_sequences": self.consumed,
            "num_sequences": len(self.sequences),
            "seed": self.seed,
        }
        identity = getattr(self.sequences, "identity", None)
        if identity is not None:  # a prepared corpus: a resume checks it is still the same one
            state["prepared_corpus"] = identity
        return state

    def load_state_dict(self, state: dict) -> None:
        check_same_corpus(state, getattr(self.sequences, "identity", None))
        if state["num_sequences"] != len(self.sequences) or state["seed"] != self.seed:
            raise ConfigError(
                "checkpoint.resume: the checkpoint's data-loader state is for "
                f"{state['num_sequences']} sequences with seed {state['seed']}, but this run has "
                f"{len(self.sequences)} with seed {self.seed}: the corpus (data.*), train.seq_len "
                "or train.seed changed since it was saved. Resume with the settings it was saved "
                "with (its composer3d.json has them), or start afresh in a new run.dir with "
                "checkpoint.resume=none"
            )
        self.consumed = state["consumed_sequences"]


class BatchPrefetcher:
    """A GlobalBatchLoader whose next batches are built ahead on a background thread, off the step's
    critical path.

    Same interface as the loader. On an accelerator the thread also pins each batch, so that
    next_batch()'s copy to the device is asynchronous (from pageable memory the host would wait for
    it). The thread starts at the first next_batch() and is from then on the only caller of the
    inner loader (whose epoch order cache is not thread-safe); state_dict() is the position after
    the batches handed out, not after those built ahead.
    """

    def __init__(self, loader: GlobalBatchLoader, device: torch.device | str, depth: int = 2):
        self.loader, self.device, self.depth = loader, torch.device(device), depth
        self._state = loader.state_dict()
        self._batches: queue.Queue | None = None
        self._stop: weakref.finalize | None = None

    def _start(self) -> None:
        # pin_memory() allocates through the thread's current device: give it the one the main
        # thread uses
        device_index = None
        if self.device.type != "cpu":
            device_index = (
                self.device.index
                if self.device.index is not None
                else torch.accelerator.current_device_index()
            )
        self._batches, stop = queue.Queue(self.depth), threading.Event()
        thread = threading.Thread(
            target=_prefetch,
            args=(self.loader, self._batches, stop, device_index),
            name="composer3d-prefetch",
            daemon=True,
        )
        thread.start()
        # also runs when the prefetcher is garbage-collected or the interpreter exits; a second call
        # does nothing
        self._stop = weakref.finalize(self, _stop_prefetch, thread, self._batches, stop)

    def next_batch(self) -> Batch:
        if self._batches is None:
            self._start()
        batch, state = self._batches.get()
        if isinstance(batch, BaseException):
            # the thread has ended; a later call starts again after the batches handed out
            self.close()
            raise batch
        self._state = state
        return batch if self.device.type == "cpu" else batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        """Stops the thread (if running); the inner loader is left at the position of the batches
        handed out."""
        if self._stop is not None:
            self._stop()
        self._batches = None
        self.loader.load_state_dict(self._state)

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        self.close()  # a running thread has built batches from the old position
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()


def _prefetch(
    loader: GlobalBatchLoader, batches: queue.Queue, stop: threading.Event, device_index: int | None
):
    """The prefetch thread: queues (batch, loader state after it) until stopped; an error is queued
    and ends it."""
    try:
        if device_index is not None:
            torch.accelerator.set_device_index(device_index)
        while not stop.is_set():
            batch = loader.next_batch()
            batches.put(
                (batch if device_index is None else batch.pin_memory(), loader.state_dict())
            )
    except BaseException as error:  # re-raised in the main thread by next_batch()
        batches.put((error, None))


def _stop_prefetch(thread: threading.Thread, batches: queue.Queue, stop: threading.Event) -> None:
    stop.set()
    # emptying the queue frees a put() blocked on it; the thread then sees stop and ends
    while True:
        try:
            batches.get_nowait()
        except queue.Empty:
            break
    # (a garbage collection may run on the thread itself)
    if thread is not threading.current_thread():
        thread.join()
