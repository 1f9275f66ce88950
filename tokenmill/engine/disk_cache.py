"""The prefix cache on disk: full KV blocks written as they are named, read back after a
restart, so an agent's long system prompt and tool list are computed once per machine,
not once per process (llama.cpp's slot save/restore, done for every prompt).

A block is one file, named by its prefix hash (block_manager.chain_hash: the tokens of it
and of every block before it, from the request's cache root, so a salted prompt is only
found under its salt):

    <dir>/<model key>/<hash>.kv     a JSON header line: the format, the model key, the
                                    parent hash and the block's tokens (checked on read,
                                    as the memory cache checks them), the layers and the
                                    bytes per slot; then each layer's K slots, V slots
                                    [block_size, Hkv, hd] in the cache's dtype

The model key is a SHA-256 over what decides the bytes: the weight files' sizes and
their first and last MiB (a fingerprint, not a read of gigabytes at every start), the KV
cache's dtype, the block size, the layer shapes and the Python version (whose tuple hash
names blocks). Writes go through a background thread (the engine thread copies the
block's bytes and goes on); the folder is bounded in bytes, least recently used blocks
evicted first. A damaged or foreign file is ignored, with one warning, and removed.

    DiskPrefixCache(folder, cache, model_key, max_bytes)
        .load(hash, parent, tokens, block_id) -> bool   fill a pool block from disk
        .store(hash, parent, tokens, block_id)          queue a named block's write
        .flush()                                        wait for the queued writes
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import sys
import threading
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

from tokenmill.engine.kv_cache import KVCache

log = logging.getLogger("tokenmill.engine")

FORMAT = "tokenmill-kv-1"
FINGERPRINT_BYTES = 1 << 20  # of each weight file, from each end
WEIGHT_SUFFIXES = (".gguf", ".safetensors")


def model_key(path: Path, cache: KVCache) -> str:
    """What a cached block's bytes depend on, hashed (see the module's docstring)."""
    digest = hashlib.sha256()
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    if path.is_file() and (split := path.name.find("-00001-of-")) > 0:
        files = sorted(path.parent.glob(path.name[:split] + "-*-of-*.gguf"))
    for f in files:
        if not f.is_file() or (path.is_dir() and f.suffix not in WEIGHT_SUFFIXES):
            continue
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(FINGERPRINT_BYTES))
            fh.seek(max(0, size - FINGERPRINT_BYTES))
            digest.update(fh.read(FINGERPRINT_BYTES))
    k = cache.k[0]
    shape = (len(cache.k), tuple(k.shape[1:]), str(k.dtype), str(cache.dtype), cache.block_size)
    digest.update(repr((shape, sys.version_info[:2])).encode())
    return digest.hexdigest()


class _Folder:
    """The blocks' folder and its writer thread: the index of the files (name -> bytes,
    least recently used first) and the queue of writes. Apart from DiskPrefixCache so that
    the thread holds no reference to the KV pool: an engine dropped is freed, its writer
    stopped (after its queued writes) by a finalizer, which also runs at exit."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.lock = threading.Lock()
        self.index: OrderedDict[str, int] = OrderedDict()
        for f in sorted(path.glob("*.kv"), key=lambda p: p.stat().st_mtime):
            self.index[f.name] = f.stat().st_size
        self.stored_blocks = 0
        self.writes: queue.Queue = queue.Queue()
        threading.Thread(target=self.write_loop, name="tokenmill-kv-disk", daemon=True).start()

    def stop(self) -> None:
        self.writes.join()
        self.writes.put(None)

    def write_loop(self) -> None:
        while (item := self.writes.get()) is not None:
            name, data = item
            try:
                tmp = self.path / f".{name}.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, self.path / name)
                with self.lock:
                    self.index[name] = len(data)
                    self.stored_blocks += 1
                self.evict()
            except OSError as e:
                log.warning("prefix cache on disk: cannot write %s (%s)", name, e)
                with self.lock:
                    self.index.pop(name, None)
            finally:
                self.writes.task_done()

    def evict(self) -> None:
        """Remove least recently used blocks until the folder is within max_bytes."""
        while True:
            with self.lock:
                if sum(self.index.values()) <= self.max_bytes or len(self.index) <= 1:
                    return
                name, _ = self.index.popitem(last=False)
            (self.path / name).unlink(missing_ok=True)


