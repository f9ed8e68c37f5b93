"""A PNG encoder for screens that change a little between frames: only changed bands are compressed.

The image is cut into horizontal bands of `band_rows` rows. Each band is deflated
on its own (no filter, zlib level 1) and ends with a full flush, which byte-aligns
the stream and drops the history, so compressed bands can be concatenated into
one valid zlib stream. A band whose pixels did not change since the previous frame
reuses its compressed bytes; the Adler-32 checksum of the whole stream is combined
from the per-band checksums. A click changes a few bands, so a screenshot after an
action costs about one band-compress per changed band instead of the whole frame
(Pillow's own encoder spends most of its time choosing row filters).
"""

from __future__ import annotations

import struct
import zlib

from PIL import Image

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_ADLER_BASE = 65521
_FINAL_EMPTY_BLOCK = b"\x03\x00"  # a final, empty, fixed-Huffman deflate block
_ZLIB_HEADER = b"\x78\x01"  # deflate, 32 KiB window, fastest-compression hint


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def adler32_combine(adler1: int, adler2: int, len2: int) -> int:
    """The Adler-32 of A+B from adler(A), adler(B) and len(B) (zlib's adler32_combine)."""
    rem = len2 % _ADLER_BASE
    sum1 = adler1 & 0xFFFF
    sum2 = (rem * sum1) % _ADLER_BASE
    sum1 += (adler2 & 0xFFFF) + _ADLER_BASE - 1
    sum2 += (adler1 >> 16) + (adler2 >> 16) + _ADLER_BASE - rem
    sum1 %= _ADLER_BASE
    sum2 %= _ADLER_BASE
    return (sum2 << 16) | sum1


class BandPngEncoder:
    """Encodes successive RGB frames of one size; reuses the compressed bands that did not change.

    Not thread-safe: one encoder per screen, used by one caller at a time.
    """

    def __init__(self, band_rows: int = 16, level: int = 1):
        if band_rows < 1:
            raise ValueError("band_rows must be at least 1")
        self.band_rows = band_rows
        self.level = level
        self._size: tuple[int, int] | None = None
        # per band: (raw pixels, compressed bytes, adler32 of the filtered bytes, filtered length)
        self._bands: list[tuple[bytes, bytes, int, int]] = []
        self.bands_compressed = 0  # how many band compressions the last frame needed

    def encode(self, image: Image.Image) -> bytes:
        if image.mode != "RGB":
            image = image.convert("RGB")
        width, height = image.size
        if self._size != (width, height):
            self._size = (width, height)
            self._bands = []
        stride = width * 3
        raw = image.tobytes()
        n_bands = (height + self.band_rows - 1) // self.band_rows
        bands = self._bands
        compressed = 0
        for b in range(n_bands):
            y0 = b * self.band_rows
            y1 = min(height, y0 + self.band_rows)
            pixels = raw[y0 * stride : y1 * stride]
            if b < len(bands) and bands[b][0] == pixels:
                continue
            filtered = bytearray((y1 - y0) * (stride + 1))  # filter byte 0 ("None") per row
            for r in range(y1 - y0):
                o = r * (stride + 1) + 1
                filtered[o : o + stride] = pixels[r * stride : (r + 1) * stride]
            comp = zlib.compressobj(self.level, zlib.DEFLATED, -15)
            data = comp.compress(filtered) + comp.flush(zlib.Z_FULL_FLUSH)
            entry = (pixels, data, zlib.adler32(filtered), len(filtered))
            if b < len(bands):
                bands[b] = entry
            else:
                bands.append(entry)
            compressed += 1
        self.bands_compressed = compressed
        adler = 1
        for _, _, band_adler, band_len in bands:
            adler = adler32_combine(adler, band_adler, band_len)
        idat = b"".join(
            [
                _ZLIB_HEADER,
                *(band[1] for band in bands),
                _FINAL_EMPTY_BLOCK,
                struct.pack(">I", adler),
            ]
        )
        ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return b"".join(
            [_SIGNATURE, _chunk(b"IHDR", ihdr), _chunk(b"IDAT", idat), _chunk(b"IEND", b"")]
        )
