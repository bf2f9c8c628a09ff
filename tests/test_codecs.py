"""Every codec against an independent, straightforward float64 implementation of its definition
(Sylvester Hadamard matrix, nearest-value search on the enumerated FP8 grid), plus format-derived
error bounds and the edge cases (zeros, NaN/Inf, tiny, huge, awkward sizes, dtypes)."""

import math

import pytest
import torch

import taco
from lab.tahquant import TahQuant

# the definitions, written out again here: (alpha, rotation, scale scope, format)
DEFS = {
    "taco": (True, True, "block", "e4m3"),
    "fp8": (False, False, "none", "e4m3"),
    "fp8-tensor": (False, False, "tensor", "e4m3"),
    "ds": (False, False, "block", "e4m3"),
    "hadamard": (False, True, "tensor", "e4m3"),
    "ash": (True, True, "none", "e4m3"),
    "taco-e5m2": (True, True, "block", "e5m2"),
    "taco-int8": (True, True, "block", "int8"),
    "hint8": (False, True, "block", "int8"),
    "hint6": (False, True, "block", "int6"),
    "hint4": (False, True, "block", "int4"),
}
QMAX = {"e4m3": 448.0, "e5m2": 57344.0, "int8": 127.0, "int6": 31.0, "int4": 7.0}
BITS = {"e4m3": 8, "e5m2": 8, "int8": 8, "int6": 6, "int4": 4}
TOL = {"fp8": 0.3, "hint4": 0.3}  # round-trip relative error allowed (default 0.1); 4-bit: ~12% on
# realistic data, 27% on the periodic +-1e-30 pattern below


def fp8_grid(fmt):
    """All finite non-negative values of the format, ascending, with their (positive) code bytes."""
    ebits, mbits, bias = (4, 3, 7) if fmt == "e4m3" else (5, 2, 15)
    vals, codes = [], []
    for e in range(2**ebits):
        for m in range(2**mbits):
            if fmt == "e4m3" and e == 15 and m == 7:
                continue  # E4M3fn: S.1111.111 is NaN, no infinities
            if fmt == "e5m2" and e == 31:
                continue  # E5M2: exponent 31 is Inf/NaN
            v = (m / 2**mbits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2**mbits) * 2.0 ** (e - bias)
            vals.append(v)
            codes.append((e << mbits) | m)
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(codes)


def round_fp8(y, fmt):
    """Nearest representable value, ties to the even code, saturating: an independent cast."""
    vals, codes = fp8_grid(fmt)
    a = y.abs().clamp(max=vals[-1].item())
    hi = torch.searchsorted(vals, a).clamp(max=len(vals) - 1)
    lo = (hi - 1).clamp(min=0)
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi, torch.where(codes[lo] % 2 == 0, lo, hi)))
    return torch.where(torch.signbit(y), -vals[pick], vals[pick])


def quant_ref(y, fmt):
    y = y.clamp(-QMAX[fmt], QMAX[fmt])
    return round_fp8(y, fmt) if fmt.startswith("e") else torch.round(y)  # torch.round: half to even


def hadamard_matrix(B):
    H = torch.ones(1, 1, dtype=torch.float64)
    while H.shape[0] < B:
        H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
    return H


def independent_roundtrip(x, name, B=256, tau=1.0, eps=1e-30):
    """Returns (decoded x, per-block y = Z/s before rounding, per-block s, alpha) in float64."""
    adaptive, rotate, scope, fmt = DEFS[name]
    n = x.numel()
    nb = max(1, -(-n // B))
    g = torch.zeros(nb * B, dtype=torch.float64)
    g[:n] = x.reshape(-1).double()
    g = g.view(nb, B)
    alpha = (
        tau / torch.sqrt((g * g).mean(1, keepdim=True) + eps) if adaptive else torch.ones(nb, 1, dtype=torch.float64)
    )
    H = hadamard_matrix(B) / math.sqrt(B)
    z = (alpha * g) @ H.T if rotate else alpha * g
    if scope == "block":
        s = z.abs().amax(1, keepdim=True) / QMAX[fmt]
    elif scope == "tensor":
        s = (z.abs().max() / QMAX[fmt]).expand(nb, 1)
    else:
        s = torch.ones(nb, 1, dtype=torch.float64)
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    y = z / s_safe
    zq = quant_ref(y, fmt) * s
    out = (zq @ H if rotate else zq) / alpha
    return out.reshape(-1)[:n], y, s, alpha


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-300)).item()


