"""The data path off the step's critical path: global target counts without a collective, background
prefetch."""

import threading
import time

import pytest
import torch

from composer3d.data import (
    IGNORE_INDEX,
    BatchPrefetcher,
    ByteTokenizer,
    GlobalBatchLoader,
    PackedSequences,
    TokenStream,
    document_stream,
)

CPU = torch.device("cpu")
SEQ_LEN, GLOBAL_BATCH = 16, 8
DOCS = [
    "the quick brown fox",
    "jumps over",
    "the lazy dog!",
    "a",
    "pipeline parallel splits layers",
]

# a prefetch thread that hangs fails the test instead of the run
pytestmark = pytest.mark.timeout(60)


def text_sequences(document_masking: bool) -> PackedSequences:
    stream = document_stream(iter(DOCS * 6), ByteTokenizer(), 0)
    return PackedSequences.from_stream(stream, SEQ_LEN, document_masking)


def chat_sequences(document_masking: bool) -> PackedSequences:
    """A stream with conversations starting every 23 tokens and a random half of the tokens
    trainable."""
    generator = torch.Generator().manual_seed(0)
    n = 12 * SEQ_LEN + 1
    starts = torch.arange(n) % 23 == 0
    stream = TokenStream(
        torch.randint(0, 256, (n,), generator=generator),
        starts,
        torch.rand(n, generator=generator) < 0.5,
    )
    return PackedSequences.from_stream(stream, SEQ_LEN, document_masking)


