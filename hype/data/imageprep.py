"""The one image preprocessor: a model's eval transform, split for throughput. Scoring and eval use it.

open_clip's eval transform is resize (shortest side, bicubic) -> center crop -> RGB -> to tensor ->
normalize. The geometry runs per image on PIL images and gives uint8 arrays (`Preprocess.pixels`; this
module imports only Pillow and NumPy at the top, so decode processes start in a fraction of a second); the
conversion to float and the normalization run once per batch (`Preprocess.batch`), on the model's device
when scoring (host-to-device copies stay at one byte per channel), in the loader's workers in eval. The
result is bit-identical to `model.preprocess(train=False)` on the same image (tested): the resize and
crop arithmetic below is torchvision's for PIL images, and the float steps are ToTensor's and
Normalize's, element by element.

Every image is decoded by `open_image` (a pixel cap checked before decoding, 16-bit and float images
scaled to 8 bits). The scorer converts images to RGB before resizing (`decode_rgb`), like the training
pipeline (`hype.data.samples`), so that scorer and trainer see the same pixels; eval hands images over in
their own mode and `pixels` converts after the crop, where open_clip does. Big JPEGs are decoded at a reduced
DCT scale (`draft`) that still leaves at least twice the model's input size, so the bicubic resize that
follows sees nearly the same image at a fraction of the decoding cost.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image

_PIL_INTERP = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


CORRUPT_IMAGE = "corrupt_image"
IMAGE_TOO_LARGE = "image_too_large"

# The most pixels one decode may allocate (8192 x 8192). Checked on the header, after `open()` and before
# `load()`, so a small file that expands to gigabytes (a 440 KB PNG of 12000 x 12000) costs nothing. A
# decoded image takes at most 4 bytes per pixel in Pillow (RGB is stored as 4) and the conversion to RGB or
# to 8 bits as much again: about 512 MiB per decode worker at the cap. A JPEG is checked at the reduced
# scale `draft` decodes it at, so a big photo scored at 224 px is still read.
MAX_PIXELS = 8192 * 8192

# Modes with more than 8 bits per sample (16-bit PNG and TIFF, 32-bit integer and float TIFF), and the
# value that maps to white in each: Pillow's convert() clips them at 255, which turns them white.
_WIDE_MODES = {"I;16": 65535, "I;16L": 65535, "I;16B": 65535, "I;16N": 65535, "I": 65535, "F": 1.0}


class ImageError(ValueError):
    """An image that cannot be used; `reason` is the skip reason counted in the shard's stats."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def open_image(
    data: bytes, *, formats: tuple[str, ...] | None = None, draft_size: int | None = None
) -> tuple[Image.Image, tuple[int, int]]:
    """Bytes -> (fully decoded image with 8-bit samples, in its own mode; size in the file): the one image
    decoder of scoring, training, evaluation and the report. `formats` is a hint tried first (content that
    does not match it, common in web data, is still opened by probing every format); `draft_size` lets a
    JPEG decode at a reduced scale that leaves at least twice that size. Raises `ImageError` (corrupt_image,
    image_too_large: more than `MAX_PIXELS` to decode)."""
    with warnings.catch_warnings():
        # Pillow warns on odd web images (EXIF noise, palette transparency, big images); they decode, and
        # size is checked here against MAX_PIXELS, which is below Pillow's own bomb limits.
        warnings.simplefilter("ignore")
        try:
            img = _open(data, formats)
            size = img.size
            if draft_size and img.format == "JPEG":
                img.draft("RGB", (2 * draft_size, 2 * draft_size))
            w, h = img.size  # what load() will allocate
            if w * h > MAX_PIXELS:
                raise ImageError(
                    IMAGE_TOO_LARGE,
                    f"{size[0]}x{size[1]} image: decoding {w}x{h} pixels is more than the {MAX_PIXELS} "
                    "allowed (hype.data.imageprep.MAX_PIXELS)",
                )
            img.load()
            return to_8bit(img), size
        except ImageError:
            raise
        except Image.DecompressionBombError as e:
            raise ImageError(IMAGE_TOO_LARGE, f"{e}") from None
        except Exception as e:  # Pillow raises many types (OSError, SyntaxError, ValueError, ...)
            raise ImageError(CORRUPT_IMAGE, f"{type(e).__name__}: {e}") from None


