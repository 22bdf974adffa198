"""The tensors the interop tests hand over: every dtype the LibTorch bridge
carries in every layout its tests use. torch_peer.cpp and c_peer.c build the
same ones: element k (row-major in the 4x6 base) is k % 61, and for bool
k % 3 == 0; a layout is a view of that base."""
import torch

DTYPES = {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16,
    "int32": torch.int32, "int64": torch.int64, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64, "complex64": torch.complex64,
    "complex128": torch.complex128,
}

LAYOUTS = {
    "contiguous": lambda b: b,
    "transposed": lambda b: b.t(),
    "sliced": lambda b: b[1:3, 2:5],
    "strided": lambda b: b[:, ::2],
    "expanded": lambda b: b[1:2].expand(3, 6),
    "scalar": lambda b: b[2, 3],
    "empty": lambda b: b[:0],
    "permuted3d": lambda b: b.view(2, 2, 6).permute(2, 0, 1),
}


def base(dtype, device="cpu"):
    k = torch.arange(24, dtype=torch.int64)
    values = (k % 3 == 0) if dtype is torch.bool else (k % 61).to(dtype)
    return values.view(4, 6).to(device)


def case(tag, device="cpu", make_base=None):
    dtype_name, layout = tag.split("/")
    b = (make_base or base)(DTYPES[dtype_name], device)
    return LAYOUTS[layout](b)


def all_tags():
    return ["%s/%s" % (d, l) for d in DTYPES for l in LAYOUTS]


def check(tag, t, device="cpu"):
    """None if t is what tag names (values, shape, strides, dtype, device), else why not."""
    want = case(tag, device)
    if t.dtype != want.dtype:
        return "%s: dtype %s, want %s" % (tag, t.dtype, want.dtype)
    if tuple(t.shape) != tuple(want.shape) or (t.numel() and t.stride() != want.stride()):
        return "%s: shape %s stride %s, want %s %s" % (tag, tuple(t.shape), t.stride(), tuple(want.shape), want.stride())
    if t.device.type != torch.device(device).type:
        return "%s: on %s, want %s" % (tag, t.device, device)
    if not torch.equal(t.cpu(), want.cpu()):
        return "%s: values differ" % tag
    return None
