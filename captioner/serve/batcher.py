"""Batching concurrent caption requests onto one model thread.

Requests arrive on the server's event loop and threads; the model runs on one worker thread only,
never concurrently with itself (PyTorch already spreads one batch over the CPU's cores); decoding
and preprocessing the uploads happens on the request threads, in parallel with it. The worker
takes the first waiting request, then collects more until it holds `max_batch` or `max_delay_ms` has
passed since the first, and captions them in one batch (one per set of decode options). Under load
requests queue up while a batch runs, so the next batch forms at once: throughput grows with the
number of clients, while a lone request waits at most `max_delay_ms`.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field

import PIL.Image
import torch

from captioner.decoding.captioner import Caption, Captioner
from captioner.errors import CaptionerError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Options:
    """Decode options of one request; requests with equal options share a batch."""

    beam_size: int
    max_length: int
    alternatives: int = 0
    text: str | None = None  # a caption to score (teacher-forced) instead of the search


@dataclass
class _Job:
    pixels: torch.Tensor  # (3, S, S), `Captioner.preprocess`
    image_size: tuple[int, int]  # (w, h) of the original
    options: Options
    future: Future = field(default_factory=Future)


@dataclass
class BatchStats:
    """What the worker has done: batches run, images captioned, the largest batch."""

    batches: int = 0
    images: int = 0
    largest: int = 0


class Batcher:
    """Runs `captioner` on one worker thread, batching the requests that wait.

    Use as a context manager (or call `close`), and `await batcher.caption(image, options)` from
    async code (`submit` returns a concurrent Future for threads).
    """

    def __init__(self, captioner: Captioner, max_batch: int = 16, max_delay_ms: float = 5.0) -> None:
        if max_batch < 1 or not 0 <= max_delay_ms / 1000.0 <= threading.TIMEOUT_MAX:  # nan and inf neither
            raise ValueError(f"max_batch {max_batch} (>= 1), max_delay_ms {max_delay_ms} (>= 0, a finite wait)")
        self.captioner = captioner
        self.max_batch = max_batch
        self.max_delay = max_delay_ms / 1000.0
        self.stats = BatchStats()
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="captioner-model", daemon=True)
        self._thread.start()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(self, image: PIL.Image.Image | torch.Tensor, options: Options,
               image_size: tuple[int, int] | None = None) -> Future:
        """Queue one RGB image, or its pixels already preprocessed (`Captioner.preprocess`, then give
        the original's `image_size`); the Future gets its Caption (or the exception decoding raised)."""
        if not self._thread.is_alive():
            raise RuntimeError("the batcher is closed")
        if isinstance(image, PIL.Image.Image):
            image, image_size = self.captioner.preprocess(image), image.size
        if image_size is None:
            raise ValueError("pixels need the original image_size")
        job = _Job(image, image_size, options)
        self._queue.put(job)
        return job.future

    async def caption(self, image: PIL.Image.Image | torch.Tensor, options: Options,
                      image_size: tuple[int, int] | None = None) -> Caption:
        return await asyncio.wrap_future(self.submit(image, options, image_size))

    def close(self) -> None:
        """Finish the queued requests, then stop the worker."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _collect(self, first: _Job) -> tuple[list[_Job], bool]:
        """The first job plus whatever arrives within max_delay, up to max_batch; and whether to stop."""
        jobs, deadline = [first], time.monotonic() + self.max_delay
        while len(jobs) < self.max_batch:
            try:
                job = self._queue.get_nowait() if self.max_delay == 0 else \
                    self._queue.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
        return jobs, False

    def _work(self) -> None:
        stop = False
        while not stop:
            first = self._queue.get()
            if first is None:
                break
            jobs, stop = self._collect(first)
            groups: dict[Options, list[_Job]] = defaultdict(list)
            for job in jobs:
                if job.future.set_running_or_notify_cancel():  # a client that went away costs nothing
                    groups[job.options].append(job)
            for options, group in groups.items():
                self._run(options, group)

    def _run(self, options: Options, jobs: list[_Job]) -> None:
        forced = {} if options.text is None else {"text": options.text}
        try:
            captions = self.captioner.caption_pixels([j.pixels for j in jobs], [j.image_size for j in jobs],
                                                     alternatives=options.alternatives, beam_size=options.beam_size,
                                                     max_length=options.max_length, **forced)
        except Exception as e:  # the requests fail, the server goes on
            if not isinstance(e, CaptionerError):  # the client's mistake (words the model lacks) is no failure
                log.exception("captioning a batch of %d failed", len(jobs))
            for job in jobs:
                job.future.set_exception(e)
            return
        self.stats.batches += 1
        self.stats.images += len(jobs)
        self.stats.largest = max(self.stats.largest, len(jobs))
        for job, caption in zip(jobs, captions):
            job.future.set_result(caption)
