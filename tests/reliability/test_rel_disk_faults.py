"""Disk faults: ENOSPC and EIO during a save give StoreUnavailable naming the errno, the previous version
still loads, a failed fsync is never retried on the same file (its temp file is removed), and a real full
tmpfs behaves the same where this machine lets us mount one."""

from __future__ import annotations

import errno
import os
import subprocess
from collections import Counter

import pytest

import kda_sessions as ks
from kda_sessions.storage.backends import disk, disk_files

ENGINE = {"model": "tiny-random", "page_size": 16, "ram_tier_bytes": 0}


def _path(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.mark.parametrize(
    "call, code, where",
    [("fsync", errno.EIO, "manifests"), ("fsync", errno.EIO, "blobs"), ("write", errno.ENOSPC, "blobs"),
     ("write", errno.ENOSPC, "manifests")],
    ids=["eio-fsync-manifest", "eio-fsync-blob", "enospc-write-blob", "enospc-write-manifest"],
)
async def test_injected_io_error_fails_the_save_and_keeps_the_previous_version(
    tmp_path, monkeypatch, call, code, where
):
    root = tmp_path / "store"
    async with await ks.Engine.open(store=f"disk:{root}", **ENGINE) as eng:
        s = await eng.create_session()
        await s.append(list(range(40, 120)))
        await s.save()
        want = (await s.generate(max_tokens=4, ignore_eos=True)).token_ids
        await s.append(list(range(120, 200)))  # new pages and a new manifest to write
        real = getattr(os, call)
        calls: Counter[str] = Counter()

        def failing(fd: int, *args: object) -> object:
            path = _path(fd)
            if disk.TMP_PREFIX in path and f"/{where}/" in path:
                calls[path] += 1
                raise OSError(code, os.strerror(code))
            return real(fd, *args)

        monkeypatch.setattr(disk.os, call, failing)
        real_syncfs = disk_files.syncfs
        if call == "fsync" and disk_files.LIBC_SYNCFS is not None:
            # batched blob writes flush with one syncfs(2) instead of an fsync per file: fail that the same way

            def failing_syncfs(fd: int) -> None:
                path = _path(fd)
                if disk.TMP_PREFIX in path and f"/{where}/" in path:
                    calls[path] += 1
                    raise OSError(code, os.strerror(code))
                real_syncfs(fd)

            monkeypatch.setattr(disk_files, "syncfs", failing_syncfs)
        with pytest.raises(ks.StoreUnavailable, match=errno.errorcode[code]):
            await s.save()
        monkeypatch.setattr(disk.os, call, real)
        monkeypatch.setattr(disk_files, "syncfs", real_syncfs)
        assert calls and set(calls.values()) == {1}  # each failing file was tried once, then abandoned
        assert list(root.rglob(disk.TMP_PREFIX + "*")) == []
    async with await ks.Engine.open(store=f"disk:{root}", **ENGINE) as eng:
        s = await eng.resume(s.id)
        assert s.state.generation == 1
        assert (await s.generate(max_tokens=4, ignore_eos=True)).token_ids == want


async def test_real_full_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        async with await ks.Engine.open(store=f"disk:{mnt}", **ENGINE) as eng:
            s = await eng.create_session()
            await s.append(list(range(40, 60)))
            await s.save()
            want = (await s.generate(max_tokens=4, ignore_eos=True)).token_ids
            with pytest.raises(ks.StoreUnavailable, match="ENOSPC"):
                for i in range(40):  # ~20 KiB per page: the 1 MiB fs fills within a few saves
                    await s.append(list(range(60 + i, 100 + i)))
                    await s.save()
            assert list(mnt.rglob(disk.TMP_PREFIX + "*")) == []
        async with await ks.Engine.open(store=f"disk:{mnt}", **ENGINE) as eng:
            s2 = await eng.resume(s.id)
            if s2.state.generation == 1:
                assert (await s2.generate(max_tokens=4, ignore_eos=True)).token_ids == want
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
