"""A small PNG reader for the screenshot tests (no Pillow needed): 8-bit RGB or RGBA, not interlaced,
decoded with zlib and the five row filters of the PNG specification."""
import pathlib
import struct
import zlib
from collections import Counter


def _paeth(row: bytearray, prev: bytes, bpp: int) -> None:
    for i in range(bpp):
        row[i] = (row[i] + prev[i]) & 255
    for i in range(bpp, len(row)):
        a, b, c = row[i - bpp], prev[i], prev[i - bpp]
        pa, pb, pc = abs(b - c), abs(a - c), abs(a + b - 2 * c)
        row[i] = (row[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255


def _unfilter(kind: int, row: bytearray, prev: bytes, bpp: int) -> None:
    if kind == 1:
        for i in range(bpp, len(row)):
            row[i] = (row[i] + row[i - bpp]) & 255
    elif kind == 2:
        row[:] = bytes(map(lambda x, y: (x + y) & 255, row, prev))
    elif kind == 3:
        for i in range(len(row)):
            row[i] = (row[i] + (((row[i - bpp] if i >= bpp else 0) + prev[i]) >> 1)) & 255
    elif kind == 4:
        _paeth(row, prev, bpp)


def read_png(path: str) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes)."""
    data, pos, idat = pathlib.Path(path).read_bytes(), 8, b""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", data[pos + 8:pos + 21])
        elif kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + length]
        pos += 12 + length
    assert depth == 8 and colour_type in (2, 6) and not interlace, (depth, colour_type, interlace)
    bpp = 3 if colour_type == 2 else 4
    raw, stride, rows = zlib.decompress(idat), width * bpp, []
    prev = bytes(stride)
    for y in range(height):
        start = y * (stride + 1)
        row = bytearray(raw[start + 1:start + 1 + stride])
        _unfilter(raw[start], row, prev, bpp)
        prev = bytes(row)
        rows.append(prev if bpp == 3 else bytes(b for i, b in enumerate(prev) if i % 4 != 3))
    return width, height, rows


def colour_counts(rows: list[bytes]) -> Counter:
    """How many pixels have each RGB colour (as 3 bytes)."""
    counts: Counter = Counter()
    for row in rows:
        counts.update(row[i:i + 3] for i in range(0, len(row), 3))
    return counts
