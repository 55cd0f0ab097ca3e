"""The one image decoder (`hype.data.imageprep.open_image`) and the tar readers' limits, on each path
that uses them (scoring, training, evaluation, reshard): images with more than 8 bits per sample, a pixel
cap checked before decoding and a member-size cap checked before reading, with memory measured in a child
process."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hype.data import imageprep
from hype.data.imageprep import IMAGE_TOO_LARGE, ImageError, Preprocess, decode_rgb
from hype.data.samples import RawSample, SkipStats, decode_image, decode_pair
from hype.data.uids import save_subset
from hype.eval import readers
from hype.io.tar import (
    MAX_MEMBER_BYTES,
    MEMBER_TOO_LARGE,
    UNREADABLE_SHARD,
    index_samples,
    read_samples,
    ustar_header,
)
from hype.reshard import reshard
from hype.scoring.decode import Decoded, DecodeSpec, Skipped

UID = "8f14e45fceea167a5a36dedd4bea2543"
SQUASH = Preprocess(32, "squash", "bilinear", (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
RAMP = np.linspace(0.0, 1.0, 48 * 64).reshape(48, 64)  # black to white: 8-bit mean 127.5


def _wide(mode: str) -> bytes:
    """A black-to-white ramp stored with more than 8 bits per sample, as Pillow opens it in `mode`."""
    if mode == "F":
        img, fmt = Image.fromarray(RAMP.astype(np.float32), "F"), "TIFF"
    elif mode == "I":
        img, fmt = Image.fromarray((RAMP * 65535).astype(np.int32), "I"), "TIFF"
    elif mode == "I;16B":
        img, fmt = Image.frombytes("I;16B", (64, 48), (RAMP * 65535).astype(">u2").tobytes()), "TIFF"
    else:
        img, fmt = Image.fromarray((RAMP * 65535).astype(np.uint16)), "PNG"
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _sample(image: bytes) -> RawSample:
    # Stored as .png whatever the format, as web data often is: every reader probes the content.
    files = {"png": image, "txt": b"a ramp", "json": json.dumps({"uid": UID}).encode()}
    return RawSample("0001", "pool.tar", files)


@pytest.mark.parametrize("mode", ["I;16", "I;16B", "I", "F"])
def test_images_wider_than_8_bits_are_scaled_not_clipped_on_every_path(mode):
    data = _wide(mode)
    assert Image.open(io.BytesIO(data)).mode == mode  # the case under test (Pillow 13)
    training = np.asarray(decode_pair(_sample(data), SkipStats())[0])
    scoring = DecodeSpec(preps=(SQUASH,), draft=True, labelled=False)(_sample(data))
    assert isinstance(scoring, Decoded)
    evaluation = SQUASH.pixels(readers.decode_image(data, "png"))
    # Pillow's convert() clips 16-bit values at 255 (a white image) and floats of 0..1 to 0 or 1 (black).
    for pixels in (training, scoring.pixels[SQUASH.geometry], evaluation):
        assert pixels.dtype == np.uint8 and abs(pixels.mean() - 127.5) < 2
    # Exactly the 16-bit high byte (float: the nearest 8-bit value), the ramp's ends black and white.
    expected = np.round(RAMP * 255) if mode == "F" else (RAMP * 65535).astype(np.int64) >> 8
    assert np.abs(training[..., 0].astype(int) - expected).max() <= 1
    assert training[0, 0, 0] == 0 and training[-1, -1, 0] == 255


def _png_header_of(width: int, height: int) -> bytes:
    """A valid 8-bit grayscale PNG of width x height black pixels, compressed row by row (the test never
    holds the pixels): a few hundred KB that decode to width * height bytes and more."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    z = zlib.compressobj(9)
    row = b"\0" * (width + 1)  # filter byte + pixels
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


