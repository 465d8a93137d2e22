"""Asynchronous save: planning and the copy to host memory block the step, the disk write does not.

    saver = AsyncSaver()                          # every rank; makes its own gloo group
    saver.save(path, net, opt, step=k)            # returns once the boxes are copied
    ...next steps run while a thread writes and publishes...
    saver.wait()                                  # before the next save, and at the end

The thread gathers the CRCs and barriers on a process group of its own, so its collectives
never interleave with the training step's on the mesh's groups (torch DCP's ``async_save``
does the same). The publish is the synchronous one: ``path`` appears only when complete.
The blocking part (``store.prepare``) plans on every save: the boxes are listed, gathered
and assigned writers, a collective (DCP can cache its plans: ``enable_plan_caching``). The
write pays only where it runs on what the step leaves idle (a spare core; on a GPU node the
host's cores and the copy engine); on cores the step uses, the writer slows the step down.
"""
from __future__ import annotations

import threading

import torch.distributed as dist

from course_lib.checkpoint.store import _world, prepare, write_and_publish


class AsyncSaver:
    """One background save at a time; ``save`` waits for the previous one first."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo") if _world()[1] > 1 else None
        self._thread, self._error, self.bytes_written = None, None, 0

    def save(self, path, model, optimizer=None, **extra):
        """``save``'s arguments; returns after the snapshot (the blocking part)."""
        self.wait()
        job = prepare(path, model, optimizer, copy=True, **extra)
        self._thread = threading.Thread(target=self._write, args=(job,), daemon=True)
        self._thread.start()

    def _write(self, job):
        try:
            self.bytes_written = write_and_publish(job, self.group)
        except BaseException as e:            # re-raised in the training thread by wait()
            self._error = e

    def wait(self) -> int:
        """Block until the running save is published; its error, if any, is raised here.
        Returns the bytes this rank wrote."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.bytes_written


__all__ = ["AsyncSaver"]