def realistic(n, seed=0):
    """Heavy-tailed, near-zero bulk with a few outliers: the shape of TP partial sums (paper Fig. 4)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.02
    x += torch.randn(n, generator=g).pow(3) * 0.01
    x[torch.randint(0, n, (max(1, n // 500),), generator=g)] *= 40.0
    return x


# --- each codec vs its independent definition --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DEFS))
def test_codec_matches_independent_definition(name):
    x = realistic(4096 + 77)
    ours = taco.get_codec(name).roundtrip(x)
    ref, _, _, _ = independent_roundtrip(x, name)
    # the two differ only where fp32 rounding (ours) and float64 (ref) fall on different sides of a
    # code boundary: a few codes in a thousand, each one step apart
    assert rel_err(ours, ref) < 0.01 * max(rel_err(ref, x), 1e-7) + 1e-6, (rel_err(ours, ref), rel_err(ref, x))
    differ = (ours.double() - ref).abs() > 1e-6 * x.abs().max()
    assert differ.float().mean() < 0.001


@pytest.mark.parametrize("name", sorted(DEFS))
def test_metadata_found_by_pointer_arithmetic(name):
    """Block k's (alpha_k, s_k) sit at payload_bytes + 4*nmeta*k; a tensor scale follows them."""
    cd = taco.get_codec(name)
    x = realistic(3 * 256)
    buf = cd.compress(x)
    assert buf.dtype == torch.uint8 and buf.dim() == 1 and buf.numel() == cd.nbytes(3 * 256)
    assert buf.numel() % 16 == 0
    _, _, s, alpha = independent_roundtrip(x, name)
    adaptive, _, scope, fmt = DEFS[name]
    pay = 3 * 256 * BITS[fmt] // 8
    nmeta = int(adaptive) + int(scope == "block")
    for k in range(3):
        meta = buf[pay + 4 * nmeta * k : pay + 4 * nmeta * (k + 1)].view(torch.float32).double()
        if adaptive:
            assert meta[0].item() == pytest.approx(alpha[k, 0].item(), rel=1e-5)
        if scope == "block":
            assert meta[-1].item() == pytest.approx(s[k, 0].item(), rel=1e-5)
    if scope == "tensor":
        assert buf[pay : pay + 4].view(torch.float32).item() == pytest.approx(s[0, 0].item(), rel=1e-5)
    assert not buf[pay + 4 * nmeta * 3 + 4 * (scope == "tensor") :].any()  # zero padding to 16 bytes


# --- building blocks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("B", [32, 64, 256, 512, 1024])
def test_hadamard_is_orthonormal_and_self_inverse(B):
    x = torch.randn(5, B, dtype=torch.float64)
    H = hadamard_matrix(B)
    torch.testing.assert_close(taco.fwht(x), x @ H.T)  # the butterfly is H_B
    torch.testing.assert_close(taco.fwht(x, reverse=True), x @ H.T)  # in either stride order
    torch.testing.assert_close(H @ H.T, B * torch.eye(B, dtype=torch.float64))
    torch.testing.assert_close(taco.fwht(taco.fwht(x)) / B, x)  # (H/sqrt B)^2 = I


