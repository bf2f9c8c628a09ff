"""
Whether a source change left the kernels' machine code alone, without a GPU: compile the .cu before
and after with `nvcc -cubin` and compare every kernel's .text section, byte for byte. The anonymous
namespace's hash (it changes with the source) is taken out of the names; `--rename OLD=NEW` maps a
kernel name whose template arguments changed (a regular expression and its replacement).

    nvcc -cubin -std=c++17 -O3 -arch=sm_90 -fmad=false taco_kernels.cu -o after.cubin   (and before.cubin)
    python -m lab.cubin_diff before.cubin after.cubin
"""

import re
import struct
import sys


def kernels(path, renames=()):
    """{kernel section name: its bytes} of a cubin (a 64-bit little-endian ELF)."""
    with open(path, "rb") as f:
        d = f.read()
    if d[:5] != b"\x7fELF\x02":
        raise SystemExit(f"{path} is not a 64-bit ELF (a .cubin from nvcc -cubin)")
    (shoff,) = struct.unpack_from("<Q", d, 0x28)
    size, count, names_at = struct.unpack_from("<HHH", d, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", d, shoff + i * size) for i in range(count)]
    table = heads[names_at][4]
    out = {}
    for name_off, _, _, _, off, length, *_ in heads:
        name = d[table + name_off : d.index(b"\0", table + name_off)].decode()
        if name.startswith(".text."):
            name = re.sub(r"_GLOBAL__N__[0-9a-f]+_", "ANON_", name)
            for old, new in renames:
                name = re.sub(old, new, name)
            out[name] = d[off : off + length]
    return out


def main(argv):
    renames = [tuple(a.split("=", 1)[1].split("=", 1)) for a in argv if a.startswith("--rename=")]
    paths = [a for a in argv if not a.startswith("--")]
    if len(paths) != 2:
        raise SystemExit(__doc__)
    a, b = (kernels(p, renames) for p in paths)
    same = sorted(k for k in a if k in b and a[k] == b[k])
    for k in sorted(set(a) | set(b)):
        if k not in b or k not in a:
            print(("only in " + (paths[0] if k in a else paths[1])).ljust(24), k)
        elif a[k] != b[k]:
            print("DIFFERENT".ljust(24), k, len(a[k]), len(b[k]))
    print(f"{len(same)} of {len(a)} / {len(b)} kernels byte-identical")


if __name__ == "__main__":
    main(sys.argv[1:])
