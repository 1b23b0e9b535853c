#!/usr/bin/python3
"""Writes the image-preprocessing oracle corpus with Debian's Pillow and numpy.

Usage: oracle.py OUTDIR. For each case OUTDIR/NAME.img holds the encoded image,
NAME.rgb the 8-bit RGB after the resize plan, Pillow BICUBIC and the alpha
chessboard (VISION.md section 1, steps 2-4), NAME.f32 the padded, normalised,
patchified float32 [gh*gw, 3*p*p], and MANIFEST one line per case:
`NAME CONFIG W H w h gh gw` (CONFIG: k3 = published media_proc_cfg, tiny =
VISION.md section 4's in_patch_limit 64, patch_limit_on_one_side 16).
"""
import io
import math
import os
import struct
import sys
import zlib

import numpy as np
from PIL import Image

CONFIGS = {"k3": (65536, 512), "tiny": (64, 16)}
P = 14


def plan(W, H, config):
    in_patch_limit, side = CONFIGS[config]
    L = side * P
    s = min(1.0, math.sqrt(in_patch_limit / (max(1, W // P) * max(1, H // P))), L / W, L / H)
    w = min(max(1, math.floor(W * s)), L)
    h = min(max(1, math.floor(H * s)), L)
    pw = (2 * P - w % (2 * P)) % (2 * P)
    ph = (2 * P - h % (2 * P)) % (2 * P)
    return w, h, (h + ph) // P, (w + pw) // P


def reference(data, config):
    img = Image.open(io.BytesIO(data))
    img.load()
    W, H = img.size
    w, h, gh, gw = plan(W, H, config)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BICUBIC)
    has_alpha = img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info)
    if has_alpha:
        rgba = np.asarray(img.convert("RGBA"))
        yy, xx = np.mgrid[0:h, 0:w]
        bg = np.where(((yy // 8) + (xx // 8)) % 2 == 1, 180, 255).astype(np.float32)
        a = rgba[..., 3].astype(np.float32) / np.float32(255)
        out = np.empty((h, w, 3), np.uint8)
        for c in range(3):
            v = a * rgba[..., c].astype(np.float32) + (np.float32(1) - a) * bg
            out[..., c] = v.astype(np.uint8)
        rgb = out
    else:
        rgb = np.asarray(img.convert("RGB"))
    padded = np.zeros((gh * P, gw * P, 3), np.uint8)
    padded[:h, :w] = rgb
    x = padded.astype(np.float32) / np.float32(255)
    x = (x - np.float32(0.5)) / np.float32(0.5)
    patches = x.reshape(gh, P, gw, P, 3).transpose(0, 2, 4, 1, 3).reshape(gh * gw, 3 * P * P)
    return (W, H, w, h, gh, gw), rgb, patches.astype(np.float32)


def pattern(W, H, seed, channels=3):
    rng = np.random.RandomState(seed)
    yy, xx = np.mgrid[0:H, 0:W]
    base = np.stack([(xx * 255 // max(1, W - 1)), (yy * 255 // max(1, H - 1)),
                     ((xx + yy) * 7) % 256] + [((xx * yy) % 256)] * (channels - 3), -1)
    noise = rng.randint(-40, 41, size=base.shape)
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def save(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def png16(arr, color_type):
    """A 16-bit PNG (RGB: colour type 2, grey: 0) written by hand."""
    H, W = arr.shape[:2]
    raw = b"".join(b"\0" + arr[y].astype(">u2").tobytes() for y in range(H))
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    ihdr = struct.pack(">IIBBBBB", W, H, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def cases():
    rgb = lambda W, H, s: Image.fromarray(pattern(W, H, s))
    yield "png_rgb_noresize", "tiny", save(rgb(100, 30, 1), "PNG")
    yield "png_rgb_sqrt", "tiny", save(rgb(300, 200, 2), "PNG")
    yield "png_rgb_side", "tiny", save(rgb(28, 500, 3), "PNG")
    yield "png_rgb_min1", "tiny", save(rgb(2000, 3, 4), "PNG")
    yield "png_rgb_square", "tiny", save(rgb(112, 112, 5), "PNG")
    rgba = pattern(300, 200, 6, channels=4)
    rgba[:60, :, 3] = 0      # fully transparent band
    rgba[60:90, :, 3] = 255  # opaque band; the rest keeps partial alpha
    yield "png_rgba", "tiny", save(Image.fromarray(rgba, "RGBA"), "PNG")
    la = pattern(300, 120, 7, channels=4)[..., [0, 3]]
    yield "png_la", "tiny", save(Image.fromarray(la, "LA"), "PNG")
    yield "png_grey", "tiny", save(Image.fromarray(pattern(300, 200, 8)[..., 0], "L"), "PNG")
    yield "png_bilevel", "tiny", save(Image.fromarray(pattern(300, 200, 9)[..., 0]).convert("1"), "PNG")
    pal = rgb(300, 200, 10).quantize(colors=64)
    yield "png_palette", "tiny", save(pal, "PNG")
    trns = bytes([0, 80, 160] + [255] * 61)
    yield "png_palette_trns", "tiny", save(pal, "PNG", transparency=trns)
    grey16 = (pattern(300, 200, 11)[..., 0].astype(np.uint16) * 2)  # 0..510: Pillow clips
    yield "png_grey16", "tiny", png16(grey16, 0)
    rgb16 = pattern(300, 200, 12).astype(np.uint16) * 257 + 3
    yield "png_rgb16", "tiny", png16(rgb16, 2)
    yield "jpeg_rgb", "tiny", save(rgb(300, 200, 13), "JPEG", quality=90)
    yield "jpeg_grey", "tiny", save(rgb(300, 200, 14).convert("L"), "JPEG", quality=85)
    yield "jpeg_cmyk", "tiny", save(rgb(300, 200, 15).convert("CMYK"), "JPEG", quality=90)
    yield "jpeg_progressive", "tiny", save(rgb(250, 180, 16), "JPEG", quality=80, progressive=True)
    yield "webp_lossy", "tiny", save(rgb(300, 200, 17), "WEBP", quality=80)
    yield "webp_rgba_lossless", "tiny", save(Image.fromarray(rgba, "RGBA"), "WEBP", lossless=True)
    gif = rgb(300, 200, 18).quantize(colors=32)
    yield "gif_palette", "tiny", save(gif, "GIF")
    yield "gif_transparent", "tiny", save(gif, "GIF", transparency=3)
    yield "k3_56x28", "k3", save(rgb(56, 28, 19), "PNG")
    yield "k3_8000x200", "k3", save(rgb(8000, 200, 20), "PNG")
    yield "k3_1000x900_jpeg", "k3", save(rgb(1000, 900, 21), "JPEG", quality=92)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    lines = []
    for name, config, data in cases():
        meta, rgb, patches = reference(data, config)
        with open(os.path.join(out, name + ".img"), "wb") as f:
            f.write(data)
        with open(os.path.join(out, name + ".rgb"), "wb") as f:
            f.write(np.ascontiguousarray(rgb).tobytes())
        with open(os.path.join(out, name + ".f32"), "wb") as f:
            f.write(patches.astype("<f4").tobytes())
        lines.append(" ".join([name, config] + [str(v) for v in meta]))
    with open(os.path.join(out, "MANIFEST"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