@pytest.mark.parametrize("B", [64, 256, 1024])  # sqrt(B) a power of two: every step exact
def test_rotated_codes_are_stored_in_lane_order(B):
    """Wire order of a rotated block: position (B/32) u + m holds the code of rotated element u + 32 m.
    The input is built so that the rotation gives integers z with max |z| = 127, exactly: then s = 1
    and hint8's codes are z itself, and decoding gives the input back bit for bit."""
    g = torch.Generator().manual_seed(B)
    z = torch.randint(-126, 127, (B,), generator=g).float()
    z[5] = 127.0
    x = taco.fwht(z.double()).float() * (1.0 / math.sqrt(B))  # H z / sqrt(B): exact
    cd = taco.get_codec("hint8", B)
    buf = cd.encode(x, 1, B)
    codes = buf[0, :B].view(torch.int8).float()
    u, m = torch.meshgrid(torch.arange(32), torch.arange(B // 32), indexing="ij")
    assert torch.equal(codes[(B // 32) * u + m], z[u + 32 * m])
    assert torch.equal(taco.lane_order(taco.lane_order(z), inverse=True), z)
    assert torch.equal(cd.decode(buf, B), x)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_cast_is_rne_and_saturating(fmt):
    vals, _ = fp8_grid(fmt)
    mids = (vals[1:] + vals[:-1]) / 2  # exact ties
    y = torch.cat(
        [
            vals,
            mids,
            -mids,
            torch.randn(20000, dtype=torch.float64) * vals[-1].item() / 8,
            torch.tensor([1e6, -1e6, vals[-1].item() * 1.01]),
        ]
    ).float()
    ours = taco.dequantize(taco.quantize(y, fmt), fmt).double()
    assert torch.equal(ours, quant_ref(y.double(), fmt))
    assert ours.abs().max().item() == vals[-1].item()  # saturates, never Inf/NaN


def test_int4_packing_roundtrips_every_code():
    q = torch.arange(-7, 9).clamp(max=7)  # 16 codes
    packed = taco.pack_bits(q, 4)
    assert packed.numel() == 8 and torch.equal(taco.unpack_bits(packed, 4), q)
    assert taco.pack_bits(torch.tensor([1, 2, -1, 3]), 4).tolist() == [0x21, 0x3F]  # the first code low
    assert taco.get_codec("hint4").nbytes(256 * 4) == 4 * (128 + 4)


def test_int6_packing_roundtrips_every_code():
    q = torch.arange(-31, 33).clamp(max=31)  # 64 codes, a multiple of 4
    packed = taco.pack_bits(q, 6)
    assert packed.numel() == 48 and packed.dtype == torch.uint8
    assert torch.equal(taco.unpack_bits(packed, 6), q)
    # w = 1 | 2 << 6 | 3 << 12 | 4 << 18 = 0x103081 -> bytes 0x81 0x30 0x10 (the kernels' layout)
    assert taco.pack_bits(torch.tensor([1, 2, 3, 4]), 6).tolist() == [0x81, 0x30, 0x10]
    assert taco.get_codec("hint6").nbytes(256 * 4) == 4 * (192 + 4)  # 25% fewer payload bytes


def test_alpha_cancels_in_hint8():
    """Z/s is invariant to alpha: exactly for a power-of-two alpha, up to fp32 rounding otherwise."""
    cd = taco.get_codec("hint8")
    x = realistic(64 * 256)
    pay = x.numel()
    codes = lambda t: cd.compress(t)[:pay].view(torch.int8).int()
    assert torch.equal(codes(x), codes(x * 2.0**7))
    blocks = x.view(64, 256)
    alpha = 1.0 / torch.sqrt((blocks * blocks).mean(1, keepdim=True) + 1e-30)  # taco's alpha, tau = 1
    diff = (codes(x) - codes((blocks * alpha).reshape(-1))).abs()
    assert diff.max().item() <= 1 and diff.float().mean().item() < 0.01


# --- error bounds from the formats ---------------------------------------------------------------------


def code_step(y, fmt):
    """Largest rounding error of one code at scaled value y (half a step of the format's grid)."""
    if fmt == "e4m3":
        return torch.maximum(y.abs() * 2.0**-4, torch.full_like(y, 2.0**-10))
    if fmt == "e5m2":
        return torch.maximum(y.abs() * 2.0**-3, torch.full_like(y, 2.0**-17))
    return torch.full_like(y, 0.5)


@pytest.mark.parametrize("name", ["taco", "ds", "taco-e5m2", "taco-int8", "hint8", "hint6", "hint4"])
@pytest.mark.parametrize("seed", [0, 1])
def test_block_error_within_format_bound(name, seed):
    """Per block, ||G' - G||_2 <= (s/alpha) * sqrt(sum half-step(y_i)^2): the rotation is orthonormal,
    so the code rounding error maps one-to-one back to the block. (+1e-5 relative for fp32 arithmetic.)"""
    x = realistic(32 * 256, seed)
    fmt = DEFS[name][3]
    out = taco.get_codec(name).roundtrip(x).double().view(32, 256)
    _, y, s, alpha = independent_roundtrip(x, name)
    bound = (s / alpha)[:, 0] * code_step(y, fmt).pow(2).sum(1).sqrt()
    err = (out - x.double().view(32, 256)).norm(dim=1)
    assert (err <= bound * (1 + 1e-3) + 1e-5 * x.double().view(32, 256).norm(dim=1)).all()


# --- edge cases ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DEFS))
@pytest.mark.parametrize("n", [0, 1, 255, 257, 997, 256 * 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sizes_and_dtypes(name, n, dtype):
    cd = taco.get_codec(name)
    x = realistic(max(n, 1))[:n].to(dtype).reshape(n, 1) if n else torch.zeros(0, 1, dtype=dtype)
    out = cd.roundtrip(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert cd.compress(x).numel() == cd.nbytes(cd.padded(n))
    if n:
        assert torch.isfinite(out).all()
        assert rel_err(out.float(), x.float()) < TOL.get(name, 0.1)


@pytest.mark.parametrize("name", sorted(DEFS))
def test_zeros_stay_zero(name):
    x = torch.zeros(1000)
    assert torch.equal(taco.get_codec(name).roundtrip(x), x)


@pytest.mark.parametrize("name", sorted(DEFS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_propagates(name, bad):
    x = realistic(1024)
    x[300] = bad
    out = taco.get_codec(name).roundtrip(x)
    assert not torch.isfinite(out[300])  # never silently finite
    if DEFS[name][2] == "block" or DEFS[name][0]:
        assert torch.isfinite(out[512:]).all()  # other blocks unharmed
        assert rel_err(out[512:], x[512:]) < TOL.get(name, 0.1)


@pytest.mark.parametrize("name", sorted(DEFS))
def test_tiny_block_does_not_become_nan(name):
    x = torch.full((512,), 1e-30)
    x[::3] = -1e-30
    out = taco.get_codec(name).roundtrip(x)
    assert torch.isfinite(out).all()
    if name not in ("fp8", "ash"):  # scale-free codecs flush 1e-30 to zero
        assert rel_err(out, x) < TOL.get(name, 0.1)


@pytest.mark.parametrize("name", sorted(DEFS))
def test_huge_values_never_silently_wrong(name):
    x = realistic(1024) * 1e32  # |x| up to ~1e31: fp32 squares overflow
    out = taco.get_codec(name).roundtrip(x)
    blocks_ok = torch.isfinite(out.view(4, 256)).all(1)
    if name == "fp8":  # the raw cast saturates, by definition
        assert out.abs().max().item() == 448.0 and blocks_ok.all()
        return
    assert blocks_ok.any() or DEFS[name][0]  # only alpha's sum of squares overflows
    for k in range(4):  # each block: accurate, or non-finite
        if blocks_ok[k]:
            assert rel_err(out.view(4, 256)[k], x.view(4, 256)[k]) < TOL.get(name, 0.1)


# --- the all-reduce's reduce step: the sum in the rotated domain -------------------------------------


def original_domain_reduce(cd, msgs, L):
    """Decode every message fully (inverse rotation included), sum in fp32, encode from scratch."""
    return cd._encode_ref(taco.rank_order_sum(cd._decode_ref(msgs, L)), 1, L)[0]


@pytest.mark.parametrize("name", sorted(DEFS))
def test_reduce_in_the_rotated_domain_is_the_sum(name):
    cd, L, P = taco.get_codec(name), 256 * 64, 3
    msgs = torch.stack([cd._encode_ref(realistic(L, seed=r), 1, L)[0] for r in range(P)])
    exact = cd._decode_ref(msgs, L).double().sum(0)  # what the P messages hold, summed
    ours = cd._decode_ref(cd.reduce_encode(msgs, L)[None], L)[0]
    plain = cd._decode_ref(original_domain_reduce(cd, msgs, L)[None], L)[0]
    if not DEFS[name][1]:  # unrotated: nothing changes
        assert torch.equal(ours, plain)
    # rotated: H is linear and orthonormal, so both round the same sum once (fp32 noise apart)
    e_ours, e_plain = rel_err(ours, exact), rel_err(plain, exact)
    assert abs(e_ours - e_plain) <= 1e-3 * e_plain, (e_ours, e_plain)
    assert e_ours < 2 * TOL.get(name, 0.1)


@pytest.mark.parametrize("name", ["taco", "hint8", "ash"])
def test_reduce_in_the_rotated_domain_keeps_bad_blocks_bad(name):
    """A NaN block stays NaN through the reduce; a block whose sum of squares overflows fp32 (a
    value of 1e38) is not bad: alpha falls back to the scaled sum, and the block decodes finite."""
    cd, L = taco.get_codec(name), 256 * 4
    x = [realistic(L, seed=r) for r in range(2)]
    x[1][300] = float("nan")  # block 1 of message 1
    x[0][600] = 1e38  # block 2: the sum of squares overflows
    out = cd._decode_ref(cd.reduce_encode(torch.stack([cd._encode_ref(v, 1, L)[0] for v in x]), L)[None], L)[0]
    bad = ~torch.isfinite(out.view(4, 256)).all(1)
    assert bad[1] and not bad[0] and not bad[3] and not bad[2]
    assert out[600] == pytest.approx(1e38, rel=0.05)


def test_unknown_codec_and_bad_block_size_are_refused():
    with pytest.raises(ValueError, match="unknown codec"):
        taco.get_codec("fp4")
    with pytest.raises(ValueError, match="power of two"):
        taco.get_codec("taco", codec_block=100)
    assert taco.get_codec("none") is taco.IDENTITY


# --- tahquant (TAH-Quant-style tiles: pivot swap + Hadamard on outlier tiles, INT4/INT3 by entropy) ---


def tahquant_definition(x, L, share=0.5, kappa=4.0, G=64):
    """Tile by tile in float64 with a Sylvester matrix and Python's own sort: the definition in
    lab.tahquant.TahQuant's docstring, written out again. Returns (decoded, int3 flags, Hadamard flags)."""
    H = hadamard_matrix(G) / math.sqrt(G)
    xs = torch.zeros(cdiv(x.numel(), L) * L, dtype=torch.float64)
    xs[: x.numel()] = x.double()
    out, int3s, hads = [], [], []
    for msg in xs.view(-1, L):
        tiles, keys = [], []
        for t, v in enumerate(msg.view(-1, G)):
            v = v.clone()
            bad = not torch.isfinite(v).all()
            had = not bad and kappa**2 * ((v / v.abs().max()) ** 2).mean() < 1
            p = int(v.abs().argmax()) if had else 0
            if had:
                v[0], v[p] = v[p].item(), v[0].item()
                v = H @ v
            step4 = (v.max() - v.min()) / 15
            q4 = torch.round((v - v.min()) / step4) if step4 > 0 else torch.zeros(G, dtype=torch.float64)
            counts = sorted(int((q4 == k).sum()) for k in range(16))
            keys.append((-sum(c * math.log2(c) for c in counts if c) if not bad else math.inf, t))
            tiles.append((v, bad, had, p))
        int3 = {t for _, t in sorted(keys)[: int(share * len(tiles))]}
        for t, (v, bad, had, p) in enumerate(tiles):
            levels = 7 if t in int3 else 15
            step = (v.max() - v.min()) / levels
            z = (
                torch.round((v - v.min()) / step) * step if step > 0 else torch.zeros(G, dtype=torch.float64)
            ) + v.min()
            if had:
                z = H @ z
                z[0], z[p] = z[p].item(), z[0].item()
            out.append(torch.full((G,), math.nan, dtype=torch.float64) if bad else z)
            int3s.append(t in int3)
            hads.append(had)
    return torch.cat(out)[: x.numel()], torch.tensor(int3s), torch.tensor(hads)


def cdiv(a, b):
    return -(-a // b)


def tahquant_flags(buf, L, G=64):
    T = L // G
    f = buf.view(-1, buf.shape[-1])[:, 8 * T : 9 * T].int().reshape(-1)
    return (f >> 7) & 1 == 1, (f >> 6) & 1 == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tahquant_matches_its_definition(seed):
    cd = taco.get_codec("tahquant")
    x = realistic(64 * 40 + 17, seed=seed)
    if seed == 2:
        x[[5, 64 * 7 + 3]] = torch.tensor([float("nan"), float("inf")])  # two bad tiles: never INT3
    L = cd.padded(x.numel())
    ref, int3, had = tahquant_definition(x, L)
    buf = cd.compress(x)
    ours_int3, ours_had = tahquant_flags(buf, L)
    assert torch.equal(ours_int3, int3) and torch.equal(ours_had, had)  # same decisions, tile by tile
    assert had.any() and int3.sum() == 20  # the data exercises both paths
    out = cd.decompress(buf, x.shape)
    ok = torch.isfinite(ref)
    assert torch.equal(torch.isnan(out), ~ok) and (~ok).sum() == (128 if seed == 2 else 0)
    assert rel_err(out[ok], ref[ok]) < 1e-5  # vs the codec's own error of ~15%: same algorithm
    assert 0.05 < rel_err(out[ok], x[ok]) < 0.25


def test_tahquant_wire_size_and_bits():
    cd = taco.get_codec("tahquant")
    L = 64 * 1024
    # per tile: 8 bytes (lo, step) + 1 flag byte + 32 (INT4) or 24 (INT3) bytes; half the tiles INT3
    assert cd.nbytes(L) == 1024 * 9 + 512 * 32 + 512 * 24
    assert cd.nbytes(L) * 8 / L == 4.625
    x = torch.randn(L)
    int3, _ = tahquant_flags(cd.compress(x), L)
    assert int(int3.sum()) == 512


def test_tahquant_pivot_swap_hides_an_outlier():
    """One 100x outlier in a tile of N(0,1) noise: without the Hadamard the 15 INT4 steps span the
    outlier and the noise collapses to one or two levels; with pivot swap + Hadamard the outlier
    becomes a constant offset that the zero point absorbs, and the noise keeps its resolution."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64 * 8, generator=g)
    x[64 * 3 + 37] = 100.0
    with_swap = TahQuant(int3_share=0.0)
    no_rotation = TahQuant(int3_share=0.0, kappa=math.inf)
    tile = slice(64 * 3, 64 * 4)
    e_swap = rel_err(with_swap.roundtrip(x)[tile], x[tile])
    e_plain = rel_err(no_rotation.roundtrip(x)[tile], x[tile])
    assert e_swap < 0.5 * e_plain
    _, had = tahquant_flags(with_swap.compress(x), 64 * 8)
    assert had.tolist() == [False, False, False, True, False, False, False, False]


@pytest.mark.parametrize("n", [0, 1, 63, 65, 997])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tahquant_sizes_dtypes_and_edges(n, dtype):
    cd = taco.get_codec("tahquant")
    x = realistic(max(n, 1))[:n].to(dtype)
    out = cd.roundtrip(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert cd.compress(x).numel() == cd.nbytes(cd.padded(n))
    if n:
        assert torch.isfinite(out).all() and rel_err(out.float(), x.float()) < 0.25
    assert torch.equal(cd.roundtrip(torch.zeros(n)), torch.zeros(n))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_tahquant_nonfinite_propagates(bad):
    x = realistic(640)
    x[100] = bad
    out = taco.get_codec("tahquant").roundtrip(x)
    assert torch.isnan(out[64:128]).all()  # the whole tile
    assert torch.isfinite(out[:64]).all() and torch.isfinite(out[128:]).all()
    # near fp32's limit (sums of squares overflow): each tile as accurate as at scale 1, or non-finite
    normal = realistic(640)
    e1 = [rel_err(a, b) for a, b in zip(taco.get_codec("tahquant").roundtrip(normal).view(10, 64), normal.view(10, 64))]
    huge = normal * 1e37
    out = taco.get_codec("tahquant").roundtrip(huge).view(10, 64)
    for k in range(10):
        if torch.isfinite(out[k]).all():
            assert rel_err(out[k], huge.view(10, 64)[k]) == pytest.approx(e1[k], abs=1e-3)


# --- finite in, finite out: magnitudes near the formats' limits ---------------------------------


def emulated_all_reduce(cd, xs, dtype):
    """Steps 2, 4 and 6 of the two-shot all-reduce for one shard: every rank's message, the
    rank-order reduce, the decode (as taco.all_reduce runs them for W ranks)."""
    n = xs[0].numel()
    L = cd.padded(n)
    msgs = torch.stack([cd.encode(x.reshape(-1), 1, L)[0] for x in xs])
    return cd.decode(cd.reduce_encode(msgs, L)[None], L, n, dtype)


EXTREMES = {  # name: (ranks' inputs as float64, dtypes where every sum is representable)
    "zeros and one tiny value": (
        lambda: [torch.zeros(512).index_fill_(0, torch.tensor([3]), 1e-36)] * 2,
        (torch.float32, torch.bfloat16),
    ),
    "one huge value among small ones": (
        lambda: [
            torch.randn(512, generator=torch.Generator().manual_seed(r)) * 1e-3
            + torch.zeros(512).index_fill_(0, torch.tensor([7]), 3e37)
            for r in range(2)
        ],
        (torch.float32, torch.bfloat16),
    ),
    "1e38 on each of two ranks": (
        lambda: [torch.zeros(512).index_fill_(0, torch.tensor([9]), 1e38)] * 2,
        (torch.float32, torch.bfloat16),
    ),
    "a block of one sign, huge": (lambda: [torch.full((512,), 1e37)] * 2, (torch.float32, torch.bfloat16)),
    "fp16 sums just below its max": (
        lambda: [32000.0 + 750.0 * torch.rand(4096, generator=torch.Generator().manual_seed(r)) for r in range(2)],
        (torch.float16,),
    ),
}


@pytest.mark.parametrize("case", list(EXTREMES))
@pytest.mark.parametrize("name", sorted(taco.CODECS))
def test_finite_input_gives_finite_output_near_the_limits(name, case):
    """Where the true sum is representable, no codec turns finite input into NaN or Inf: tiny
    blocks get the smallest scale (1/s stays finite), the Hadamard transform runs on x / B (encode)
    and in units of 2^64 for huge scales (decode), alpha falls back to a scaled sum of squares, and
    decoded values saturate at the output type's largest finite value. The sum stays near the
    true one, relative to the block's largest value."""
    make, dtypes = EXTREMES[case]
    cd = taco.get_codec(name)
    for dtype in dtypes:
        xs = [x.to(dtype) for x in make()]
        true = xs[0].double() + xs[1].double()
        out = emulated_all_reduce(cd, xs, dtype)
        assert torch.isfinite(out).all(), (name, case, dtype, out[~torch.isfinite(out)][:4])
        err = (out.double() - true).abs().max() / true.abs().max().clamp(min=1e-300)
        assert err <= (1.0 if name in ("fp8", "ash", "hint4") else 0.15), (name, case, dtype, float(err))


ALTERNATING = torch.tensor([1.0, -1.0]).repeat(256)


@pytest.mark.parametrize("name", sorted(n for n, sp in taco.CODECS.items() if sp.rotate))
def test_the_rotated_reduce_overflows_where_a_partial_sums_block_norm_passes_fp32(name):
    """The boundary of the rotated-domain reduce, whatever the signs: the rotation is orthonormal,
    so a block of the rank-order partial sum with L2 norm r puts up to r into one coefficient, and
    past fp32's largest value (3.4e38) the block is marked bad (NaN on every element, never a
    wrong finite value). Alternating +-v on W = 3 ranks: r = 3 v sqrt(256) = 48 v."""
    cd = taco.get_codec(name)
    for v, finite in ((7e36, True), (1e37, False)):  # r = 3.36e38 and 4.8e38
        out = emulated_all_reduce(cd, [ALTERNATING * v] * 3, torch.float32)
        assert torch.isfinite(out).all() if finite else out.isnan().all(), (v, out[:4])
        if finite:
            assert (out - 3 * v * ALTERNATING).abs().max() <= 0.15 * 3 * v


@pytest.mark.parametrize("name", sorted(taco.CODECS))
def test_a_sum_past_fp32_saturates_or_marks_its_scale_group_bad(name):
    """One element whose true sum (6e38) is past fp32's range: the codecs with a per-block or
    per-message scale and no rotation mark that block (ds) or message (fp8-tensor) bad, NaN;
    the others saturate it (at fp32's largest value; the scale-free fp8 at its own, 448). Either
    way nothing is silently wrong: a saturated value is documented, NaN is seen."""
    x = torch.randn(512, generator=torch.Generator().manual_seed(0))
    x[5] = 3e38
    out = emulated_all_reduce(taco.get_codec(name), [x, x], torch.float32)
    group = {"ds": slice(0, 256), "fp8-tensor": slice(0, 512)}.get(name)
    if group is not None:
        assert out[group].isnan().all() and torch.isfinite(out[group.stop :]).all()
    else:
        top = 448.0 if name == "fp8" else torch.finfo(torch.float32).max
        assert torch.isfinite(out).all() and out[5] == top


@pytest.mark.parametrize("name", sorted(taco.CODECS))
def test_float64_goes_through_at_fp32_precision(name):
    """float64 is encoded from its fp32 values and decoded back to float64: the same error as the
    fp32 tensor's; a finite value past fp32's range saturates there, NaN/Inf mark the block."""
    cd = taco.get_codec(name)
    x = realistic(1000, seed=1)
    y = cd.roundtrip(x.double())
    assert y.dtype == torch.float64 and torch.equal(y, cd.roundtrip(x).double())
    big = torch.zeros(512, dtype=torch.float64)
    big[3], big[5], big[300] = 1e300, -1e300, float("inf")
    out = cd.roundtrip(big)
    if cd.spec.scale == "tensor":
        assert out.isnan().all()  # one Inf: the whole message
    elif cd.spec.scale == "none" and not cd.spec.adaptive:
        assert out[3] == 448.0 and out[5] == -448.0 and out[300].isnan()  # fp8: per element, saturating cast
    else:  # saturated at fp32's range, both signs
        assert torch.isfinite(out[:256]).all() and out[3] > 1e38 and out[5] < -1e38 and out[256:].isnan().all()


@pytest.mark.parametrize("name", ["hint8", "taco", "fp8"])
def test_non_float_and_overlapping_tensors_are_refused_and_chunks_checked(name):
    import test_allreduce  # noqa: F401  (the launcher's world is not needed: the checks come first)

    with pytest.raises(TypeError, match="int32 tensor cannot go through"):
        taco.all_reduce(torch.arange(10, dtype=torch.int32), codec=name)
    with pytest.raises(ValueError, match="chunks=0 must be a positive integer"):
        taco.all_reduce(torch.ones(10), codec=name, chunks=0)
    for codec in (name, "none"):  # in place: an expand()ed view has no place for the sum
        with pytest.raises(ValueError, match="elements of x share memory"):
            taco.all_reduce(torch.ones(1, 4).expand(3, 4), codec=codec)


def test_kernel_params_refuse_a_message_past_32_bit_block_indices():
    import taco_ext  # the check comes before the extension is loaded, so it runs on a CPU too

    with pytest.raises(ValueError, match="at most 2\\^38"):
        taco_ext.params(taco.get_codec("hint8"), 2**38)


# --- the rounding rule: to nearest, ties to even, against independent definitions --------------


def e4m3_values():
    """Every finite E4M3 value from its bit layout (1 sign, 4 exponent bits with bias 7, 3 mantissa
    bits; exponent 0 subnormal; S.1111.111 is NaN), sorted, with the code of each."""
    vals = {}
    for code in range(256):
        s, e, m = code >> 7, (code >> 3) & 15, code & 7
        if e == 15 and m == 7:
            continue
        v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        vals.setdefault(-v if s else v, code)
    return sorted(vals.items())


def test_integer_codes_round_half_to_even():
    """quantize() (every INT codec's last step): halfway values go to the even integer, as Python's
    round() defines it."""
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, 126.5, -126.5, 4.4999, 4.5001] * 4)
    for fmt, decode in (
        ("int8", lambda b: b.view(torch.int8).float()),
        ("int6", lambda b: taco.unpack_bits(b, 6)),
        ("int4", lambda b: taco.unpack_bits(b, 4)),
    ):
        q = taco.QMAX[fmt]
        yy = y.clamp(-q, q)
        got = decode(taco.quantize(yy, fmt)).float().reshape(-1)
        assert got.tolist() == [float(round(v)) for v in yy.tolist()], fmt


def test_integer_codes_round_the_exact_product():
    """An INT code is round(Z * (1/s)) of the exact product (the kernels: one fma), not of the product
    rounded to fp32: values whose fp32 product rounds across a half are found, and each is coded as
    the exact product says."""
    cd = taco.get_codec("hint8")
    inv = 1.0 / taco.fdiv(torch.tensor([1.0]), cd.qmax)  # 1/s of a block whose absmax is 1: s = 1 / Qmax
    mids = ((torch.arange(1, 120) + 0.5) / inv).float()  # the values whose code is a half
    near = (mids.view(torch.int32)[:, None] + torch.arange(-40, 41)).reshape(-1).view(torch.float32)
    exact, rounded = torch.round(near.double() * inv.double()), torch.round(near * inv).double()
    pick = exact != rounded
    assert pick.sum() >= 20  # the case exists, often
    x = torch.zeros(256)
    x[0], x[1 : 1 + int(pick.sum())] = 1.0, near[pick][:255]
    codes = cd._encode_ref(x, 1, 256, rotated=True)[0, :256].view(torch.int8)  # no rotation: y = x / s
    n = int(pick.sum())
    assert codes[0] == 127 and codes[1 : 1 + n].tolist() == exact[pick][:255].tolist()


def test_e4m3_codes_round_to_nearest_even_at_every_midpoint():
    """quantize() to E4M3 (taco, ds, fp8, ...): every midpoint between two neighbouring values goes
    to the one whose code is even (mantissa LSB 0); just above or below it, to the nearer one."""
    vals = e4m3_values()
    mids, want, above, below = [], [], [], []
    for (a, ca), (b, cb) in zip(vals, vals[1:]):
        m = (a + b) / 2
        mids.append(m)
        want.append(ca if ca % 2 == 0 else cb)
        above.append(cb)
        below.append(ca)
    t = lambda v: torch.tensor(v, dtype=torch.float64).float()
    value = {c: v for v, c in vals} | {128: 0.0}  # -0 is zero (the tie next to it)
    q = lambda v: [value[c] for c in taco.quantize(t(v), "e4m3").tolist()]
    assert q(mids) == [value[c] for c in want]
    eps = [abs(b - a) * 1e-3 for (a, _), (b, _) in zip(vals, vals[1:])]
    assert q([m + e for m, e in zip(mids, eps)]) == [value[c] for c in above]
    assert q([m - e for m, e in zip(mids, eps)]) == [value[c] for c in below]