class DiskPrefixCache:
    def __init__(self, folder: str | Path, cache: KVCache, key: str, max_bytes: int):
        self.folder = Path(folder) / key[:32]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cache, self.key, self.max_bytes = cache, key, max_bytes
        self.block_size = cache.block_size
        self.hit_blocks = 0  # blocks read back from disk
        self._warned = False
        self._f = _Folder(self.folder, max_bytes)
        weakref.finalize(self, self._f.stop)

    @property
    def nbytes(self) -> int:
        with self._f.lock:
            return sum(self._f.index.values())

    @property
    def num_blocks(self) -> int:
        with self._f.lock:
            return len(self._f.index)

    @property
    def stored_blocks(self) -> int:
        return self._f.stored_blocks

    # ---- read ----
    def has(self, h: int) -> bool:
        """Whether a block named h is on disk (its write done)."""
        with self._f.lock:
            return bool(self._f.index.get(_name(h)))

    def load(self, h: int, parent: int | None, tokens: tuple[int, ...], block_id: int) -> bool:
        """Fill pool block `block_id` with the block named `h` from disk; False when there
        is none (or it is damaged, foreign, or not these tokens after this parent)."""
        name = _name(h)
        if not self.has(h):  # none, or its write still queued
            return False
        path = self.folder / name
        try:
            data = bytearray(path.read_bytes())  # writable: torch.frombuffer shares it
            header, payload = self._parse(data)
        except (OSError, ValueError) as e:
            self._drop(name, f"{path}: {e}")
            return False
        if header["parent"] != parent or tuple(header["tokens"]) != tokens:
            return False  # another prefix under the same 64-bit name: a miss, not damage
        start, end = block_id * self.block_size, (block_id + 1) * self.block_size
        at = 0
        for pool in (*self.cache.k, *self.cache.v):
            dst = pool[start:end]
            raw = dst.view(torch.uint8) if dst.dtype != torch.uint8 else dst
            n = raw.numel()
            src = torch.frombuffer(payload, dtype=torch.uint8, count=n, offset=at)
            raw.copy_(src.view(raw.shape))
            at += n
        with self._f.lock:
            if name in self._f.index:
                self._f.index.move_to_end(name)
        try:
            os.utime(path)  # the time orders eviction after a restart
        except OSError:
            pass
        self.hit_blocks += 1
        return True

    def _parse(self, data: bytearray) -> tuple[dict, memoryview]:
        end = data.index(b"\n")
        header = json.loads(data[:end])
        if header.get("format") != FORMAT or header.get("model") != self.key:
            raise ValueError("not a block of this model's cache")
        payload = memoryview(data)[end + 1 :]
        pools = (*self.cache.k, *self.cache.v)
        expected = sum(p[: self.block_size].numel() * p.element_size() for p in pools)
        if len(payload) != expected or len(header.get("tokens", ())) != self.block_size:
            raise ValueError(f"{len(payload)} bytes of K/V where {expected} belong")
        return header, payload

    def _drop(self, name: str, why: str) -> None:
        if not self._warned:
            log.warning("prefix cache on disk: ignoring a damaged or foreign block (%s)", why)
            self._warned = True
        with self._f.lock:
            self._f.index.pop(name, None)
        (self.folder / name).unlink(missing_ok=True)

    # ---- write ----
    def store(self, h: int, parent: int | None, tokens: tuple[int, ...], block_id: int) -> None:
        """Queue the write of a just-named pool block (its bytes copied now: the pool block
        may be reused before the write runs)."""
        name = _name(h)
        with self._f.lock:
            if name in self._f.index:
                self._f.index.move_to_end(name)
                return
            self._f.index[name] = 0  # claimed: written once
        start, end = block_id * self.block_size, (block_id + 1) * self.block_size
        parts = []
        for pool in (*self.cache.k, *self.cache.v):
            block = pool[start:end]
            raw = block.view(torch.uint8) if block.dtype != torch.uint8 else block
            parts.append(raw.contiguous().numpy().tobytes())
        header = {"format": FORMAT, "model": self.key, "parent": parent, "tokens": list(tokens)}
        self._f.writes.put((name, json.dumps(header).encode() + b"\n" + b"".join(parts)))

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._f.writes.join()


def _name(h: int) -> str:
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}.kv"