def _open(data: bytes, formats: tuple[str, ...] | None) -> Image.Image:
    if formats is not None:
        try:
            return Image.open(io.BytesIO(data), formats=formats)
        except Image.UnidentifiedImageError:
            pass  # e.g. a PNG named .jpg: probe every format
    return Image.open(io.BytesIO(data))


def to_8bit(img: Image.Image) -> Image.Image:
    """An image with more than 8 bits per sample (`_WIDE_MODES`) as 8-bit grayscale ("L"), its full range
    scaled to 0..255 (16-bit: the high byte; float: 0..1); any other image as it is."""
    white = _WIDE_MODES.get(img.mode)
    if white is None:
        return img
    values = np.asarray(img)
    if img.mode == "F":
        values = np.clip(np.nan_to_num(values), 0.0, 1.0) * 255.0 + 0.5
    else:  # 32-bit "I" holds 16-bit PNGs in older Pillows; values past 16 bits saturate
        values = np.clip(values, 0, white) >> 8
    return Image.fromarray(values.astype(np.uint8), "L")


def decode_rgb(data: bytes, draft_size: int | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """Bytes -> (fully decoded RGB image, size in the file); `open_image` then RGB. Raises `ImageError`."""
    img, size = open_image(data, draft_size=draft_size)
    try:
        return (img if img.mode == "RGB" else img.convert("RGB")), size
    except Exception as e:  # a mode Pillow cannot convert
        raise ImageError(CORRUPT_IMAGE, f"{type(e).__name__}: {e}") from None


def _resize_shortest(img: Image.Image, size: int, resample) -> Image.Image:
    # torchvision.transforms.functional.resize(img, size) on a PIL image, step for step.
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return img if (new_w, new_h) == (w, h) else img.resize((new_w, new_h), resample)


def _center_crop(img: Image.Image, size: int) -> Image.Image:
    # torchvision.transforms.functional.center_crop for an image at least `size` on both sides.
    w, h = img.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return img.crop((left, top, left + size, top + size))


@dataclass(frozen=True)
class Preprocess:
    """One model's eval preprocessing, from its config."""

    size: int
    resize_mode: str
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @classmethod
    def of(cls, model) -> Preprocess:
        p = model.config.preprocess
        size = model.config.vision.image_size
        return cls(size, p.resize_mode, p.interpolation, tuple(p.mean), tuple(p.std))

    @property
    def geometry(self) -> tuple:
        """What the per-image (uint8) part depends on."""
        return (self.size, self.resize_mode, self.interpolation)

    def pixels(self, img: Image.Image) -> np.ndarray:
        """PIL image -> resized, cropped, RGB (size, size, 3) uint8 array."""
        resample = _PIL_INTERP[self.interpolation]
        if self.resize_mode == "shortest":
            img = _center_crop(_resize_shortest(img, self.size, resample), self.size)
        elif self.resize_mode == "squash":
            if img.size != (self.size, self.size):
                img = img.resize((self.size, self.size), resample)
        else:  # "longest": open_clip's own resize-long-side and pad-to-square (rare; imports torch)
            from open_clip.transform import CenterCropOrPad, ResizeKeepRatio
            from torchvision.transforms import InterpolationMode

            mode = InterpolationMode(self.interpolation)
            img = ResizeKeepRatio(self.size, interpolation=mode, longest=1)(img)
            img = CenterCropOrPad(self.size, fill=0)(img)
        if img.mode != "RGB":  # after the geometry, as open_clip's `_convert_to_rgb`
            img = img.convert("RGB")
        return np.array(img, dtype=np.uint8)  # a writable copy, as ToTensor makes

    def batch(self, pixels: list[np.ndarray], device):
        """uint8 arrays -> normalized (B, 3, size, size) float32 batch on `device` (ToTensor + Normalize)."""
        import torch

        x = torch.from_numpy(np.stack(pixels))
        if torch.device(device).type == "cuda":
            x = x.pin_memory().to(device, non_blocking=True)
        x = x.permute(0, 3, 1, 2).contiguous().to(torch.float32).div(255)
        mean = torch.as_tensor(self.mean, dtype=torch.float32, device=x.device)[None, :, None, None]
        std = torch.as_tensor(self.std, dtype=torch.float32, device=x.device)[None, :, None, None]
        return x.sub_(mean).div_(std)
