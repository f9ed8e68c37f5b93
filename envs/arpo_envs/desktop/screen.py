"""Screenshots: an mss grab of the X screen with the pointer, PNG at compress level 1.

Xvfb's framebuffer has no pointer in it; like OSWorld's server, which pastes the
cursor image in, mss draws the current cursor image (XFixes) at its position. The PNG
is written by the band encoder the simulated desktop uses too (`arpo_envs.png`: no row
filters, zlib level 1, and only the bands that changed since the last screenshot are
compressed again): Pillow's encoder spends most of its time choosing row filters (~4x
slower on a Calc screen). mss and python-xlib connections are not thread-safe, so every
grab runs on one worker thread that owns both; `reconnect()` drops them after the X
server restarted.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from PIL import Image

from arpo_envs.png import BandPngEncoder


class Screen:
    """Grabs and encodes screenshots of one display on a dedicated thread."""

    def __init__(self, display_name: str, draw_cursor: bool = True, compress_level: int = 1):
        self.display_name = display_name
        self.draw_cursor = draw_cursor
        self.compress_level = compress_level
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="screenshot")
        self._sct = None
        self._encoder = BandPngEncoder(band_rows=16, level=compress_level)
        self._xd = None

    def _connect(self):
        if self._sct is None:
            import mss
            from Xlib.display import Display

            self._sct = mss.MSS(display=self.display_name, with_cursor=self.draw_cursor)
            self._xd = Display(self.display_name)
        return self._sct, self._xd

    def _drop(self) -> None:
        for obj in (self._sct, self._xd):
            try:
                if obj is not None:
                    obj.close()
            except Exception:
                pass
        self._sct = self._xd = None

    def _grab_png(self) -> bytes:
        try:
            sct, _ = self._connect()
            shot = sct.grab(sct.monitors[0])
        except Exception:
            self._drop()  # a restarted X server: connect anew once
            sct, _ = self._connect()
            shot = sct.grab(sct.monitors[0])
        img = Image.frombuffer("RGB", shot.size, shot.bgra, "raw", "BGRX", 0, 1)
        return self._encoder.encode(img)

    def _pointer(self) -> tuple[int, int]:
        try:
            _, xd = self._connect()
            p = xd.screen().root.query_pointer()
        except Exception:
            self._drop()  # a restarted X server
            _, xd = self._connect()
            p = xd.screen().root.query_pointer()
        return p.root_x, p.root_y

    async def png(self) -> bytes:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._grab_png)

    async def pointer(self) -> tuple[int, int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._pointer)

    async def reconnect(self, display_name: str) -> None:
        def _do() -> None:
            self._drop()
            self.display_name = display_name

        await asyncio.get_running_loop().run_in_executor(self._pool, _do)

    def close(self) -> None:
        self._pool.submit(self._drop).result()
        self._pool.shutdown(wait=True)
