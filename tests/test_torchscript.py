"""Reading TorchScript archives (OpenAI's released CLIP files) as a state dict without executing code.

The archives are made here the way OpenAI made theirs: an open_clip `CLIP` with OpenAI's key layout
(QuickGELU, `input_resolution` / `context_length` / `vocab_size` buffers, the causal mask a plain
attribute of the model so the trace bakes it into the graph), optionally cast to fp16 as
`convert_weights_to_fp16` does, traced with `torch.jit.trace_module` and saved with `torch.jit.save`.
The reference is `torch.jit.load(path).state_dict()` (fine here: the test wrote the file).
"""

from __future__ import annotations

import pickle
import pickletools
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg, build_model_from_openai_state_dict
from open_clip.model import convert_weights_to_lp as convert_weights

from hype.convert import ConversionError, load_source
from hype.io.torchscript import TorchScriptError, is_torchscript_archive, read_torchscript_state_dict

OPENAI_SCALARS = ("input_resolution", "context_length", "vocab_size")


def _jit_state_dict(path: Path) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.jit is deprecated; it is the reference here
        return torch.jit.load(str(path), map_location="cpu").state_dict()


def _save(module: torch.jit.ScriptModule, path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(module, str(path))
    return path


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same keys in the same order, same dtypes, shapes and strides, the same bits."""
    assert list(got) == list(want)
    for key, ref in want.items():
        t = got[key]
        assert (t.dtype, t.shape, t.stride(), t.device.type) == (ref.dtype, ref.shape, ref.stride(), "cpu"), (
            key
        )
        assert torch.equal(t.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)), key


def _openai_style_clip(dtype: torch.dtype) -> CLIP:
    torch.manual_seed(0)
    model = CLIP(
        32,
        vision_cfg=CLIPVisionCfg(layers=2, width=64, patch_size=16, image_size=32),
        text_cfg=CLIPTextCfg(context_length=8, vocab_size=50, width=64, heads=1, layers=2),
        quick_gelu=True,
    ).eval()
    return openai_style(model, dtype)


def openai_style(model: CLIP, dtype: torch.dtype = torch.float32) -> CLIP:
    """An open_clip `CLIP` turned into what OpenAI's released model looked like before tracing."""
    image_size, ctx, vocab = _side(model.visual.image_size), model.context_length, model.vocab_size
    # OpenAI's model carries these as tensors in its state dict (open_clip pops them when loading).
    del model.context_length, model.vocab_size
    for name, value in zip(OPENAI_SCALARS, (image_size, ctx, vocab), strict=True):
        model.register_buffer(name, torch.tensor(value))
    # OpenAI's blocks hold the causal mask as a plain attribute: the trace turns it into a graph constant.
    model.attn_mask = model._buffers.pop("attn_mask")
    if dtype == torch.float16:
        convert_weights(model, torch.float16)  # what OpenAI's convert_weights did: LayerNorms stay fp32
    return model


def _side(size: int | tuple[int, int]) -> int:
    return size if isinstance(size, int) else size[0]  # a ViT's is (h, w), a ResNet's an int


def _trace(model: CLIP) -> torch.jit.ScriptModule:
    size, ctx = _side(model.visual.image_size), int(model.context_length)
    images = torch.ones(2, 3, size, size, dtype=model.visual.conv1.weight.dtype)
    text = torch.zeros(2, ctx, dtype=torch.long)
    methods = {"forward": (images, text), "encode_text": (text,), "encode_image": (images,)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # check_trace off: re-tracing several methods names the classes differently, not a real mismatch.
        return torch.jit.trace_module(model, methods, check_trace=False)


def openai_archive(model: CLIP, path: Path, dtype: torch.dtype = torch.float32) -> Path:
    """`model` saved as OpenAI saved its releases (a traced TorchScript archive); `model` is modified."""
    return _save(_trace(openai_style(model, dtype)), path)


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("torchscript")
    return {
        name: _save(_trace(_openai_style_clip(dtype)), folder / f"ViT-T-{name}.pt")
        for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16))
    }


def _rewrite(src: Path, dst: Path, replace: dict[str, bytes | None]) -> Path:
    """A copy of the zip `src` with members replaced (bytes) or removed (None)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = replace.get(info.filename, zin.read(info.filename))
            if data is not None:
                zout.writestr(info.filename, data)
    return dst


def _top(path: Path) -> str:
    with zipfile.ZipFile(path) as zf:
        return zf.namelist()[0].split("/")[0]


# --- OpenAI-style archives --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fp32", "fp16"])
def test_openai_style_archive_matches_jit_state_dict(archives, name):
    path = archives[name]
    assert is_torchscript_archive(path)
    sd = read_torchscript_state_dict(path)
    _assert_same(sd, _jit_state_dict(path))
    # OpenAI's layout: the three scalars are there, the baked-in causal mask is not.
    assert {k: int(sd[k]) for k in OPENAI_SCALARS} == {
        "input_resolution": 32,
        "context_length": 8,
        "vocab_size": 50,
    }
    assert not [k for k in sd if k.endswith("attn_mask")]
    dtypes = {str(t.dtype) for k, t in sd.items() if k not in OPENAI_SCALARS}
    assert dtypes == ({"torch.float32"} if name == "fp32" else {"torch.float16", "torch.float32"})


def test_open_clip_builds_its_model_from_the_state_dict(archives):
    """The state dict is what open_clip expects from OpenAI's archives: its loader accepts it strictly."""
    sd = read_torchscript_state_dict(archives["fp16"])
    model = build_model_from_openai_state_dict(dict(sd), cast_dtype=torch.float16)
    loaded = model.state_dict()
    assert loaded["visual.conv1.weight"].dtype == torch.float16
    assert torch.equal(loaded["visual.conv1.weight"], sd["visual.conv1.weight"])
    assert torch.equal(loaded["ln_final.weight"], sd["ln_final.weight"])


