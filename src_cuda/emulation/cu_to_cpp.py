"""Rewrite a .cu file into host C++ for cuda_emu.h: the only CUDA syntax a C++ compiler rejects.

    kernel<T><<<grid, block, smem, stream>>>(args)  ->  ::emu::launch(::emu::config(grid, block, smem, stream),
                                                            [](auto... xs) { kernel<T>(xs...); }, args)
    extern __shared__ T name[];                     ->  T* name = ::emu::dynamic_shared<T>();
    __shared__ T name[N][M];                        ->  T (&name)[N][M] = <one array per thread block>

Everything else (qualifiers, intrinsics, vector types) is left to cuda_emu.h, so the kernel
source compiles unchanged. Usage: cu_to_cpp.py IN.cu OUT.cpp
"""

from __future__ import annotations

import re
import sys

_IDENT = re.compile(r"[\w:]")
_DYNAMIC_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+)\s+(?:__align__\(\d+\)\s+)?(\w+)\s*\[\s*\]\s*;")
_STATIC_SHARED = re.compile(
    r"(?<![\w\"])__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+(?:<[^;>]*>)?)\s+(\w+)((?:\s*\[[^\]]+\])*)\s*;")


def _kernel_start(text: str, end: int) -> int:
    """Where the kernel expression ending just before `end` starts: a name, maybe with <...>."""
    i = end
    if text[i - 1] == ">":
        depth = 0
        while i > 0:
            i -= 1
            depth += {">": 1, "<": -1}.get(text[i], 0)
            if depth == 0:
                break
    while i > 0 and _IDENT.match(text[i - 1]):
        i -= 1
    return i


def _rewrite_launches(text: str) -> str:
    out, pos = [], 0
    while (open_at := text.find("<<<", pos)) >= 0:
        close_at = text.find(">>>", open_at)
        paren = text.index("(", close_at)
        if text[close_at + 3:paren].strip():
            raise SystemExit(f"cu_to_cpp: expected '(' after '>>>' at offset {close_at}")
        start = _kernel_start(text, open_at)
        kernel, config = text[start:open_at], text[open_at + 3:close_at]
        no_args = text[paren + 1:].lstrip().startswith(")")
        out.append(text[pos:start])
        out.append(f"::emu::launch(::emu::config({config}), [](auto... xs) {{ {kernel}(xs...); }}{'' if no_args else ', '}")
        pos = paren + 1
    out.append(text[pos:])
    return "".join(out)


def _static_shared(m: re.Match) -> str:
    type_, name, dims = m.group(1), m.group(2), m.group(3).replace(" ", "")
    site = "[] { static const char site = 0; return &site; }()"  # one per declaration and instantiation
    return (f"{type_} (&{name}){dims} = *reinterpret_cast<{type_} (*){dims}>("
            f"::emu::static_shared({site}, sizeof({type_}{dims})));")


def rewrite(text: str) -> str:
    text = _rewrite_launches(text)
    text = _DYNAMIC_SHARED.sub(r"\1* \2 = ::emu::dynamic_shared<\1>();", text)
    return _STATIC_SHARED.sub(_static_shared, text)


if __name__ == "__main__":
    source, target = sys.argv[1], sys.argv[2]
    with open(source) as f:
        text = f.read()
    with open(target, "w") as f:
        f.write(f'#line 1 "{source}"\n' + rewrite(text))