_PEAK = """
import resource, sys
from hype.data.imageprep import ImageError, decode_rgb
from hype.data.samples import SkipStats
from hype.io.tar import read_samples
what, path = sys.argv[1:]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if what == "image":
    try:
        decode_rgb(open(path, "rb").read())
        print("decoded")
    except ImageError as e:
        print(e.reason)
else:
    stats = SkipStats()
    print(",".join(key for key, _ in read_samples(path, stats)), stats.counts)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def _peak(what: str, path: Path) -> tuple[str, int]:
    """What a fresh process got from `path`, and how many MiB its peak RSS grew while getting it."""
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, what, str(path)], capture_output=True, text=True, cwd=root, check=True
    ).stdout.splitlines()
    return out[0], int(out[1])


def test_an_image_over_the_pixel_cap_is_refused_before_decoding(tmp_path):
    bomb = _png_header_of(12000, 12000)  # 144 megapixels: under Pillow's own error limit (179 M)
    with pytest.warns(Image.DecompressionBombWarning):  # Pillow only warns at this size
        assert len(bomb) < 600_000 and Image.open(io.BytesIO(bomb)).size == (12000, 12000)
    (tmp_path / "bomb.png").write_bytes(bomb)
    got, grew_mib = _peak("image", tmp_path / "bomb.png")
    assert got == IMAGE_TOO_LARGE and grew_mib < 40  # decoding it took ~1.1 GB
    # Every path counts it with the reason.
    stats = SkipStats()
    assert decode_pair(_sample(bomb), stats) is None and stats.counts == {IMAGE_TOO_LARGE: 1}
    scored = DecodeSpec(preps=(SQUASH,), draft=True, labelled=False)(_sample(bomb))
    assert (
        isinstance(scored, Skipped) and scored.reason == IMAGE_TOO_LARGE and "12000x12000" in scored.message
    )
    for decode in (decode_image, lambda d: readers.decode_image(d, "png")):
        with pytest.raises(ImageError, match="MAX_PIXELS") as e:
            decode(bomb)
        assert e.value.reason == IMAGE_TOO_LARGE


def test_a_big_jpeg_is_capped_at_the_scale_it_is_decoded_at(monkeypatch):
    buf = io.BytesIO()
    Image.new("RGB", (400, 400), (10, 200, 30)).save(buf, "JPEG")
    monkeypatch.setattr(imageprep, "MAX_PIXELS", 100 * 100)
    with pytest.raises(ImageError, match="400x400"):
        decode_rgb(buf.getvalue())
    img, size = decode_rgb(buf.getvalue(), draft_size=50)  # scoring: decoded at 1/4 scale, 100 x 100
    assert size == (400, 400) and img.size == (100, 100)


def _tar_with_a_huge_member(path: Path, size: int, header: bytes | None = None) -> Path:
    """Samples 0, 1, 2; sample 1's .jpg claims `size` bytes, stored sparse (no disk, no memory), or with
    `header` (a type flag: PAX `x`, GNU long name `L`) is an ordinary member behind an extended header of
    `size` bytes (a valid record, sparse too)."""
    jpg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpg, "JPEG")
    with open(path, "wb") as f:
        for key in ("0", "1", "2"):
            uid = f"{int(key) + 1:032x}"
            for ext, data in (("jpg", jpg.getvalue()), ("json", json.dumps({"uid": uid}).encode())):
                n = size if (key, ext) == ("1", "jpg") and header is None else len(data)
                if (key, ext) == ("1", "jpg") and header is not None:
                    f.write(ustar_header("././@LongLink", size, header))
                    start = f.tell()
                    f.write(b"%d comment=" % size if header == b"x" else b"1.jpg")
                    f.seek(start + size - 1)
                    f.write(b"\n" + b"\0" * (-size % 512))
                f.write(ustar_header(f"{key}.{ext}", n))
                if n == len(data):
                    f.write(data + b"\0" * (-n % 512))
                else:
                    f.seek(n + (-n % 512), io.SEEK_CUR)
        f.write(b"\0" * 1024)
    return path


def test_a_member_over_the_size_cap_is_skipped_unread(tmp_path):
    huge = 300 * 2**20
    assert huge > MAX_MEMBER_BYTES
    tar = _tar_with_a_huge_member(tmp_path / "00000000.tar", huge)
    # Streamed (scoring, training, evaluation): the other samples come through, memory does not grow.
    got, grew_mib = _peak("tar", tar)
    assert got == f"0,2 {{'{MEMBER_TOO_LARGE}': 1}}" and grew_mib < 40  # reading it took 300+ MiB
    # Indexed (reshard): the sample is left out and counted; the others are resharded.
    stats = SkipStats()
    assert [k for k, _ in index_samples(tar, stats)] == ["0", "2"] and stats.counts == {MEMBER_TOO_LARGE: 1}
    assert (
        "1.jpg (314572800 bytes, over the 33554432-byte member limit" in stats.examples[MEMBER_TOO_LARGE][0]
    )
    save_subset(tmp_path / "s.npy", [f"{i:032x}" for i in (1, 2, 3)])
    meta = reshard(tar, tmp_path / "s.npy", tmp_path / "out", workers=1, progress=False)
    assert meta["output_samples"] == 2 and meta["skipped"]["counts"] == {MEMBER_TOO_LARGE: 1}
    # Evaluation counts it as a skipped sample, not as a damaged tar.
    stats = readers.ReadStats()
    for batch in readers.WdsBatches([tar], SQUASH, readers.WdsSpec(label=False), 8):
        stats.merge(batch["stats"])
    assert (stats.num_samples, stats.num_skipped, stats.num_read_errors) == (2, 1, 0)


@pytest.mark.parametrize("header", [b"x", b"L"])
def test_an_extended_header_over_its_cap_is_skipped_unread(tmp_path, header):
    """A 300 MiB PAX record (or GNU long name) before a small member: tarfile would read it whole before
    the member cap sees anything. Its sample is a counted skip and memory does not grow."""
    tar = _tar_with_a_huge_member(tmp_path / "00000000.tar", 300 * 2**20, header)
    got, grew_mib = _peak("tar", tar)
    assert got == f"0,2 {{'{MEMBER_TOO_LARGE}': 1}}" and grew_mib < 40  # reading it took 300+ MiB
    stats = SkipStats()
    assert [k for k, _ in index_samples(tar, stats)] == ["0", "2"] and stats.counts == {MEMBER_TOO_LARGE: 1}
    assert (
        "1.jpg (extended headers of 314572800 bytes, over the 1048576-byte limit"
        in stats.examples[MEMBER_TOO_LARGE][0]
    )


def _pax(*records: str) -> bytes:
    """PAX records (`key=value`), each prefixed with its own length as the format wants."""
    out = b""
    for r in records:
        body = f" {r}\n".encode()
        n = len(body) + len(str(len(body)))
        n += len(str(n)) - len(str(len(body)))
        out += str(n).encode() + body
    return out


@pytest.mark.parametrize("case", ["nine headers", "sparse"])
def test_headers_tarfile_would_read_unbounded_end_the_shard_with_a_count(tmp_path, case):
    """Each extended header is one more level of tarfile's recursion: nine in a row make the shard
    unreadable (counted), after the samples before them; so does a sparse member, whose map tarfile
    reads whole (PAX 1.0 keeps it in the member's data, with no bound)."""
    if case == "sparse":
        record = _pax(
            "GNU.sparse.major=1", "GNU.sparse.minor=0", "GNU.sparse.name=1.txt", "GNU.sparse.realsize=1"
        )
        headers = [record]
        expected = "a sparse member at byte 1024: not a webdataset shard"
    else:
        headers = [_pax("comment=" + "x" * 18)] * 9
        expected = "more than 8 extended headers in a row"
    with open(tmp_path / "t.tar", "wb") as f:
        f.write(ustar_header("0.txt", 1) + b"a".ljust(512, b"\0"))
        for record in headers:
            f.write(ustar_header("PaxHeader", len(record), b"x") + record.ljust(512, b"\0"))
        f.write(ustar_header("1.txt", 6) + b"1\n0\n1\nb".ljust(512, b"\0") + b"\0" * 1024)
    stats = SkipStats()
    assert [k for k, _ in read_samples(tmp_path / "t.tar", stats)] == ["0"]
    assert stats.counts == {UNREADABLE_SHARD: 1} and expected in stats.examples[UNREADABLE_SHARD][0]