def test_load_source_returns_the_state_dict_of_an_archive(archives):
    path = archives["fp32"]
    _assert_same(load_source(path), _jit_state_dict(path))


# --- scripted modules -------------------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 4, bias=False)  # a parameter slot holding None: not listed
        self.bn = torch.nn.BatchNorm1d(4)  # buffers, one of them int64
        self.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])  # keys "0", "1"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.lin(x))
        for layer in self.layers:
            x = layer(x)
        return x


class _Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()
        self.scale = torch.nn.Parameter(torch.tensor(2.5, dtype=torch.float64))
        self.register_buffer("transposed", torch.arange(6.0).reshape(2, 3).t())  # non-contiguous
        self.register_buffer("row", self.block.layers[0].weight.detach()[1])  # shares a parameter's storage
        self.register_buffer("scratch", torch.ones(3, dtype=torch.bfloat16), persistent=False)
        self.register_buffer("flags", torch.tensor([True, False]))
        self.plain = torch.arange(4)  # a tensor attribute that is not a buffer: not in the state dict
        self.sizes = [1, 2, 3]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x) * self.scale.float() + self.row + self.scratch.float().sum()
        return y + self.plain[: len(self.sizes)].float().sum() + self.transposed.sum() + self.flags.sum()


def test_scripted_module_round_trip(tmp_path):
    module = _Scripted()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scripted = torch.jit.script(module)
    path = _save(scripted, tmp_path / "scripted.pt")
    sd = read_torchscript_state_dict(path)
    ref = _jit_state_dict(path)
    _assert_same(sd, ref)
    # TorchScript keeps the non-persistent buffer (torch.jit's own behaviour, matched here) and drops the
    # plain tensor attribute and the None bias.
    assert "scratch" in sd and "plain" not in sd and "block.lin.bias" not in sd
    assert set(sd) == set(module.state_dict()) | {"scratch"}
    assert not sd["transposed"].is_contiguous()


# --- refusals and damage ----------------------------------------------------------------------------


class _Exec:
    def __init__(self, code: str):
        self.code = code

    def __reduce__(self):
        return (exec, (self.code,))


class _System:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


def _with_root_attribute(data_pkl: bytes, name: str, value: object) -> bytes:
    """data.pkl with one more attribute in the root module's state dict (`EMPTY_DICT MARK` opens it)."""
    opening = b")\x81}("  # EMPTY_TUPLE NEWOBJ EMPTY_DICT MARK: the root object and its attribute dict
    at = data_pkl.index(opening) + len(opening)
    body = pickletools.optimize(pickle.dumps(value, protocol=2))[2:-1]  # no PROTO, STOP or memo writes
    key = pickle.dumps(name, protocol=2)[2:-1]
    return data_pkl[:at] + key + body + data_pkl[at:]


@pytest.mark.parametrize("kind", ["exec", "system"])
def test_a_forbidden_global_is_refused_without_running_it(archives, tmp_path, kind):
    marker = tmp_path / "executed"
    payload = _Exec(f"open({str(marker)!r}, 'w').close()") if kind == "exec" else _System(f"touch '{marker}'")
    top = _top(archives["fp32"])
    with zipfile.ZipFile(archives["fp32"]) as zf:
        data = _with_root_attribute(zf.read(f"{top}/data.pkl"), "evil", payload)
    evil = _rewrite(archives["fp32"], tmp_path / "evil.pt", {f"{top}/data.pkl": data})
    assert is_torchscript_archive(evil)
    refused = r"evil\.pt: data\.pkl refers to `(__builtin__\.exec|posix\.system)`"  # protocol 2 names
    with pytest.raises(TorchScriptError, match=refused):
        read_torchscript_state_dict(evil)
    with pytest.raises(ConversionError, match="without executing pickled code"):
        load_source(evil)
    assert not marker.exists()
    if kind == "exec":  # the payload is live: what any plain unpickler calls for it does run it
        call, args = payload.__reduce__()
        call(*args)
        assert marker.exists()