def synthetic_sequences() -> PackedSequences:
    return PackedSequences(
        torch.randint(0, 256, (12, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    )


SEQUENCES = {
    "synthetic": synthetic_sequences,
    "text_masked": lambda: text_sequences(True),
    "text_unmasked": lambda: text_sequences(False),
    "chat_masked": lambda: chat_sequences(True),
    "chat_unmasked": lambda: chat_sequences(False),
}


def assert_same(got, want):
    for key in ("inputs", "targets", "position_ids"):
        assert torch.equal(getattr(got, key), getattr(want, key)), key
    assert got.global_targets == want.global_targets


def wait_for(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# --------------------------------------------------------------- global target count, no collective


@pytest.mark.parametrize("kind", SEQUENCES)
@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_global_targets_equal_the_sum_over_data_parallel_slices(kind, dp_size):
    sequences = SEQUENCES[kind]()
    loaders = [
        GlobalBatchLoader(sequences, GLOBAL_BATCH, rank, dp_size, seed=1) for rank in range(dp_size)
    ]
    steps = 2 * len(sequences) // GLOBAL_BATCH + 1  # past two epoch boundaries
    for step in range(steps):
        parts = [loader.next_batch() for loader in loaders]
        summed = sum(int((p.targets != IGNORE_INDEX).sum()) for p in parts)
        assert [p.global_targets for p in parts] == [summed] * dp_size, (kind, step)
        total = GLOBAL_BATCH * SEQ_LEN
        # masking must have removed targets where it applies (else this test could not tell the
        # rules apart)
        assert (
            summed < total
            if kind in ("text_masked", "chat_masked", "chat_unmasked")
            else summed == total
        )


@pytest.mark.parametrize("kind", SEQUENCES)
def test_target_count_applies_the_batch_masks(kind):
    sequences = SEQUENCES[kind]()
    for rows in ([0], [3, 1, 3], list(range(len(sequences)))):
        assert sequences.target_count(rows) == int(
            (sequences.batch(rows).targets != IGNORE_INDEX).sum()
        )


def test_global_targets_travel_with_the_batch():
    batch = GlobalBatchLoader(text_sequences(True), GLOBAL_BATCH, 0, 2, seed=0).next_batch()
    assert batch.global_targets is not None and batch.to(CPU).global_targets == batch.global_targets


# ------------------------------------------------------------------------------ background prefetch


def test_prefetcher_yields_the_loaders_batches_across_epochs():
    sequences = text_sequences(True)
    steps = 2 * len(sequences) // GLOBAL_BATCH + 1
    bare = GlobalBatchLoader(sequences, GLOBAL_BATCH, 1, 2, seed=5)
    prefetcher = BatchPrefetcher(GlobalBatchLoader(sequences, GLOBAL_BATCH, 1, 2, seed=5), CPU)
    try:
        for _ in range(steps):
            assert_same(prefetcher.next_batch(), bare.next_batch())
    finally:
        prefetcher.close()


def test_state_is_the_trainers_position_not_the_threads():
    sequences = text_sequences(True)
    bare = GlobalBatchLoader(sequences, GLOBAL_BATCH, 0, 1, seed=2)
    prefetcher = BatchPrefetcher(
        GlobalBatchLoader(sequences, GLOBAL_BATCH, 0, 1, seed=2), CPU, depth=2
    )
    try:
        k = 3
        for _ in range(k):
            prefetcher.next_batch(), bare.next_batch()
        # the thread fills the queue and builds one more batch, blocked on putting it
        wait_for(lambda: prefetcher.loader.consumed == (k + 3) * GLOBAL_BATCH)
        assert prefetcher.state_dict() == bare.state_dict()
        assert prefetcher.state_dict()["consumed_sequences"] == k * GLOBAL_BATCH
        saved = prefetcher.state_dict()
    finally:
        prefetcher.close()
    expected = [bare.next_batch() for _ in range(4)]

    resumed = BatchPrefetcher(GlobalBatchLoader(sequences, GLOBAL_BATCH, 0, 1, seed=2), CPU)
    running = BatchPrefetcher(GlobalBatchLoader(sequences, GLOBAL_BATCH, 0, 1, seed=2), CPU)
    try:
        resumed.load_state_dict(saved)
        running.next_batch()  # its thread has run ahead from position 0: loading must restart it
        running.load_state_dict(saved)
        for want in expected:
            assert_same(resumed.next_batch(), want)
            assert_same(running.next_batch(), want)
        assert resumed.state_dict() == running.state_dict() == bare.state_dict()
    finally:
        resumed.close()
        running.close()


class FailingLoader(GlobalBatchLoader):
    def __init__(self, *args, fail_at: int):
        super().__init__(*args)
        self.calls, self.fail_at = 0, fail_at

    def next_batch(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError(f"corrupt shard at call {self.calls}")
        return super().next_batch()


def test_an_error_in_the_thread_is_raised_by_next_batch():
    prefetcher = BatchPrefetcher(
        FailingLoader(text_sequences(True), GLOBAL_BATCH, 0, 1, 0, fail_at=3), CPU
    )
    try:
        prefetcher.next_batch(), prefetcher.next_batch()
        with pytest.raises(RuntimeError, match="corrupt shard at call 3"):
            prefetcher.next_batch()
        assert prefetcher.state_dict()["consumed_sequences"] == 2 * GLOBAL_BATCH
        # the next call starts over after the batches handed out (the loader no longer fails)
        want = GlobalBatchLoader(text_sequences(True), GLOBAL_BATCH, 0, 1, 0)
        want.load_state_dict(prefetcher.state_dict())
        assert_same(prefetcher.next_batch(), want.next_batch())
    finally:
        prefetcher.close()


def test_close_joins_the_thread_even_when_it_is_blocked():
    before = set(threading.enumerate())
    prefetcher = BatchPrefetcher(
        GlobalBatchLoader(text_sequences(True), GLOBAL_BATCH, 0, 1, 0), CPU, depth=1
    )
    prefetcher.next_batch()
    (thread,) = set(threading.enumerate()) - before
    assert thread.daemon and thread.is_alive()
    wait_for(lambda: prefetcher.loader.consumed == 3 * GLOBAL_BATCH)  # queue full, a put() blocked
    prefetcher.close()
    assert not thread.is_alive()
    prefetcher.close()  # a second close does nothing
    # the inner loader is back at the trainer's position
    assert prefetcher.loader.state_dict() == prefetcher.state_dict()
    assert prefetcher.state_dict()["consumed_sequences"] == GLOBAL_BATCH


def test_a_dropped_prefetcher_stops_its_thread():
    before = set(threading.enumerate())
    prefetcher = BatchPrefetcher(
        GlobalBatchLoader(text_sequences(True), GLOBAL_BATCH, 0, 1, 0), CPU
    )
    prefetcher.next_batch()
    (thread,) = set(threading.enumerate()) - before
    del prefetcher
    wait_for(lambda: not thread.is_alive())
