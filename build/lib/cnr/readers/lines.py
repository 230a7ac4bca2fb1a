"""Byte-positioned line reading over a list of files read as one concatenated stream."""

from __future__ import annotations

from typing import BinaryIO, Optional, Sequence, Tuple

CHUNK = 1 << 20  # 1 MiB reads: few syscalls, little memory per open file
Position = Tuple[int, int]  # (file index, byte offset); (len(paths), 0) is the end of the data


class LineSource:
    """Sequential lines of the concatenated files, each with the (file, byte offset) it starts at.

    The position is kept normalised: it is always the start of an unread line, or
    ``(num_files, 0)`` at the end, so equal stream positions give equal cursors.
    Only one file is open at a time, opened on first use.
    """

    def __init__(self, paths: Sequence[str], sizes: Sequence[int]) -> None:
        self._paths = paths
        self._sizes = sizes
        self._f: Optional[BinaryIO] = None
        self._buf = b""
        self._pos = 0  # index of the next unread byte in _buf
        self._buf_start = 0  # file offset of _buf[0]
        self._file = 0
        self.seek(0, 0)

    @property
    def position(self) -> Position:
        """(file index, byte offset) of the next unread line."""
        return self._file, self._buf_start + self._pos

    def seek(self, file: int, offset: int) -> None:
        """Continue at byte ``offset`` of file ``file``, which must be a line start."""
        self.close()
        self._file, self._buf, self._pos, self._buf_start = file, b"", 0, offset
        self._normalise()

    def _normalise(self) -> None:
        # Move past exhausted (or empty) files so the position names the next line's start.
        while self._file < len(self._sizes) and self._buf_start + self._pos >= self._sizes[
                self._file]:
            self.close()
            self._file, self._buf, self._pos, self._buf_start = self._file + 1, b"", 0, 0

    def next_line(self) -> Optional[Tuple[bytes, int, int]]:
        """``(line without '\\n' or '\\r\\n', file index, byte offset)``; None at the end."""
        while self._file < len(self._sizes):
            if self._f is None:
                self._f = open(self._paths[self._file], "rb", buffering=0)
                self._f.seek(self._buf_start)
            nl = self._buf.find(b"\n", self._pos)
            if nl < 0:
                chunk = self._f.read(CHUNK)
                if chunk:
                    self._buf_start += self._pos
                    self._buf, self._pos = self._buf[self._pos:] + chunk, 0
                    continue
                nl = len(self._buf)  # last line without a trailing newline
                if nl == self._pos:  # file shorter than its recorded size: treat as ended
                    self._buf_start, self._pos, self._buf = self._sizes[self._file], 0, b""
                    self._normalise()
                    continue
            line = self._buf[self._pos:nl]
            where = (self._file, self._buf_start + self._pos)
            self._pos = nl + 1
            self._normalise()
            return (line[:-1] if line.endswith(b"\r") else line), where[0], where[1]
        return None

    def close(self) -> None:
        """Close the open file; the next read reopens it at the current position."""
        if self._f is not None:
            self._f.close()
            self._f = None


def line_number(path: str, offset: int) -> int:
    """1-based number of the line starting at byte ``offset``; counted only when reporting."""
    count = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                break
            count += chunk.count(b"\n")
            left -= len(chunk)
    return count + 1