def test_a_truncated_archive_is_a_clear_error(archives, tmp_path):
    whole = archives["fp32"].read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole[: len(whole) // 2])
    assert not is_torchscript_archive(cut)
    with pytest.raises(TorchScriptError, match=r"cut\.pt: not a readable zip archive .*download it again"):
        read_torchscript_state_dict(cut)


def test_missing_and_damaged_members_are_named(archives, tmp_path):
    src = archives["fp32"]
    top = _top(src)
    no_data = _rewrite(src, tmp_path / "no_data.pt", {f"{top}/data.pkl": None})
    with pytest.raises(TorchScriptError, match=rf"no_data\.pt: the archive has no member '{top}/data\.pkl'"):
        read_torchscript_state_dict(no_data)
    no_storage = _rewrite(src, tmp_path / "no_storage.pt", {f"{top}/data/0": None})
    with pytest.raises(TorchScriptError, match=rf"tensor data '{top}/data/0' is missing"):
        read_torchscript_state_dict(no_storage)
    short = _rewrite(src, tmp_path / "short.pt", {f"{top}/data/0": b"\0" * 6})
    with pytest.raises(TorchScriptError, match=rf"short\.pt: {top}/data/0 holds 6 bytes, expected \d+"):
        read_torchscript_state_dict(short)
    garbled = _rewrite(src, tmp_path / "garbled.pt", {f"{top}/data.pkl": b"\x80\x02garbage"})
    with pytest.raises(TorchScriptError, match=r"data\.pkl is not a readable TorchScript module"):
        read_torchscript_state_dict(garbled)


def test_other_files_are_not_torchscript(tmp_path):
    saved = tmp_path / "state.pt"
    torch.save({"w": torch.zeros(2)}, saved)  # a zip too, but without constants.pkl
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a zip")
    for path in (saved, junk, tmp_path / "absent.pt", tmp_path):
        assert not is_torchscript_archive(path)
    with pytest.raises(TorchScriptError, match=r"state\.pt: not a TorchScript archive"):
        read_torchscript_state_dict(saved)
    with pytest.raises(TorchScriptError, match=r"absent\.pt: file not found"):
        read_torchscript_state_dict(tmp_path / "absent.pt")


def test_big_endian_archive_is_byteswapped(tmp_path):
    """An archive whose byteorder record says big: every multi-byte element is swapped on reading."""
    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        path = _save(torch.jit.script(module), tmp_path / "little.pt")
    top = _top(path)
    with zipfile.ZipFile(path) as zf:
        assert len([n for n in zf.namelist() if n.startswith(f"{top}/data/")]) == len(module.state_dict())
    # data.pkl writes (and numbers) the storages in state-dict order here: one per tensor.
    swapped = {
        f"{top}/data/{i}": t.reshape(-1, 1).view(torch.uint8).flip(1).contiguous().numpy().tobytes()
        for i, t in enumerate(module.state_dict().values())
    }
    big = _rewrite(path, tmp_path / "big.pt", {f"{top}/byteorder": b"big", **swapped})
    _assert_same(read_torchscript_state_dict(big), dict(module.state_dict()))


def _patched_numel(data_pkl: bytes, numel: int) -> bytes:
    """data.pkl of a one-storage archive with the storage's declared element count replaced."""
    ops = list(pickletools.genops(data_pkl))
    at = next(i for i, (_, arg, _) in enumerate(ops) if arg == "cpu")  # ('storage', type, key, 'cpu', numel)
    op, _, pos = next(o for o in ops[at + 1 :] if o[0].name.startswith("BININT"))
    end = pos + 1 + {"BININT1": 1, "BININT2": 2, "BININT": 4}[op.name]
    return data_pkl[:pos] + b"J" + numel.to_bytes(4, "little", signed=True) + data_pkl[end:]


def test_a_compressed_tensor_entry_is_refused_before_it_is_inflated(tmp_path):
    """torch.jit.save stores tensor data uncompressed; a crafted archive whose small deflated entry
    declares 128 MiB is refused before a byte of it is allocated (the bound is the file's own size)."""
    from memory_support import run_bounded

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        src = _save(torch.jit.script(torch.nn.Linear(2, 3, bias=False)), tmp_path / "lin.pt")
    top, numel = _top(src), 32 * 2**20  # float32: 128 MiB
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(bomb, "w") as zout:
        for info in zin.infolist():
            if info.filename == f"{top}/data/0":
                deflated = zipfile.ZipInfo(info.filename)
                deflated.compress_type = zipfile.ZIP_DEFLATED
                with zout.open(deflated, "w", force_zip64=True) as f:
                    for _ in range(8):
                        f.write(bytes(16 * 2**20))
            elif info.filename == f"{top}/data.pkl":
                zout.writestr(info.filename, _patched_numel(zin.read(info.filename), numel))
            else:
                zout.writestr(info, zin.read(info.filename))
    assert bomb.stat().st_size < 2**20
    result = run_bounded(
        "from hype.io.torchscript import read_torchscript_state_dict",
        f"read_torchscript_state_dict({str(bomb)!r})",
    )
    assert result["error"] and result["error"].startswith("TorchScriptError: "), result
    assert "compressed" in result["error"] and str(bomb) in result["error"], result
    assert result["growth_mb"] < 64, result
