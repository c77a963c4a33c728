"""The one dtype table: every safetensors dtype shardprep reads, its size, its torch name,
and the model dtypes a user may ask for (`--dtype`)."""

from __future__ import annotations

from typing import Any

# safetensors name -> (bytes per element, attribute of `torch`)
DTYPES: dict[str, tuple[int, str]] = {
    "F64": (8, "float64"),
    "F32": (4, "float32"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I64": (8, "int64"),
    "I32": (4, "int32"),
    "I16": (2, "int16"),
    "I8": (1, "int8"),
    "U8": (1, "uint8"),
    "BOOL": (1, "bool"),
}
DTYPE_SIZES = {name: size for name, (size, _) in DTYPES.items()}
TORCH_DTYPE_NAMES = {name: torch_name for name, (_, torch_name) in DTYPES.items()}
# Floating dtypes that follow the model dtype; quantized (fp8) and integer tensors keep theirs.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
# The model dtypes vLLM's --dtype names, as `--dtype` and config.json spell them.
MODEL_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


# Casts vLLM makes keeping the bytes: e8m0 exponents viewed as uint8, int8 pairs of e2m1
# values copied into uint8 (the same bytes).
BIT_CASTS = frozenset({("F8_E8M0", "U8"), ("I8", "U8")})


# Integer dtypes, narrowest first: copying one into a wider one keeps its values.
INTEGER_DTYPES = ("I8", "I16", "I32", "I64")


def keeps_values(source: str, dest: str) -> bool:
    """Whether vLLM's copy of a `source` tensor into a parameter of dtype `dest` keeps what
    it means: the same dtype, a bit cast, floating point into floating point (the model's
    precision), an integer into one at least as wide. Not fp8 from anything else, nor
    floating point into integers (packed weights, index tables) or the reverse."""
    if source == dest or (source, dest) in BIT_CASTS:
        return True
    if source in FLOAT_DTYPES and dest in FLOAT_DTYPES:
        return True
    ints = INTEGER_DTYPES
    return source in ints and dest in ints and ints.index(source) <= ints.index(dest)


def cast(torch: Any, values: Any, dest: Any) -> Any:
    """A tensor in torch dtype `dest`, as vLLM's loaders put it into a parameter: the same
    bytes for `BIT_CASTS`, the value converted otherwise."""
    if (safetensors_name(values.dtype), safetensors_name(dest)) in BIT_CASTS:
        return values.view(dest)
    return values.to(dest)


def torch_dtype(torch: Any, name: str) -> Any:
    """The torch dtype of a safetensors dtype name (torch passed in: imported lazily)."""
    return getattr(torch, TORCH_DTYPE_NAMES[name])


def safetensors_name(torch_dtype_value: Any) -> str:
    """The safetensors name of a torch dtype (`torch.bfloat16` -> "BF16")."""
    text = str(torch_dtype_value).removeprefix("torch.")
    return next(name for name, torch_name in TORCH_DTYPE_NAMES.items() if torch_name == text)
